"""Planning time and per-rank metadata size at scale (not a test).

For each case: the cost of planning one rank's refit (index the layouts,
build the planner, compute the rank's plan) for a sample of trainer and
engine ranks, and the size of what each rank publishes on the store
(msgspec): the tensor table, shared by all ranks of a side and stored once,
and the rank's own layout (its grids), which refers to that table.

    python benchmarks/plan_scale.py [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time

import msgspec

from reshard.costmodel.cluster import PRESETS, place
from reshard.costmodel.rules import EngineSpec, TrainerSpec, engine_layouts, trainer_layouts
from reshard.models import load_model
from reshard.plan.index import gc_paused
from reshard.plan.layout import Layout
from reshard.plan.planner import Planner

CASES = [
    ("llama3-70b", "fsdp=64", "tp=8,dp=8", "dgx-h100"),
    ("llama3-70b", "fsdp=72", "tp=8,dp=9", "gb200-nvl72"),
    ("qwen3-235b", "tp=4,pp=8,ep=16", "tp=8,dp=16", "dgx-h100"),
    ("deepseek-v3", "pp=16,ep=16", "tp=32,dp=8", "dgx-h100"),
]


def run_case(model: str, trainer: str, engine: str, cluster: str) -> dict:
    spec = load_model(model)
    tspec, espec = TrainerSpec.parse(trainer), EngineSpec.parse(engine)
    t_side = trainer_layouts(spec.tensors, spec.config, tspec)
    e_side = engine_layouts(spec.tensors, spec.config, espec, base=tspec.world)
    placement = place(PRESETS[cluster], tspec.world, espec.world)
    domain_of = placement.domain_of.__getitem__
    ranks = [
        0,
        tspec.world // 2,
        tspec.world - 1,
        tspec.world,
        tspec.world + espec.world // 2,
        tspec.world + espec.world - 1,
    ]
    rows = []
    for r in ranks:
        gc.collect()
        with gc_paused():
            t0 = time.perf_counter()
            src = t_side.layout_set("source", check_ranks=(r,))
            dst = e_side.layout_set("destination", check_ranks=(r,))
            t1 = time.perf_counter()
            planner = Planner(src, dst, domain_of=domain_of)
            t2 = time.perf_counter()
            plan = planner.plan_for(r)
            t3 = time.perf_counter()
            n = len(plan.transfers())
            del plan, planner, src, dst
        side = t_side if r < tspec.world else e_side
        lay = side.layout_of(r)
        grids_only = Layout(rank=r, tensors=(), grids=lay.grids)
        rows.append(
            {
                "rank": r,
                "role": "trainer" if r < tspec.world else "engine",
                "index_s": round(t1 - t0, 4),
                "planner_s": round(t2 - t1, 4),
                "plan_s": round(t3 - t2, 4),
                "total_s": round(t3 - t0, 4),
                "transfers": n,
                "grids": len(lay.grids),
                "layout_bytes": len(msgspec.msgpack.encode(grids_only)),
            }
        )
    return {
        "case": f"{model} {trainer} -> {engine} on {cluster}",
        "tensors": len(spec.tensors),
        "trainer_table_bytes": len(msgspec.msgpack.encode(t_side.table)),
        "engine_table_bytes": len(msgspec.msgpack.encode(e_side.table)),
        "ranks": rows,
        "max_plan_seconds": max(r["total_s"] for r in rows),
        "max_layout_bytes": max(r["layout_bytes"] for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = [run_case(*c) for c in CASES]
    if args.json:
        print(json.dumps({"machine": platform.processor() or platform.machine(), "cases": results}, indent=2))
        return
    for res in results:
        print(f"{res['case']}: {res['tensors']} tensors")
        print(
            f"  tables (stored once per side): trainer {res['trainer_table_bytes'] / 1e6:.2f} MB, "
            f"engine {res['engine_table_bytes'] / 1e6:.2f} MB"
        )
        print(
            f"  {'rank':>6} {'role':>8} {'index s':>8} {'planner s':>10} {'plan s':>8} {'total s':>8} "
            f"{'transfers':>10} {'grids':>6} {'layout KB':>10}"
        )
        for r in res["ranks"]:
            print(
                f"  {r['rank']:>6} {r['role']:>8} {r['index_s']:>8.3f} {r['planner_s']:>10.3f} {r['plan_s']:>8.3f} "
                f"{r['total_s']:>8.3f} {r['transfers']:>10} {r['grids']:>6} {r['layout_bytes'] / 1e3:>10.1f}"
            )


if __name__ == "__main__":
    main()
