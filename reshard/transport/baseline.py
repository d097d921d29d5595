"""Gather-and-broadcast: the refit most RL frameworks and vLLM's ``nccl``
backend do, behind the same Sender/Receiver interface, so that every
benchmark shows it next to reshard from one run.

For each bucket of tensors (canonical order, at most ``bucket_bytes``; a
bigger tensor is cut into row blocks): the bucket's *root*, the first
trainer rank that holds part of its tensors (the first rank of the pipeline
stage), gathers the full tensors from the ranks that hold their pieces; then
it broadcasts the bucket to every engine worker with a broadcast collective
over a process group of the root and the engine workers; each engine worker
copies out the slices it keeps and drops the rest.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reshard.errors import PlanError, Problem
from reshard.plan.box import Box
from reshard.plan.index import LayoutSet
from reshard.plan.layout import Slot, TensorMeta
from reshard.transport import wire
from reshard.transport.messages import DEFAULT_BUDGET_BYTES, align, local_view
from reshard.transport.posting import Op, post_ops
from reshard.transport.stats import ExecStats

if TYPE_CHECKING:
    import torch

    from reshard.plan.planner import Planner
    from reshard.transport.group import RefitGroup

__all__ = ["DEFAULT_BUCKET_BYTES", "gather_broadcast"]

DEFAULT_BUCKET_BYTES = DEFAULT_BUDGET_BYTES


@dataclass(frozen=True, slots=True)
class _Item:
    """Rows ``[lo, hi)`` of one tensor at ``offset`` in its bucket."""

    meta: TensorMeta
    lo: int
    hi: int
    offset: int

    @property
    def box(self) -> Box:
        if not self.meta.shape:
            return Box((), ())
        return Box((self.lo,) + (0,) * (len(self.meta.shape) - 1), (self.hi - self.lo, *self.meta.shape[1:]))

    @property
    def nbytes(self) -> int:
        return self.box.numel * (self.meta.nbytes // max(1, _numel(self.meta.shape)))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _slots(ls: LayoutSet, name: str) -> list[Slot]:
    """Every slot of a tensor on one side, grids expanded (all ranks)."""
    meta = ls.metas[name]
    out = list(ls.tensor_slots.get(name, ()))
    for gid, pos in ls.tensor_grids.get(name, ()):
        info = ls.grids[gid]
        for r, c in zip(info.ranks, info.coords, strict=True):
            s = info.slot(meta, pos, r, c)
            if not s.box.is_empty():
                out.append(s)
    return out


def _buckets(order, roots: dict[str, int], bucket_bytes: int) -> list[tuple[int, list[_Item]]]:
    """(root, items) per bucket, in canonical order."""
    out: list[tuple[int, list[_Item]]] = []
    cur: list[_Item] = []
    cur_root = -1
    fill = 0
    for meta in order:
        root = roots[meta.name]
        rows = meta.shape[0] if meta.shape else 1
        row_bytes = meta.nbytes // rows if rows else 0
        step = max(1, bucket_bytes // row_bytes) if row_bytes else rows
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            n = align((hi - lo) * row_bytes)
            if cur and (root != cur_root or fill + n > bucket_bytes):
                out.append((cur_root, cur))
                cur, fill = [], 0
            cur_root = root
            cur.append(_Item(meta, lo, hi, fill))
            fill += n
    if cur:
        out.append((cur_root, cur))
    return out


def gather_broadcast(
    group: RefitGroup,
    planner: Planner,
    refit: int,
    *,
    tensors: Mapping[str, torch.Tensor],
    device: torch.device | str,
    broadcast_groups: dict[int, object],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> ExecStats:
    """Run one gather-and-broadcast refit on ``group`` (collective): this
    rank's ``tensors`` are its sources (a trainer rank) or destinations (an
    engine worker); ``broadcast_groups`` keeps the broadcast process groups
    (one per root) for as long as ``group`` lives. Raises
    :class:`RefitError` on every rank if any failed."""
    import torch
    from torch.distributed import BroadcastOptions

    sources, dests = planner.sources, planner.dests
    rank = group.rank
    is_source = group.role == "source"
    num_sources = group.config.num_sources
    # Same validation as reshard's plan, agreed by every rank before any byte moves.
    problems: tuple[Problem, ...] = ()
    try:
        planner.check(rank)
    except PlanError as e:
        problems = tuple(e.problems)
    if group.no_wire:
        problems += (Problem(kind="link", message=f"gather-and-broadcast needs a process group: {group.no_wire}"),)
    group.agree(
        "plan", refit, wire.Status(rank=rank, step="plan", refit=refit, ok=not problems, problems=problems), peers=()
    )

    stats = ExecStats(rank=rank)
    t0 = time.perf_counter()
    src_slots = {m.name: _slots(sources, m.name) for m in planner.order}
    roots = {name: min(s.rank for s in slots) for name, slots in src_slots.items()}
    buckets = _buckets(planner.order, roots, bucket_bytes)
    engines = list(range(num_sources, group.world_size))
    dst_mine: dict[str, list[Slot]] = defaultdict(list)
    if not is_source:
        for m in planner.order:
            dst_mine[m.name] = [s for s in _slots(dests, m.name) if s.rank == rank]
    device = torch.device(device)
    pgs = broadcast_groups
    error = ""
    try:
        for root, items in buckets:
            size = items[-1].offset + align(items[-1].nbytes)
            member = rank == root or not is_source
            if not member and all(not _holds(src_slots[it.meta.name], rank, it) for it in items):
                continue
            buf = torch.empty(size, dtype=torch.uint8, device=device) if member else None
            stats.peak_staging_bytes = max(stats.peak_staging_bytes, size if member else 0)
            _gather(group, tensors, root, items, src_slots, buf, stats)
            if member:
                assert buf is not None
                pg = pgs.get(root)
                if pg is None:
                    pg = pgs[root] = _broadcast_group(group, root, engines, device)
                opts = BroadcastOptions()
                opts.rootRank = 0
                pg.broadcast([buf], opts).wait()  # type: ignore[attr-defined]
                payload = sum(it.nbytes for it in items)
                if not is_source:
                    stats.bytes_received += payload
                    stats.messages_received += 1
                    stats.bytes_landed += _unpack(tensors, items, buf, dst_mine)
                elif rank == root:
                    stats.bytes_sent += payload * len(engines)
            stats.rounds += 1
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        group.signal_abort(error, refit=refit)
    stats.seconds = time.perf_counter() - t0
    group.agree(
        "transfer", refit, wire.Status(rank=rank, step="transfer", refit=refit, ok=not error, error=error), peers=()
    )
    stats.dense_bytes = stats.wire_bytes = stats.bytes_sent + stats.bytes_received
    return stats


def _holds(slots: list[Slot], rank: int, item: _Item) -> bool:
    box = item.box
    return any(s.rank == rank and s.box.intersect(box) is not None for s in slots)


def _gather(
    group: RefitGroup, tensors: Mapping, root: int, items: list[_Item], src_slots, buf, stats: ExecStats
) -> None:
    """Every bucket piece goes from its lowest-ranked holder to the root
    (one NCCL group per bucket: single sends outside a group would build a
    communicator per pair of ranks, lazily, inside the first refit)."""
    import torch

    rank = group.rank
    device = group.device
    ops: list[Op] = []
    keep = []
    for it in items:
        box = it.box
        taken: list[Box] = []
        for s in sorted(src_slots[it.meta.name], key=lambda x: x.rank):
            part = s.box.intersect(box)
            if part is None or any(t == part for t in taken):
                continue
            taken.append(part)
            if rank not in (s.rank, root):
                continue
            dtype = getattr(torch, it.meta.dtype)
            if rank == s.rank:
                src = local_view(tensors[s.local], s, part)
            if rank == root:
                assert buf is not None
                whole = buf.narrow(0, it.offset, it.nbytes).view(dtype).view(box.sizes)
                dst = whole[
                    tuple(
                        slice(o - b, o - b + n) for o, b, n in zip(part.offsets, box.offsets, part.sizes, strict=True)
                    )
                ]
                if s.rank == root:
                    dst.copy_(src)
                    continue
                tmp = torch.empty(part.sizes, dtype=dtype, device=buf.device)
                ops.append(Op(False, tmp.view(-1).view(torch.uint8), s.rank, 0))
                keep.append((dst, tmp))
            else:
                # (A source in host memory is staged onto the group's device.)
                packed = src.to(device=device, memory_format=torch.contiguous_format)
                ops.append(Op(True, packed.view(-1).view(torch.uint8), root, 0))
                keep.append((None, packed))
                stats.bytes_sent += packed.numel() * packed.element_size()
    for w in post_ops(group.pg, ops, device=device, backend=group.backend, coalesce=group.coalesces):
        w.wait()
    for dst, tmp in keep:
        if dst is not None:
            dst.copy_(tmp)
            stats.bytes_received += tmp.numel() * tmp.element_size()


def _broadcast_group(group: RefitGroup, root: int, engines: list[int], device) -> object:
    import contextlib
    import datetime

    from torch.distributed import PrefixStore, ProcessGroupGloo

    from reshard.transport.joining import gloo_devices

    members = [root, *engines]
    store = PrefixStore(f"bcast/{root}", group.store)
    timeout = datetime.timedelta(seconds=group.config.timeout_s)
    if group.backend == "gloo":
        opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        opts._devices = gloo_devices(group.config)
        return ProcessGroupGloo(store, members.index(group.rank), len(members), opts)
    from reshard.transport.joining import nccl_pg

    env = group.config.pg_env() if group.config.pg_env is not None else contextlib.nullcontext()
    with env:
        # The communicator is built now, inside ``pg_env`` (see GroupConfig).
        return nccl_pg(store, members.index(group.rank), len(members), device, timeout)


def _unpack(tensors: Mapping, items: list[_Item], buf, dst_mine: dict[str, list[Slot]]) -> int:
    """Keep the slices this engine worker needs; drop the rest of the bucket.
    Returns the bytes kept, in the local tensors' dtypes."""
    import torch

    landed = 0
    for it in items:
        box = it.box
        dtype = getattr(torch, it.meta.dtype)
        whole = None
        for s in dst_mine.get(it.meta.name, ()):
            part = s.box.intersect(box)
            if part is None:
                continue
            if whole is None:
                whole = buf.narrow(0, it.offset, it.nbytes).view(dtype).view(box.sizes)
            src = whole[
                tuple(slice(o - b, o - b + n) for o, b, n in zip(part.offsets, box.offsets, part.sizes, strict=True))
            ]
            dst = local_view(tensors[s.local], s, part)
            dst.copy_(src)
            landed += dst.numel() * dst.element_size()
    return landed
