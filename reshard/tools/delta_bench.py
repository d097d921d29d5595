"""``reshard bench --case delta``: dense, delta and gather-and-broadcast refits
of a model updated by real AdamW steps, measured in one run.

The model is the bench's Llama-style model (414 MB in bf16 by default)
initialized as models are (matrices ``N(0, 0.02)``, norms 1). Trainer
ranks (``fsdp=2``, ``Shard(0)``) hold it in bf16, or in float32 master
weights while the engine (``tp=2``, vLLM's layout) keeps bf16; each takes
AdamW steps (torch's, on gradients drawn at random: Adam normalizes their
scale, so every weight moves by about the learning rate) at each learning
rate asked for. After every step, every method refits the engine workers:

- ``delta``: reshard with ``GroupConfig.delta`` (its own group and its own
  destination tensors, patched refit after refit);
- ``dense``: reshard without deltas;
- ``gather_broadcast``: the baseline, in the dense group.

Each refit is timed from the moment the last rank enters until the last
rank leaves; wire bytes are what the engine workers received (payloads and
delta headers). After every step each worker checks that its delta
tensors equal its dense ones, bit for bit.
"""

from __future__ import annotations

import json
import statistics
import zlib
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["DeltaCase", "format_delta", "run_delta_bench"]

METHODS = ("delta", "dense", "gather_broadcast")
_METHOD = {"delta": "reshard", "dense": "reshard", "gather_broadcast": "gather_broadcast"}


@dataclass(frozen=True, kw_only=True, slots=True)
class DeltaCase:
    """One setting: the trainer's dtype and learning rate."""

    master: str = "bfloat16"
    """The dtype the trainer holds (``float32``: master weights; the engine keeps bf16)."""
    lr: float = 1e-6
    steps: int = 3
    warmup: int = 1


def _init(meta, dtype):
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(meta.name.encode()))
    if len(meta.shape) == 1:
        return torch.ones(meta.shape, dtype=dtype)
    return (torch.randn(meta.shape, generator=g) * 0.02).to(dtype)


def _rank(rank: int, address: str, bench: Any, case: DeltaCase) -> dict[str, Any]:
    import torch

    from reshard.costmodel.rules import EngineSpec, engine_layouts
    from reshard.plan.box import chunk_range
    from reshard.plan.layout import Mesh, TensorMeta
    from reshard.plan.specs import GridSpec
    from reshard.receiver import Receiver, Tensors
    from reshard.sender import Sender
    from reshard.tools.bench import bench_tensors, destination_slots
    from reshard.transport.group import GroupConfig
    from reshard.transport.messages import local_view

    torch.set_num_threads(1)
    metas = bench_tensors(bench)
    t = bench.trainer_ranks
    dense_cfg = GroupConfig(
        address=address,
        num_sources=t,
        num_destinations=bench.engine_tp,
        timeout_s=300,
        host_store=False,
        job="dense",
        domain="trainer" if rank < t else "engine",
    )
    delta_cfg = replace(dense_cfg, job="delta", delta=True)
    out: dict[str, Any] = {"rank": rank, "runs": []}
    total = case.warmup + case.steps
    if rank < t:
        dtype = getattr(torch, case.master)
        src_metas = [TensorMeta(m.name, m.shape, case.master) for m in metas]
        mesh = Mesh(shape=(t,))
        grids = [GridSpec(m, mesh, ((0,),) + ((),) * (len(m.shape) - 1)) for m in src_metas]
        params = {}
        for m in src_metas:
            lo, hi = chunk_range(m.shape[0], t, rank)
            params[m.name] = torch.nn.Parameter(_init(m, dtype)[lo:hi].clone())
        opt = torch.optim.AdamW(list(params.values()), lr=case.lr)
        tensors = {k: p.data for k, p in params.items()}
        senders = {
            "delta": Sender.from_pieces([], tensors, config=delta_cfg, rank=rank, grids=grids),
            "dense": Sender.from_pieces([], tensors, config=dense_cfg, rank=rank, grids=grids),
        }
        gen = torch.Generator().manual_seed(1000 + rank)
        # What each step changed, in the engine's bf16, counted here (a
        # sender counts a part predicted dense only every few refits).
        last = {k: v.to(torch.bfloat16, copy=True) for k, v in tensors.items()}
        out["changed"] = [(0, sum(v.numel() for v in last.values()))]
        for step in range(total + 1):
            if step:
                for p in params.values():
                    p.grad = torch.randn(p.shape, generator=gen).to(dtype)
                opt.step()
                now = {k: v.to(torch.bfloat16, copy=True) for k, v in tensors.items()}
                diff = sum(int((now[k].view(torch.int16) != last[k].view(torch.int16)).sum()) for k in now)
                out["changed"].append((diff, out["changed"][0][1]))
                last = now
            for i, method in enumerate(METHODS):
                ep = senders["delta" if method == "delta" else "dense"]
                st = ep.push(step * len(METHODS) + i + 1, method=_METHOD[method])
                out["runs"].append({"method": method, "step": step, **st.as_dict()})
        out["snapshot_bytes"] = senders["delta"].delta_snapshot_bytes
        for s in senders.values():
            s.close()
        return out
    side = engine_layouts(metas, bench.config, EngineSpec(tp=bench.engine_tp, dp=1), base=t)
    layout = side.layout_of(rank)
    slots = destination_slots(layout, rank)
    dests: dict[str, dict[str, torch.Tensor]] = {"delta": {}, "dense": {}}
    for _, s in slots:
        for d in dests.values():
            d.setdefault(s.local, torch.zeros(s.local_shape, dtype=torch.bfloat16))
    cfgs = {"delta": delta_cfg, "dense": dense_cfg}
    # Only reshard writes these tensors: checksums are taken after each refit, off the plan step.
    # Only reshard writes them: a delta's base, digested after each refit.
    receivers = {
        k: Receiver(Tensors(dests[k], private=True), config=c, rank=rank, layout=layout) for k, c in cfgs.items()
    }
    same = []
    for step in range(total + 1):
        for i, method in enumerate(METHODS):
            rcv = receivers["delta" if method == "delta" else "dense"]
            st = rcv.pull(step * len(METHODS) + i + 1, method=_METHOD[method])
            out["runs"].append({"method": method, "step": step, **st.as_dict()})
        same.append(
            all(
                torch.equal(
                    local_view(dests["delta"][s.local], s, s.box).view(torch.int16),
                    local_view(dests["dense"][s.local], s, s.box).view(torch.int16),
                )
                for _, s in slots
            )
        )
    out["same"] = same
    for r in receivers.values():
        r.close()
    return out


def run_delta_bench(case: DeltaCase, *, layers: int | None = None, timeout: float = 3600) -> dict[str, Any]:
    """One setting, every method, every step (see the module docstring)."""
    from reshard.tools.bench import CASES, run_ranks

    bench = CASES["default"] if layers is None else replace(CASES["default"], layers=layers)
    results = run_ranks(_rank, bench.world, bench, case, timeout=timeout, what="delta bench")
    return _summarize(bench, case, results)


def _summarize(bench, case: DeltaCase, results: dict[int, dict]) -> dict[str, Any]:
    from reshard.tools.bench import bench_tensors

    t = bench.trainer_ranks
    engines = [r for r in results if r >= t]
    n = len(results[0]["runs"])
    per: dict[str, dict[str, list]] = {
        m: {"seconds": [], "wire": [], "dense": [], "changed": [], "phases": []} for m in METHODS
    }
    for i in range(n):
        runs = [results[r]["runs"][i] for r in results]
        method, step = runs[0]["method"], runs[0]["step"]
        if step <= case.warmup:
            continue  # step 0 fills the engine; delta's first refit is dense
        p = per[method]
        p["seconds"].append(max(x["finished_at"] for x in runs) - max(x["started_at"] for x in runs))
        p["wire"].append(sum(results[r]["runs"][i]["wire_bytes"] for r in engines))
        p["dense"].append(sum(results[r]["runs"][i]["dense_bytes"] for r in engines))
        senders = [results[r]["runs"][i] for r in range(t)]
        p["phases"].append(_phases(senders, [results[r]["runs"][i] for r in engines]))
        if method == "delta":
            counts = [results[r]["changed"][step] for r in range(t)]
            p["changed"].append(sum(c for c, _ in counts) / sum(e for _, e in counts))
    dense_s = statistics.median(per["dense"]["seconds"])
    dense_wire = statistics.median(per["dense"]["wire"])
    methods = {}
    for m, p in per.items():
        s = statistics.median(p["seconds"])
        w = statistics.median(p["wire"])
        methods[m] = {
            "seconds_median": s,
            "seconds_all": p["seconds"],
            "wire_bytes_median": w,
            "wire_vs_dense": w / dense_wire,
            "time_vs_dense": s / dense_s,
            "phases": {k: statistics.median(ph.get(k, 0.0) for ph in p["phases"]) for k in p["phases"][0]},
        }
    changed = per["delta"]["changed"]
    return {
        "case": "delta",
        "trainer": f"fsdp={t} ({case.master})",
        "engine": f"tp={bench.engine_tp} (bfloat16)",
        "lr": case.lr,
        "model_bytes_engine": sum(m.nbytes for m in bench_tensors(bench)),
        "steps": case.steps,
        "warmup": case.warmup,
        "changed_fraction": statistics.median(changed) if changed else 0.0,
        "changed_all": changed,
        "snapshot_bytes": sum(results[r].get("snapshot_bytes", 0) for r in range(t)),
        "correct": all(all(results[r]["same"]) for r in engines),
        "method": methods,
    }


def _phases(senders: list[dict], receivers: list[dict]) -> dict[str, float]:
    """The slowest sender's and the slowest receiver's transfer phases (and
    until when their last byte landed), by ``sender_`` / ``receiver_`` name."""
    out: dict[str, float] = {}
    for side, runs in (("sender", senders), ("receiver", receivers)):
        slow = max(runs, key=lambda x: x["seconds"])
        out[f"{side}_transfer"] = slow["seconds"]
        out[f"{side}_agree"] = slow["agree_seconds"]
        out[f"{side}_cpu"] = slow.get("cpu_seconds", 0.0)
        for k, v in slow.get("phase_seconds", {}).items():
            out[f"{side}_{k}"] = v
    return out


def format_delta(results: list[dict[str, Any]]) -> str:
    first = results[0]
    lines = [
        f"case delta: trainer {first['trainer'].split(' ')[0]} -> engine {first['engine']}, model "
        f"{first['model_bytes_engine'] / 1e6:.0f} MB in the engine's bf16, AdamW steps on random gradients; "
        f"medians of {first['steps']} steps after {first['warmup']} warm-up",
        f"{'trainer':<10}{'lr':>7}{'changed':>9}  {'method':<18}{'median s':>9}{'x dense':>9}{'wire MB':>10}"
        f"{'x dense':>9}{'correct':>9}",
    ]
    for r in results:
        for i, (m, v) in enumerate(r["method"].items()):
            head = (
                f"{r['trainer'].split('(')[1].rstrip(')'):<10}{r['lr']:>7.0e}{100 * r['changed_fraction']:>8.2f}%"
                if i == 0
                else " " * 26
            )
            lines.append(
                f"{head}  {m:<18}{v['seconds_median']:>9.3f}{v['time_vs_dense']:>9.2f}"
                f"{v['wire_bytes_median'] / 1e6:>10.1f}{v['wire_vs_dense']:>9.3f}{r['correct']!s:>9}"
            )
    for r in results:
        lines.append(
            f"{r['trainer']} lr {r['lr']:.0e}: {100 * r['changed_fraction']:.2f}% of the weights' elements "
            f"(in bf16) changed per step; delta moves {r['method']['delta']['wire_vs_dense']:.3f}x the dense bytes in "
            f"{r['method']['delta']['time_vs_dense']:.2f}x its time; gather-and-broadcast "
            f"{r['method']['gather_broadcast']['time_vs_dense']:.2f}x; snapshots {r['snapshot_bytes'] / 1e6:.0f} MB"
        )
        for m in ("delta", "dense"):
            ph = r["method"][m].get("phases", {})
            for side in ("sender", "receiver"):
                text = ", ".join(f"{k.removeprefix(side + '_')} {v:.3f}" for k, v in ph.items() if k.startswith(side))
                lines.append(f"    {m} slowest {side} (median s): {text}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="reshard bench --case delta", description=__doc__)
    ap.add_argument("--case", default="delta")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    ap.add_argument("--lr", type=float, action="append", help="learning rate(s) (default: 1e-6 and 1e-5)")
    ap.add_argument(
        "--master", action="append", choices=["bfloat16", "float32"], help="trainer dtype(s) (default: both)"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    results = []
    for master in args.master or ["bfloat16", "float32"]:
        for lr in args.lr or [1e-6, 1e-5]:
            case = DeltaCase(master=master, lr=lr, steps=args.steps, warmup=args.warmup)
            results.append(run_delta_bench(case, layers=args.layers))
    print(json.dumps(results, indent=2) if args.json else format_delta(results))
    return 0 if all(r["correct"] for r in results) else 1
