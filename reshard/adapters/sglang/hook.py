"""The function SGLang runs inside every TP worker: ``reshard.adapters.sglang.hook.load``.

Register it when the engine starts (``--custom-weight-loader
reshard.adapters.sglang.hook.load``, or ``custom_weight_loader=[...]`` for
``sglang.Engine``), and drive it with :class:`reshard.adapters.sglang.SglangEngine`.
SGLang calls ``load(model, named_tensors)`` from
``update_weights_from_tensor(..., load_format="reshard.adapters.sglang.hook.load")``
in every TP scheduler process, with ``model_runner.model``.

Rules this module keeps:

- it never raises: an exception in a custom loader kills SGLang's scheduler
  (and, through SIGQUIT, the process that owns the engine), and SGLang
  ignores the loader's return value; every outcome is posted as a
  :class:`~reshard.adapters.core.replies.WorkerReply` to the refit store;
- a worker that cannot take part (its layout cannot be learned) still joins
  the refit group and fails the ``plan`` step, so the trainer ranks raise at
  once instead of timing out, and no byte moves;
- state (the learned layout, the joined refit group) lives in this module
  for the life of the worker process.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
import traceback
from typing import TYPE_CHECKING, Any

from reshard.adapters.core.replies import WorkerReply, failure
from reshard.adapters.core.spec import GroupSpec
from reshard.adapters.sglang import protocol
from reshard.adapters.sglang.protocol import Command
from reshard.transport.config import parse_address

if TYPE_CHECKING:
    import torch

    from reshard.adapters.sglang.receiver import SglangReceiver

__all__ = ["load"]

logger = logging.getLogger("reshard.sglang")


class _State:
    receiver: SglangReceiver | None = None
    group: GroupSpec | None = None
    learned: Any = None
    learned_for: int | None = None
    learn_seconds: float = 0.0


_STATE = _State()


def load(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang's custom-weight-loader entry point (never raises)."""
    for name, _tensor in named_tensors:
        try:
            cmd = protocol.decode_command(name)
        except Exception as e:
            logger.error("reshard: ignoring a tensor that is not a reshard command (%s)", e)
            continue
        try:
            reply = _run(model, cmd)
        except BaseException as e:  # _run catches everything it expects; this is the last guard
            logger.error("reshard: %s failed unexpectedly\n%s", cmd.op, traceback.format_exc())
            try:
                tp_rank = _parallel()[0]
            except Exception:
                tp_rank = 0
            rank = cmd.group.rank_of(tp_rank)
            reply = failure(e, rank=rank, id=cmd.id, tp_rank=tp_rank)
        _post(cmd.group, reply)


def _parallel() -> tuple[int, int, int]:
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    return int(p.tp_rank), int(p.tp_size), int(getattr(p, "pp_size", 1) or 1)


def _run(model, cmd: Command) -> WorkerReply:
    tp_rank, _tp_size, pp_size = _parallel()
    rank = cmd.group.rank_of(tp_rank)

    def fail(e: BaseException, *, mixed: bool = False) -> WorkerReply:
        logger.error("reshard: %s of refit %d failed on refit rank %d: %s", cmd.op, cmd.refit, rank, e)
        return failure(e, rank=rank, mixed=mixed, id=cmd.id, tp_rank=tp_rank)

    if cmd.op == "close":
        _close()
        return WorkerReply(id=cmd.id, rank=rank, tp_rank=tp_rank, ok=True)
    if cmd.op == "state":
        from reshard.adapters.core.state import model_state

        try:
            return WorkerReply(id=cmd.id, rank=rank, tp_rank=tp_rank, ok=True, stats={"state": model_state(model)})
        except BaseException as e:
            return fail(e)
    if cmd.op != "pull":
        return fail(ValueError(f"unknown reshard command {cmd.op!r}"))
    try:
        if pp_size != 1:
            raise NotImplementedError(f"SGLang pipeline parallelism (pp_size={pp_size}) is not supported yet")
        receiver = _receiver(model, cmd.group, rank, tp_rank)
    except BaseException as e:
        _refuse(cmd, rank, f"{type(e).__name__}: {e}")
        return fail(e)
    try:
        stats = receiver.pull(cmd.refit, method=cmd.method)
    except BaseException as e:
        # Status keys of a failed refit stay in the store: every rank joins
        # the next refit with a new generation (a new ``GroupSpec``).
        _close()
        return fail(e, mixed=receiver.mixed)
    stats.learn_seconds = _STATE.learn_seconds
    return WorkerReply(id=cmd.id, rank=rank, tp_rank=tp_rank, ok=True, stats=stats.to_builtins())


def _receiver(model, spec: GroupSpec, rank: int, tp_rank: int) -> SglangReceiver:
    from reshard.adapters.sglang.receiver import SglangReceiver, learn_checked

    st = _STATE
    if st.receiver is not None and st.group == spec:
        return st.receiver
    _close()
    if st.learned is None or st.learned_for != tp_rank:
        t0 = time.perf_counter()
        st.learned = learn_checked(model, rank=rank)
        st.learned_for = tp_rank
        st.learn_seconds = time.perf_counter() - t0
    st.receiver = SglangReceiver(
        model, config=spec.config(), rank=rank, learned=st.learned, budget_bytes=spec.budget_bytes
    )
    st.group = spec
    return st.receiver


def _close() -> None:
    st = _STATE
    if st.receiver is not None:
        try:
            st.receiver.close()
        except Exception as e:
            logger.warning("reshard: closing the refit group: %s", e)
    st.receiver = None
    st.group = None


def _refuse(cmd: Command, rank: int, message: str) -> None:
    """Take part in the refit with a layout no trainer can satisfy, so every
    rank fails at the ``plan`` step now (before any byte moves) instead of
    waiting for this worker until the timeout.

    The layout needs one tensor that no source publishes, whose name carries
    the reason; this uses only the public :class:`~reshard.receiver.Receiver`
    (the planner's own check reports it), not the group's step protocol."""
    import torch

    from reshard.plan.box import Box
    from reshard.plan.layout import TensorMeta
    from reshard.plan.specs import PieceSpec
    from reshard.receiver import Receiver

    reason = " ".join(message.split())[:300]
    phantom = TensorMeta(f"<SGLang worker {rank} cannot refit: {reason}>", (1,), "float32")
    # On the device the worker's weights are on: the group's backend (NCCL
    # for GPU workers) is agreed at join, and a gloo rank among NCCL ranks
    # would be refused there, without this reason.
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        receiver = Receiver(
            {"phantom": torch.zeros(1, device=device)},
            [PieceSpec(phantom, Box((0,), (1,)), "phantom", (1,))],
            config=cmd.group.config(),
            rank=rank,
            device=device,
        )
        try:
            with contextlib.suppress(Exception):
                receiver.pull(cmd.refit)
        finally:
            receiver.close()
    except Exception as e:
        logger.error("reshard: could not report the failure to the refit group: %s", e)


def _post(spec: GroupSpec, reply: WorkerReply) -> None:
    """Post ``reply`` to the refit store (never raises)."""
    import msgspec
    from torch.distributed import PrefixStore, TCPStore

    try:
        host, port = parse_address(spec.address)
        tcp = TCPStore(
            host,
            port,
            None,
            False,
            timeout=datetime.timedelta(seconds=min(spec.timeout_s, 60.0)),
            wait_for_workers=False,
            use_libuv=True,
        )
        store = PrefixStore(protocol.reply_prefix(spec.job), tcp)
        store.set(protocol.reply_key(reply.id, reply.rank), msgspec.json.encode(reply))  # type: ignore[arg-type]
    except Exception as e:
        logger.error("reshard: could not post the reply of command %s: %s (%s)", reply.id, e, reply)
