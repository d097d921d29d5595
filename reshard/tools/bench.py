"""``reshard bench``: reshard and gather-and-broadcast, measured in one run.

Starts trainer and engine-worker processes on this machine (gloo over
loopback), builds a synthetic Llama-style model (bf16), lays it out as an
FSDP2 trainer (``Shard(0)`` over the trainer ranks) and as vLLM workers
(fused ``qkv_proj`` and ``gate_up_proj``, vocab padding, column and row
parallel layers, from :mod:`reshard.costmodel.rules`), then runs both methods
after a warm-up, several times, alternating. Every destination slice is
compared bit for bit with the source model. In the same run it times a
plain point-to-point transfer of the same volume between two processes
(``raw_p2p``), the bandwidth a perfect refit would reach.

``reshard bench --engine vllm`` measures refits into a real engine instead
(:mod:`reshard.tools.engine_bench`); ``reshard bench --nodes N --link RATE``
across nodes simulated by network namespaces with shaped links
(:mod:`reshard.tools.cluster_bench`).

Cases: ``default`` (trainer fsdp=2, one engine tp=2), ``replicas``
(trainer fsdp=2, two engine replicas tp=2 in one NVLink-like domain, so one
leader pulls each slice across and forwards it to the other replica) and
``colocated`` (the default layouts, every rank on this host: reshard over
shared memory through channels, ``reshard_shm``, and with the trainers'
tensors exported so receivers read them directly, ``reshard_export``,
against reshard over gloo loopback and gather-and-broadcast, and a plain
in-process memory copy of the same bytes).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import zlib
from dataclasses import dataclass, replace
from typing import Any

from reshard.testing.ports import free_port

__all__ = ["BenchCase", "bench_tensors", "destination_slots", "main", "run_bench", "run_ranks"]


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchCase:
    name: str
    trainer_ranks: int = 2
    engine_tp: int = 2
    engine_dp: int = 1
    hidden: int = 1024
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 2816
    layers: int = 12
    vocab: int = 32000
    colocated: bool = False
    """Also refit over shared memory (every rank on this host)."""
    domains: tuple[str, ...] = ()
    """Per rank, its domain label (default: ``trainer`` or ``engine``)."""
    shm_hosts: tuple[str, ...] = ()
    """Per rank, its shared-memory host label (default: this machine, so all
    ranks share memory): ranks labelled alike stand for a trainer and an
    engine process on one GPU (as ``reshard plan --colocate`` places them)."""

    @property
    def methods(self) -> tuple[str, ...]:
        if self.colocated:
            return ("reshard_export", "reshard_shm", "reshard", "gather_broadcast")
        return ("reshard", "gather_broadcast")

    @property
    def config(self) -> dict[str, Any]:
        return {
            "model_type": "llama",
            "hidden_size": self.hidden,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "vocab_size": self.vocab,
            "tie_word_embeddings": False,
        }

    @property
    def world(self) -> int:
        return self.trainer_ranks + self.engine_tp * self.engine_dp


CASES = {
    "default": BenchCase(name="default"),
    "replicas": BenchCase(name="replicas", engine_dp=2),
    "colocated": BenchCase(name="colocated", colocated=True),
}


def bench_tensors(case: BenchCase):
    """The bench model's canonical tensors (bf16)."""
    from reshard.models import canonical_tensors

    return tuple(canonical_tensors(case.config, dtype="bfloat16"))


_tensors = bench_tensors  # the name benchmarks/gpu_check.py imports


def _global(meta):
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(meta.name.encode()))
    return torch.randn(meta.shape, generator=g, dtype=torch.float32).to(torch.bfloat16)


def run_ranks(fn, world: int, *args: Any, timeout: float, what: str = "bench") -> dict[int, Any]:
    """``fn(rank, address, *args)`` in ``world`` spawned processes, joined to a
    refit store this process hosts at ``address``; their results by rank
    (``RuntimeError`` naming ``what`` and every rank's error when one fails
    or all go silent)."""
    import datetime

    from torch.distributed import TCPStore

    from reshard.tools.engine_bench import collect, join_all, spawn_ranks

    port = free_port()
    store = TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    address = f"127.0.0.1:{port}"
    q, procs = spawn_ranks((fn, r, (address, *args)) for r in range(world))
    try:
        results = collect(q, procs, timeout, what=what)
    finally:
        join_all(procs)
        del store
    return {rank: value for _name, rank, value in results}


def _run_rank(rank: int, address: str, case: BenchCase, reps: int, warmup: int) -> dict:
    import torch

    from reshard.costmodel.rules import EngineSpec, engine_layouts
    from reshard.plan.layout import Mesh
    from reshard.plan.specs import GridSpec
    from reshard.receiver import Receiver
    from reshard.sender import Sender
    from reshard.transport.group import GroupConfig

    torch.set_num_threads(1)
    metas = bench_tensors(case)
    t = case.trainer_ranks
    cfg = GroupConfig(
        address=address,
        num_sources=t,
        num_destinations=case.engine_tp * case.engine_dp,
        timeout_s=300,
        host_store=False,
        domain=case.domains[rank] if case.domains else ("trainer" if rank < t else "engine"),
    )
    # Over shared memory: another group (its own job) whose ranks say so.
    shm_cfg = replace(
        cfg, job="bench-shm", shared_memory=True, shm_host=case.shm_hosts[rank] if case.shm_hosts else None
    )
    export_cfg = replace(shm_cfg, job="bench-export", export_sources=rank < t)
    methods = list(case.methods)
    schedule = [m for _ in range(warmup + reps) for m in methods]
    method_of = {"reshard_shm": "reshard", "reshard_export": "reshard"}
    out: dict[str, Any] = {"rank": rank, "runs": []}
    if rank < t:
        mesh = Mesh(shape=(t,))
        grids = [GridSpec(m, mesh, ((0,),) + ((),) * (len(m.shape) - 1)) for m in metas]
        tensors = {}
        for m in metas:
            from reshard.plan.box import chunk_range

            lo, hi = chunk_range(m.shape[0], t, rank)
            tensors[m.name] = _global(m)[lo:hi].clone()
        sender = Sender.from_pieces([], tensors, config=cfg, rank=rank, grids=grids)
        extra = {}
        if case.colocated:
            extra["reshard_shm"] = Sender.from_pieces([], tensors, config=shm_cfg, rank=rank, grids=grids)
            extra["reshard_export"] = Sender.from_pieces([], tensors, config=export_cfg, rank=rank, grids=grids)
        for i, method in enumerate(schedule):
            ep = extra.get(method, sender)
            st = ep.push(i + 1, method=method_of.get(method, method))
            out["runs"].append({"method": method, **st.as_dict()})
        out["raw"] = _raw_p2p(sender.session, rank, t, _volume(case, metas))
        sender.close()
        for ep in extra.values():
            ep.close()
        return out
    side = engine_layouts(metas, case.config, EngineSpec(tp=case.engine_tp, dp=case.engine_dp), base=t)
    layout = side.layout_of(rank)
    slots = destination_slots(layout, rank)
    local: dict[str, torch.Tensor] = {}
    for _, s in slots:
        local.setdefault(s.local, torch.zeros(s.local_shape, dtype=torch.bfloat16))
    endpoint = Receiver(local, config=cfg, rank=rank, layout=layout)
    ends = {}
    if case.colocated:
        ends["reshard_shm"] = Receiver(local, config=shm_cfg, rank=rank, layout=layout)
        ends["reshard_export"] = Receiver(local, config=export_cfg, rank=rank, layout=layout)
    correct = {m: True for m in methods}
    for i, method in enumerate(schedule):
        for v in local.values():
            v.zero_()
        dest = ends.get(method, endpoint)
        st = dest.pull(i + 1, method=method_of.get(method, method))
        out["runs"].append({"method": method, **st.as_dict()})
        if i >= len(schedule) - len(methods):  # check the last run of each method
            correct[method] = _check(local, slots)
    out["correct"] = correct
    out["raw"] = _raw_p2p(endpoint.session, rank, t, _volume(case, metas))
    endpoint.close()
    for dest in ends.values():
        dest.close()
    return out


def destination_slots(layout, rank: int) -> list:
    """``(meta, slot)`` for every non-empty slice ``rank``'s layout keeps."""
    from reshard.plan.index import LayoutSet

    ls = LayoutSet.from_layouts("destination", [layout])
    slots = []
    for name, entries in ls.tensor_grids.items():
        meta = ls.metas[name]
        for gid, pos in entries:
            info = ls.grids[gid]
            for c in info.coord_of.get(rank, ()):
                s = info.slot(meta, pos, rank, c)
                if not s.box.is_empty():
                    slots.append((meta, s))
    return slots


def _volume(case: BenchCase, metas) -> int:
    """What the engine workers keep in all (a model per replica, plus the
    copies of replicated tensors such as norms that every TP rank keeps)."""
    from reshard.costmodel.rules import EngineSpec, engine_layouts
    from reshard.plan.index import LayoutSet

    side = engine_layouts(metas, case.config, EngineSpec(tp=case.engine_tp, dp=case.engine_dp), base=0)
    ls = LayoutSet("destination")
    for g in side.grids:
        ls.add_grid(side.table, g)
    total = 0
    for name, entries in ls.tensor_grids.items():
        meta = ls.metas[name]
        item = meta.nbytes // max(1, math.prod(meta.shape))
        for gid, _ in entries:
            for box, ranks, _ in ls.grids[gid].holders(meta.shape):
                total += box.numel * item * len(ranks)
    return total


def _check(local, slots) -> bool:
    import torch

    from reshard.transport.messages import local_view

    cache: dict[str, Any] = {}
    for meta, s in slots:
        full = cache.get(meta.name)
        if full is None:
            full = cache[meta.name] = _global(meta)
        want = full[tuple(slice(o, o + n) for o, n in zip(s.box.offsets, s.box.sizes, strict=True))]
        got = local_view(local[s.local], s, s.box)
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            return False
    return True


def _raw_p2p(session, rank: int, trainers: int, volume: int) -> dict | None:
    """Trainer rank 0 sends ``volume`` bytes to the first engine worker: one
    warm-up, then the fastest of three (the bandwidth a refit could reach)."""
    import torch

    pg = session.group.pg
    engine0 = trainers
    if rank not in (0, engine0):
        return None
    buf = torch.empty(volume, dtype=torch.uint8)
    best = float("inf")
    for i in range(4):
        t0 = time.perf_counter()
        if rank == 0:
            pg.send([buf], engine0, 7).wait()
            pg.recv([buf[:1]], engine0, 8).wait()
        else:
            pg.recv([buf], 0, 7).wait()
            pg.send([buf[:1]], 0, 8).wait()
        if i:
            best = min(best, time.perf_counter() - t0)
    return {"bytes": volume, "seconds": best}


def run_bench(case: BenchCase, *, reps: int = 5, warmup: int = 1, timeout: float = 1800) -> dict[str, Any]:
    results = run_ranks(_run_rank, case.world, case, reps, warmup, timeout=timeout)
    return _summarize(case, results, reps, warmup)


def _summarize(case: BenchCase, results: dict[int, dict], reps: int, warmup: int) -> dict[str, Any]:
    t = case.trainer_ranks
    engines = [r for r in results if r >= t]
    methods: dict[str, Any] = {}
    n_methods = len(case.methods)
    for method in case.methods:
        per_run: list[float] = []
        n_runs = len(results[0]["runs"])
        for i in range(n_runs):
            runs = [results[r]["runs"][i] for r in results]
            if runs[0]["method"] != method or i // n_methods < warmup:
                continue
            # From the moment the last rank enters until the last rank leaves:
            # waiting for a late rank to arrive is not part of the refit.
            per_run.append(max(x["finished_at"] for x in runs) - max(x["started_at"] for x in runs))
        last = {r: next(x for x in reversed(results[r]["runs"]) if x["method"] == method) for r in results}
        recv = {r: last[r]["bytes_received"] for r in engines}
        methods[method] = {
            "seconds_median": statistics.median(per_run),
            "seconds_all": per_run,
            "bytes_received_total": sum(recv.values()),
            "max_rank_recv_bytes": max(recv.values()),
            "max_rank_send_bytes": max(last[r]["bytes_sent"] for r in results),
            "peak_staging_bytes": max(last[r]["peak_staging_bytes"] for r in results),
            "correct": all(results[r]["correct"][method] for r in engines),
            "recv_by_link": _sum_links(last[r].get("recv_by_link", {}) for r in engines),
        }
    raw = results[t]["raw"]
    raw_gbps = raw["bytes"] * 8 / raw["seconds"] / 1e9
    model_bytes = sum(m.nbytes for m in bench_tensors(case))
    # Useful throughput: the bytes engine workers keep, over each method's time.
    volume = raw["bytes"]
    r = methods["reshard"]
    r["throughput_gbps"] = volume * 8 / r["seconds_median"] / 1e9
    g = methods["gather_broadcast"]
    g["throughput_gbps"] = volume * 8 / g["seconds_median"] / 1e9
    extra: dict[str, Any] = {}
    if "reshard_shm" in methods:
        sm = methods["reshard_shm"]
        ex = methods["reshard_export"]
        for m in (sm, ex):
            m["throughput_gbps"] = volume * 8 / m["seconds_median"] / 1e9
        copy_s = _memcpy_seconds(volume)
        extra = {
            "memcpy_seconds": copy_s,
            "memcpy_gbps": volume * 8 / copy_s / 1e9,
            "shm_vs_gloo": r["seconds_median"] / sm["seconds_median"],
            "shm_vs_memcpy": copy_s / sm["seconds_median"],
            "export_vs_gloo": r["seconds_median"] / ex["seconds_median"],
            "export_vs_memcpy": copy_s / ex["seconds_median"],
        }
    return {
        "case": case.name,
        "trainer": f"fsdp={t}",
        "engine": f"tp={case.engine_tp},dp={case.engine_dp}",
        "model_bytes": model_bytes,
        "reps": reps,
        "warmup": warmup,
        "method": methods,
        "raw_p2p_gbps": raw_gbps,
        "raw_p2p_seconds": raw["seconds"],
        "raw_p2p_bytes": raw["bytes"],
        "bytes_kept_total": volume,
        "reshard_vs_raw": r["throughput_gbps"] / raw_gbps,
        "speedup": g["seconds_median"] / r["seconds_median"],
        **extra,
    }


def _sum_links(dicts) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _memcpy_seconds(volume: int) -> float:
    """One process copying ``volume`` bytes between two buffers: the best of three after a warm-up."""
    import torch

    torch.set_num_threads(1)
    a = torch.ones(volume, dtype=torch.uint8)
    b = torch.empty_like(a)
    best = float("inf")
    for i in range(4):
        t0 = time.perf_counter()
        b.copy_(a)
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def format_result(res: dict[str, Any]) -> str:
    lines = [
        f"case {res['case']}: trainer {res['trainer']} -> engine {res['engine']}, "
        f"model {res['model_bytes'] / 1e6:.0f} MB (bf16), {res['reps']} runs after {res['warmup']} warm-up",
        f"{'method':<18}{'median s':>10}{'Gb/s':>8}{'recv total MB':>15}{'max recv MB':>13}{'staging MB':>12}"
        f"{'correct':>9}",
    ]
    for name, m in res["method"].items():
        lines.append(
            f"{name:<18}{m['seconds_median']:>10.3f}{m['throughput_gbps']:>8.2f}"
            f"{m['bytes_received_total'] / 1e6:>15.1f}{m['max_rank_recv_bytes'] / 1e6:>13.1f}"
            f"{m['peak_staging_bytes'] / 1e6:>12.2f}{m['correct']!s:>9}"
        )
    lines.append(
        f"raw point-to-point, same volume ({res['raw_p2p_bytes'] / 1e6:.0f} MB): {res['raw_p2p_gbps']:.2f} Gb/s "
        f"({res['raw_p2p_seconds']:.3f} s)"
    )
    lines.append(
        f"speedup over gather-and-broadcast: {res['speedup']:.2f}x; "
        f"reshard at {res['reshard_vs_raw']:.2f}x raw point-to-point throughput"
    )
    if "memcpy_seconds" in res:
        lines.append(
            f"memory copy in one process, same volume: {res['memcpy_gbps']:.2f} Gb/s ({res['memcpy_seconds']:.3f} s); "
            f"reshard over shared memory {res['shm_vs_gloo']:.2f}x reshard over gloo, "
            f"{res['shm_vs_memcpy']:.2f}x the memory copy's throughput; with the trainers' tensors exported "
            f"{res['export_vs_gloo']:.2f}x and {res['export_vs_memcpy']:.2f}x"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = [r["case"] for r in results]
    x = range(len(names))
    w = 0.35
    ours = [r["method"]["reshard"]["seconds_median"] for r in results]
    theirs = [r["method"]["gather_broadcast"]["seconds_median"] for r in results]
    raw = [r["raw_p2p_seconds"] for r in results]
    ax.bar([i - w / 2 for i in x], ours, w, label="reshard")
    ax.bar([i + w / 2 for i in x], theirs, w, label="gather + broadcast")
    ax.scatter([i - w / 2 for i in x], raw, color="black", marker="_", s=900, zorder=3, label="raw p2p, same volume")
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{r['case']}\n{r['trainer']} -> {r['engine']}" for r in results])
    ax.set_ylabel("refit seconds (median)")
    ax.set_title(f"refit of a {results[0]['model_bytes'] / 1e6:.0f} MB bf16 model over gloo (2-core CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    if argv and any(a == "--engine" or a.startswith("--engine=") for a in argv):
        # Into a real engine: see reshard.tools.engine_cli.
        from reshard.tools.engine_cli import main as engine_main

        return engine_main(argv)
    ap = argparse.ArgumentParser(
        prog="reshard bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="case(s) to run (default: default)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", default=None, help="write a PNG of the results")
    args = ap.parse_args(argv)
    results = []
    for name in args.case or ["default"]:
        case = CASES[name]
        if args.layers is not None:
            case = replace(case, layers=args.layers)
        res = run_bench(case, reps=args.reps, warmup=args.warmup)
        results.append(res)
        if not args.json:
            print(format_result(res), flush=True)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    if args.plot:
        plot(results, args.plot)
    return 0
