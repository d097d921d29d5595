"""One process of a refit across the nodes of a :class:`~reshard.testing.cluster.NodeCluster`.

``python -m reshard.tools.cluster_rank`` reads a JSON spec on stdin and
runs, inside whatever network namespace it was started in, either the refit
store (``{"store": "10.249.0.1:port"}``, until its stdin closes) or one
refit rank: a trainer rank holding ``Shard(0)`` slices of the bench model
(:mod:`reshard.tools.bench`), or an engine worker keeping vLLM's slices
(:func:`reshard.costmodel.rules.engine_layouts`). It prints one
``RESULT {json}`` line per refit it ran (its outcome, its stats, and on an
engine worker whether every slice it keeps equals the source bit for bit),
and ``RAW {json}`` after a plain point-to-point transfer over the group.

The values of refit ``n`` come from ``seed`` (each tensor's own generator);
with ``changed`` (a fraction), every ``round(1 / changed)``-th element of
each tensor differs from the values of ``base_seed`` (a delta refit's step).

A step's ``gate`` (a path) holds the step back until that file exists.
A ``hook`` on a trainer rank (``{"refit": n, "round": k, "dir": path}``)
makes that rank, after round ``k`` of refit ``n`` completed, create
``path/reached`` and wait for ``path/go``: whoever drives the cluster takes
a link down in between, at a point fixed by the plan, not by a clock.
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from pathlib import Path
from typing import Any

__all__ = ["expected", "main"]


def expected(meta: Any, seed: int, changed: float = 0.0, base_seed: int = 0) -> Any:
    """The global bf16 values of ``meta`` at ``seed`` (or ``base_seed`` with
    every ``round(1 / changed)``-th element changed)."""
    import torch

    def values(s: int):
        g = torch.Generator().manual_seed(zlib.crc32(meta.name.encode()) + 1000003 * s)
        return torch.randn(meta.shape, generator=g, dtype=torch.float32).to(torch.bfloat16)

    if not changed:
        return values(seed)
    out = values(base_seed)
    flat = out.view(-1)
    step = max(1, round(1 / changed))
    flat[seed % step :: step] += 1.0
    return out


def _case(spec: dict[str, Any]):
    from reshard.tools.bench import BenchCase

    return BenchCase(name="cluster", **spec["case"])


def _store(address: str) -> None:
    import datetime

    from torch.distributed import TCPStore

    host, port = address.rsplit(":", 1)
    store = TCPStore(host, int(port), None, True, timeout=datetime.timedelta(seconds=600), wait_for_workers=False)
    print("READY", flush=True)
    sys.stdin.read()
    del store


def _config(spec: dict[str, Any], variant: dict[str, Any]):
    from reshard.transport.group import GroupConfig

    case = spec["case"]
    return GroupConfig(
        address=spec["address"],
        num_sources=case.get("trainer_ranks", 2),
        num_destinations=case.get("engine_tp", 2) * case.get("engine_dp", 1),
        timeout_s=spec.get("timeout_s", 120),
        host_store=False,
        job=variant.get("job", "cluster"),
        domain=variant["domain"],
        delta=variant.get("delta", False),
    )


def _hook(spec: dict[str, Any], refit: int):
    hook = spec.get("hook")
    if not hook or hook["refit"] != refit:
        return None
    where = Path(hook["dir"])

    def after_round(i: int) -> None:
        if i != hook["round"]:
            return
        (where / "reached").touch()
        deadline = time.monotonic() + 300
        while not (where / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    return after_round


def _run(spec: dict[str, Any]) -> None:
    import torch

    from reshard.costmodel.rules import EngineSpec, engine_layouts
    from reshard.plan.box import chunk_range
    from reshard.plan.layout import Mesh
    from reshard.plan.specs import GridSpec
    from reshard.receiver import Receiver
    from reshard.sender import Sender
    from reshard.tools.bench import bench_tensors, destination_slots
    from reshard.transport.messages import local_view

    torch.set_num_threads(1)
    case = _case(spec)
    metas = bench_tensors(case)
    rank, t = spec["rank"], case.trainer_ranks
    variants = spec["variants"]  # name -> {"job", "domain", "delta"}
    ends: dict[str, Any] = {}
    if rank < t:
        mesh = Mesh(shape=(t,))
        grids = [GridSpec(m, mesh, ((0,),) + ((),) * (len(m.shape) - 1)) for m in metas]
        tensors = {}
        for m in metas:
            lo, hi = chunk_range(m.shape[0], t, rank)
            tensors[m.name] = torch.zeros((hi - lo, *m.shape[1:]), dtype=torch.bfloat16)

        def fill(step: dict[str, Any]) -> None:
            for m in metas:
                lo, hi = chunk_range(m.shape[0], t, rank)
                full = expected(m, step["seed"], step.get("changed", 0.0), step.get("base_seed", 0))
                tensors[m.name].copy_(full[lo:hi])

        def make(v: dict[str, Any]):
            return Sender.from_pieces(
                [], tensors, config=_config(spec, v), rank=rank, grids=grids, round_bytes=spec.get("round_bytes")
            )
    else:
        side = engine_layouts(metas, case.config, EngineSpec(tp=case.engine_tp, dp=case.engine_dp), base=t)
        layout = side.layout_of(rank)
        slots = destination_slots(layout, rank)
        local: dict[str, torch.Tensor] = {}
        for _, s in slots:
            local.setdefault(s.local, torch.zeros(s.local_shape, dtype=torch.bfloat16))

        def make(v: dict[str, Any]):
            return Receiver(
                local, config=_config(spec, v), rank=rank, layout=layout, round_bytes=spec.get("round_bytes")
            )

        def correct(step: dict[str, Any]) -> bool:
            cache: dict[str, Any] = {}
            for meta, s in slots:
                full = cache.get(meta.name)
                if full is None:
                    full = cache[meta.name] = expected(
                        meta, step["seed"], step.get("changed", 0.0), step.get("base_seed", 0)
                    )
                want = full[tuple(slice(o, o + n) for o, n in zip(s.box.offsets, s.box.sizes, strict=True))]
                got = local_view(local[s.local], s, s.box)
                if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                    return False
            return True

    for step in spec["steps"]:
        v = step.get("variant", "main")
        if v not in ends:
            ends[v] = make(variants[v])
        end = ends[v]
        method = step.get("method", "reshard")
        gate = step.get("gate")
        while gate and not Path(gate).exists():
            time.sleep(0.05)
        out: dict[str, Any] = {"refit": step["n"], "variant": v, "method": method, "rank": rank}
        t0 = time.monotonic()
        try:
            if rank < t:
                fill(step)
                st = end.push(
                    step["n"], method=method, after_round=_hook(spec, step["n"]) if method == "reshard" else None
                )
            else:
                if step.get("zero", True):
                    for x in local.values():
                        x.zero_()
                st = end.pull(step["n"], method=method)
            out.update(ok=True, stats=st.as_dict())
            if rank >= t and step.get("check", True):
                out["correct"] = correct(step)
        except Exception as e:
            out.update(ok=False, error=f"{type(e).__name__}: {e}")
        out["seconds"] = time.monotonic() - t0
        print("RESULT " + json.dumps(out), flush=True)
    raw = spec.get("raw")
    if raw:
        print("RAW " + json.dumps(_raw(ends[raw["variant"]].session, rank, raw["pairs"], raw["bytes"])), flush=True)
    for end in ends.values():
        end.close()


def _raw(session: Any, rank: int, pairs: list[list[int]], volume: int) -> dict[str, Any]:
    """Every ``(src, dst)`` pair moves ``volume`` bytes at once over the
    refit group: a warm-up, then the fastest of three."""
    import torch

    pg = session.group.pg
    mine = [(s, d) for s, d in pairs if rank in (s, d)]
    buf = torch.empty(volume, dtype=torch.uint8)
    best = float("inf")
    for i in range(4):
        session.group.store.set(f"raw/{i}/{rank}", b"1")
        session.group.store.wait([f"raw/{i}/{r}" for r in range(session.group.config.world_size)])
        t0 = time.perf_counter()
        works = []
        for s, d in mine:
            works.append(pg.send([buf], d, 7) if rank == s else pg.recv([buf], s, 7))
        for w in works:
            w.wait()
        if i:
            best = min(best, time.perf_counter() - t0)
    return {"rank": rank, "bytes": volume * len(mine), "seconds": best}


def main() -> None:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    spec = json.loads(sys.stdin.readline())
    if "store" in spec:
        _store(spec["store"])
    else:
        _run(spec)


if __name__ == "__main__":
    main()
