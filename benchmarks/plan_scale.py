"""Planning time, memory and per-rank metadata size at scale (not a test).

For each case, for a sample of trainer and engine ranks: the cost of
planning one rank's refit (index the layouts, build the planner, compute
the rank's plan) as that rank's own process would, with the mesh indexes
that planners of one process share cleared first, in wall and CPU seconds
(other work on the machine inflates the wall clock, much less the CPU
time); the peak memory that planning allocates (tracemalloc, in a second
run, since tracing slows Python down); and the size of what each rank
publishes on the store (msgspec): the tensor table, shared by all ranks of
a side and stored once, and the rank's own layout (its grids), which refers
to that table.

    python benchmarks/plan_scale.py [--json] [--only SUBSTRING] [--repeat N]

``--repeat N`` plans each sampled rank N times and reports its fastest run
(on a machine shared with other work, the run least disturbed).

A model that is not a preset of the code under test (an older checkout)
is read from ``reshard/models/configs`` next to this script.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
import tracemalloc
from pathlib import Path

import msgspec

from reshard.costmodel.cluster import PRESETS, place
from reshard.costmodel.rules import EngineSpec, TrainerSpec, engine_layouts, trainer_layouts
from reshard.models import load_model
from reshard.plan import layout as layout_module
from reshard.plan.index import gc_paused
from reshard.plan.layout import Layout
from reshard.plan.planner import Planner

CASES = [
    ("llama3-70b", "fsdp=64", "tp=8,dp=8", "dgx-h100"),
    ("llama3-70b", "fsdp=72", "tp=8,dp=9", "gb200-nvl72"),
    ("qwen3-235b", "tp=4,pp=8,ep=16", "tp=8,dp=16", "dgx-h100"),
    ("deepseek-v3", "pp=16,ep=16", "tp=32,dp=8", "dgx-h100"),
    ("deepseek-v3", "pp=16,ep=64", "tp=32,dp=32", "dgx-h100"),
    ("deepseek-v3", "pp=16,ep=256", "tp=32,dp=128", "dgx-h100"),
    # The world 8.5x the first DeepSeek-V3 case, an engine rank's peers the
    # same (engine replicas added, the trainer kept): what grows with the
    # world alone.
    ("deepseek-v3", "pp=16,ep=16", "tp=32,dp=128", "dgx-h100"),
    ("kimi-k2", "pp=16,ep=16", "tp=32,dp=8", "dgx-h100"),
    ("kimi-k2", "pp=16,ep=64", "tp=32,dp=32", "dgx-h100"),
]

CONFIGS = Path(__file__).resolve().parents[1] / "reshard" / "models" / "configs"


def _model(name: str):
    try:
        return load_model(name)
    except ValueError:
        return load_model(str(CONFIGS / f"{name}.json"))


def _fresh() -> None:
    """As a rank's own process: no mesh index left by an earlier rank."""
    clear = getattr(layout_module, "clear_caches", None)
    if clear is not None:
        clear()
    else:  # older checkouts
        layout_module._mesh_index.cache_clear()
    gc.collect()


def _plan_one(t_side, e_side, domain_of, rank: int) -> tuple[float, float, float, float, int, int]:
    """Seconds to index, build the planner and plan, CPU seconds of all
    three (what other processes on the machine take from the wall clock
    but not from this), the plan's transfers and its peers (the ranks it
    sends to or receives from)."""
    with gc_paused():
        c0 = time.process_time()
        t0 = time.perf_counter()
        src = t_side.layout_set("source", check_ranks=(rank,))
        dst = e_side.layout_set("destination", check_ranks=(rank,))
        t1 = time.perf_counter()
        planner = Planner(src, dst, domain_of=domain_of)
        t2 = time.perf_counter()
        plan = planner.plan_for(rank)
        t3 = time.perf_counter()
        cpu = time.process_time() - c0
        n = len(plan.transfers())
        peers = {p for rp in plan.rounds for p in (*rp.sends, *rp.recvs)}
        del plan, planner, src, dst
    return t1 - t0, t2 - t1, t3 - t2, cpu, n, len(peers)


def _peak_bytes(t_side, e_side, domain_of, rank: int) -> int:
    _fresh()
    tracemalloc.start()
    try:
        _plan_one(t_side, e_side, domain_of, rank)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def run_case(model: str, trainer: str, engine: str, cluster: str, repeat: int = 1) -> dict:
    spec = _model(model)
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
        runs = []
        for _ in range(repeat):
            _fresh()
            runs.append(_plan_one(t_side, e_side, domain_of, r))
        index_s, planner_s, plan_s, cpu_s, n, peers = min(runs, key=lambda x: x[0] + x[1] + x[2])
        peak = _peak_bytes(t_side, e_side, domain_of, r)
        side = t_side if r < tspec.world else e_side
        lay = side.layout_of(r)
        grids_only = Layout(rank=r, tensors=(), grids=lay.grids)
        rows.append(
            {
                "rank": r,
                "role": "trainer" if r < tspec.world else "engine",
                "index_s": round(index_s, 4),
                "planner_s": round(planner_s, 4),
                "plan_s": round(plan_s, 4),
                "total_s": round(index_s + planner_s + plan_s, 4),
                "cpu_s": round(cpu_s, 4),
                "peak_mb": round(peak / 1e6, 1),
                "transfers": n,
                "peers": peers,
                "grids": len(lay.grids),
                "layout_bytes": len(msgspec.msgpack.encode(grids_only)),
            }
        )
    return {
        "case": f"{model} {trainer} -> {engine} on {cluster}",
        "repeat": repeat,
        "ranks_total": tspec.world + espec.world,
        "tensors": len(spec.tensors),
        "trainer_table_bytes": len(msgspec.msgpack.encode(t_side.table)),
        "engine_table_bytes": len(msgspec.msgpack.encode(e_side.table)),
        "ranks": rows,
        "max_plan_seconds": max(r["total_s"] for r in rows),
        "max_plan_cpu_seconds": max(r["cpu_s"] for r in rows),
        "max_peak_mb": max(r["peak_mb"] for r in rows),
        "max_layout_bytes": max(r["layout_bytes"] for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", default="", help="run the cases whose description contains this")
    ap.add_argument("--repeat", type=int, default=1, help="plan each rank this many times; report its fastest run")
    args = ap.parse_args()
    cases = [c for c in CASES if args.only in " ".join(c)]
    for case in cases:
        res = run_case(*case, repeat=args.repeat)
        if args.json:
            print(json.dumps({"machine": platform.processor() or platform.machine(), **res}))
            continue
        best = f", each rank's fastest of {res['repeat']} runs" if res["repeat"] > 1 else ""
        print(f"{res['case']}: {res['ranks_total']} ranks, {res['tensors']} tensors{best}")
        print(
            f"  tables (stored once per side): trainer {res['trainer_table_bytes'] / 1e6:.2f} MB, "
            f"engine {res['engine_table_bytes'] / 1e6:.2f} MB"
        )
        print(
            f"  {'rank':>6} {'role':>8} {'index s':>8} {'planner s':>10} {'plan s':>8} {'total s':>8} "
            f"{'cpu s':>6} {'peak MB':>8} {'transfers':>10} {'peers':>6} {'grids':>6} {'layout KB':>10}"
        )
        for r in res["ranks"]:
            print(
                f"  {r['rank']:>6} {r['role']:>8} {r['index_s']:>8.3f} {r['planner_s']:>10.3f} {r['plan_s']:>8.3f} "
                f"{r['total_s']:>8.3f} {r['cpu_s']:>6.3f} {r['peak_mb']:>8.1f} {r['transfers']:>10} {r['peers']:>6} "
                f"{r['grids']:>6} {r['layout_bytes'] / 1e3:>10.1f}"
            )
        print(flush=True)


if __name__ == "__main__":
    main()
