"""Posting point-to-point operations on the refit group's process group.

On NCCL, a round's sends and receives are posted inside one coalescing
block (``ncclGroupStart`` / ``ncclGroupEnd``), so that NCCL schedules them
together on the group's single communicator. That block is thread-local
state: torch counts open blocks per thread (``ncclActiveGroupCounter_``)
and NCCL keeps its group depth per thread, so a block left open by an
exception makes every later NCCL call on that thread (an engine's
tensor-parallel all-reduce on the same busy loop, a trainer's next FSDP
collective) queue into a group that never ends: a silent hang after the
first failed refit. Hence, by construction:

1. every buffer is made before the block opens (packing, its lazy checks,
   checksums: anything that may raise runs first), by the caller;
2. every buffer is checked here against the group's device before the
   block opens (:func:`device_problem`): NCCL refuses a host tensor ("Tensors
   must be CUDA and dense") from inside the block;
3. the block is closed in ``finally``, whatever a post raises.

``pg`` is a c10d ``Backend`` (``ProcessGroupNCCL`` / ``ProcessGroupGloo``
built directly, never wrapped in a ``ProcessGroup``), whose coalescing
calls take no device: ``Backend._start_coalescing()``, unlike
``ProcessGroup._start_coalescing(device)``. gloo has no coalescing; its
operations are posted one by one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

    from reshard.transport.locals import LocalTensors

__all__ = ["Op", "device_problem", "off_device_locals", "on_device", "post_ops"]


class Op(NamedTuple):
    """One point-to-point operation: ``send`` ``buf`` to ``peer``, or
    ``recv`` into it from ``peer``, matched by ``tag``."""

    send: bool
    buf: torch.Tensor
    peer: int
    tag: int


def device_problem(buf: torch.Tensor, device: torch.device, backend: str) -> str:
    """Why ``buf`` cannot be posted on a ``backend`` group whose rank
    holds its buffers on ``device`` (``""``: it can): NCCL takes dense CUDA
    tensors on the communicator's device only, gloo host tensors."""
    if backend == "nccl":
        if buf.device.type != "cuda" or (device.index is not None and buf.device.index != device.index):
            return f"a buffer on {buf.device}, where the refit group's NCCL communicator is on {device}"
    elif buf.device.type != "cpu":
        return f"a buffer on {buf.device}, where the refit group's {backend} process group takes host tensors"
    if not buf.is_contiguous():
        return "a buffer that is not contiguous"
    return ""


def off_device_locals(tensors: LocalTensors, device: torch.device) -> frozenset[str]:
    """The local tensors of ``tensors`` that are not on ``device`` (the
    group's): an offloaded trainer's shards in host memory, an engine's
    pinned host staging buffers. Their messages are staged through the
    arena. Tensors that materialize on demand (``lazy``) are taken to be on
    the device: each is checked when the executor first touches it, before
    anything is posted."""
    if tensors.lazy:
        return frozenset()
    return frozenset(name for name, t in tensors.items() if t.device != device)


def post_ops(pg: Any, ops: Sequence[Op], *, device: torch.device, backend: str, coalesce: bool) -> list:
    """Post ``ops`` on ``pg`` (in order) and return what to wait on: one
    work for a coalesced block, else one per operation. Every buffer is
    checked before anything is posted (``ValueError`` naming the peer and
    tag of the first that cannot be); with ``coalesce`` the block is closed
    even when a post raises, so this thread never stays inside it."""
    for op in ops:
        why = device_problem(op.buf, device, backend)
        if why:
            verb = "send to" if op.send else "receive from"
            raise ValueError(f"cannot {verb} rank {op.peer} (message {op.tag}): {why}")
    if not ops:
        return []
    works: list = []
    if not coalesce:
        for op in ops:
            works.append(pg.send([op.buf], op.peer, op.tag) if op.send else pg.recv([op.buf], op.peer, op.tag))
        return works
    pg._start_coalescing()
    try:
        for op in ops:
            # Inside the block these only queue; the block's end launches them.
            pg.send([op.buf], op.peer, op.tag) if op.send else pg.recv([op.buf], op.peer, op.tag)
    finally:
        work = pg._end_coalescing()
    return [work]


@contextlib.contextmanager
def on_device(device: torch.device | str | None) -> Iterator[None]:
    """``device`` as the calling thread's current CUDA device for the block
    (nothing for a host device). torch keeps the current device per thread:
    a refit driven from another thread (TRL's colocate mode pulls on the
    thread that drives the engines, whose current device is 0) would
    otherwise allocate, launch and hand its device to helper threads on the
    wrong GPU."""
    import torch

    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda":
        yield
        return
    with torch.cuda.device(dev):
        yield
