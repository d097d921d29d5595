"""The worker guard of the ``reshard`` weight-transfer backend
(:mod:`reshard.adapters.vllm.backend`).

**Replies never go stale.** vLLM 0.32's multiprocess executor reads worker
replies in rank order and stops at the first worker that raised; the other
workers' replies stay queued and answer the *next* call. So every phase
(parse, init, start, update, finish, shutdown) ends with the workers of one
engine exchanging their outcomes over vLLM's own TP/PP CPU groups: if any
failed, all reset to the same state (no update session open; after a failed
init, no receiver) and only the last worker raises, with every worker's
error in the message. The executor then reads every reply of the call. This
guard wraps vLLM's worker methods (installed when the first reshard engine
is created, active only for workers whose engine is reshard's), so it also
covers vLLM's own session checks ("already active", "without a matching
start").
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from reshard.adapters.core.replies import WorkerReply, failure, with_replies
from reshard.errors import ReshardError

__all__ = ["executor_rank", "install_worker_guard"]

_GUARDED = (
    "init_weight_transfer_engine",
    "start_weight_update",
    # A draft session's start fails where the drafter was declared frozen.
    "start_draft_weight_update",
    "update_weights",
    "finish_weight_update",
    "shutdown_weight_transfer_engine",
)
_guard_lock = threading.Lock()


def install_worker_guard() -> None:
    """Wrap vLLM's worker methods once per process (idempotent)."""
    from vllm.v1.worker.gpu_worker import Worker

    with _guard_lock:
        for name in _GUARDED:
            method = getattr(Worker, name, None)
            if method is not None and not getattr(method, "_reshard_guard", False):
                setattr(Worker, name, _guarded(name, method))


def _guarded(phase: str, method):
    @functools.wraps(method)
    def run(worker, *args: Any, **kwargs: Any):
        engine: Any = getattr(worker, "weight_transfer_engine", None)
        if not getattr(engine, "reshard_guarded", False):
            return method(worker, *args, **kwargs)
        engine.worker = worker
        error: BaseException | None = None
        out = None
        try:
            out = method(worker, *args, **kwargs)
        except BaseException as e:  # re-raised below, by the last worker
            error = e
        me, last, failures = _exchange_failures(error)
        if not failures:
            return out
        # The same state on every worker of the engine.
        worker._weight_update_active = False
        engine.reset_weight_update_target()
        if phase == "init_weight_transfer_engine":
            engine.shutdown()
        if me != last:
            return None
        # vLLM passes only this error's text on (an HTTP body, an executor's
        # RuntimeError): the replies ride in it, and the driver's _call turns
        # them back into the typed error (MixedWeightsError, RefitError).
        raise ReshardError(with_replies(_describe(phase, failures), failures)) from error

    run._reshard_guard = True  # type: ignore[attr-defined]
    return run


def _describe(phase: str, failures: list[WorkerReply]) -> str:
    by_text: dict[str, list[int]] = {}
    for r in failures:
        by_text.setdefault(f"{r.type}: {r.error}", []).append(r.rank)
    lines = [f"worker(s) {', '.join(map(str, ranks))}: {text}" for text, ranks in by_text.items()]
    return f"reshard: {phase} failed; no worker keeps an update session open\n" + "\n".join(lines)


def executor_rank(tp: tuple[int, int], pcp: tuple[int, int], pp: tuple[int, int]) -> tuple[int, int]:
    """``(this worker, the last worker)`` in the order vLLM's executor reads
    replies, from ``(rank, size)`` in the tensor-, prefill-context- and
    pipeline-parallel groups: vLLM lays workers out PP x PCP x TP (TP
    fastest), so an executor has ``pp * pcp * tp`` workers."""
    (t, nt), (c, nc), (p, np_) = tp, pcp, pp
    for name, (r, n) in (("tp", tp), ("pcp", pcp), ("pp", pp)):
        if not 0 <= r < n:
            raise ValueError(f"{name} rank {r} is outside a group of {n}")
    return (p * nc + c) * nt + t, np_ * nc * nt - 1


def _exchange_failures(error: BaseException | None) -> tuple[int, int, list[WorkerReply]]:
    """``(this worker, the last worker, failures)`` across the workers of this
    engine (one executor: PP x PCP x TP), in the order the executor reads
    replies; each failure is its worker's reply (``rank``: its index there)."""
    from vllm.distributed import parallel_state as ps

    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    pcp = ps.get_pcp_group() if hasattr(ps, "get_pcp_group") else None
    me, last = executor_rank(
        (tp.rank_in_group, tp.world_size),
        (pcp.rank_in_group, pcp.world_size) if pcp is not None else (0, 1),
        (pp.rank_in_group, pp.world_size),
    )
    failures = [failure(error, rank=me)] if error is not None else []
    for group in (tp, pcp, pp):
        if group is not None and group.world_size > 1:
            failures = _all_gather_failures(failures, group.cpu_group)
    return me, last, sorted(failures, key=lambda r: r.rank)


def _all_gather_failures(entries: list[WorkerReply], group) -> list[WorkerReply]:
    """Every member's entries, over a CPU (gloo) group: lengths, then padded
    msgpack bytes (no pickle)."""
    import msgspec
    import torch
    import torch.distributed as dist

    data = msgspec.msgpack.encode(entries)
    n = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)  # host: a gloo group
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]  # host: a gloo group
    dist.all_gather(sizes, size, group=group)
    width = max(int(s) for s in sizes)
    buf = torch.zeros(width, dtype=torch.uint8)  # host: a gloo group
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]  # host: a gloo group
    bufs = [torch.zeros(width, dtype=torch.uint8) for _ in range(n)]  # host: a gloo group
    dist.all_gather(bufs, buf, group=group)
    out: list[WorkerReply] = []
    for b, s in zip(bufs, sizes, strict=True):
        out += msgspec.msgpack.decode(b[: int(s)].numpy().tobytes(), type=list[WorkerReply])
    return out
