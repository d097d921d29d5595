"""Execute one rank's plan on a refit group.

Per round: transfers to (from) each peer become messages, both sides cut
them the same way (:mod:`reshard.transport.messages`): a transfer of at
least ``big_bytes`` is a message of its own, received straight into its
destination when the destination slice is contiguous and sent straight from
its source when the source slice is contiguous (zero copy); smaller
transfers to one peer are packed into one message. Non-contiguous slices go
through a staging arena whose size the plan fixes in advance
(:func:`~reshard.transport.messages.staging_need`); a slice sent to several
peers is packed once. Messages of a round are posted together (one NCCL
group) and waited on; a forward reads what this rank received in an
earlier round.

Deltas (``delta``, :mod:`reshard.transport.delta`): to a peer the plan step
chose for a delta, a round is one small *header* (per transfer: its
encoding and how many elements changed, :mod:`reshard.transport.encoding`)
and one *payload*, the transfers' encoded parts back to back. Headers of a
round travel first (their own NCCL group); a receiver posts each payload's
receive, of the size its header implies, once the headers arrived. The
sender encodes a round's transfers before it posts them, while the previous
round's bytes are on the wire, and brings its snapshot up to date as it
goes (the boxes of peers that move dense too).

Integrity (``checksums=True``, every rank alike): with each round, a sender
sends every peer one more small message (tag: the number of messages) with
a checksum of each message it sent, taken from the bytes it posted; the
receiver checks what arrived before it unpacks anything and raises
:class:`RefitError` naming the message's tensors, boxes and both ranks.
Checksums are CRC-32 (zlib) for gloo, where buffers are in host memory, and a
position-weighted 64-bit Fletcher sum computed on the device for NCCL. A
leader checks what it received before it forwards it, and checksums what it
forwards afresh. A delta payload is a message like any other.

Shared memory: messages to and from a peer this rank shares memory with
(:meth:`RefitGroup.shares_memory`) go through a channel
(:mod:`reshard.transport.shm_links`) instead of the process group; checksums
still travel over the process group. The stats count bytes per link
(``shm``, ``gloo``, ``nccl``). A transfer whose source tensor the colocated
sender exported (``exports``) is no message at all: the receiver copies the
slice straight out of the sender's mapped storage while the round's messages
are in flight (``direct_bytes``); both sides leave it out of their messages
alike, since both see the same exports (:mod:`reshard.transport.links`).

Failure: if a round fails or another rank signals an abort, the executor
raises at once (its waits run in a helper thread so the store can be
watched), and the caller closes the group so peers blocked on this rank
fail too.
"""

from __future__ import annotations

import concurrent.futures as cf
import enum
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from reshard.errors import RefitError
from reshard.plan.delta_format import HEADER_BYTES, own_message, pad, wire_dtype
from reshard.plan.items import RankPlan, Round, Transfer
from reshard.plan.layout import dtype_size
from reshard.transport.checksum import checksum
from reshard.transport.delta import DeltaRun
from reshard.transport.delta_io import (
    Payload,
    apply_payload,
    count_later,
    encode_round,
    header_parts,
    snapshot_dense,
)
from reshard.transport.links import is_direct, no_wire_text, wire_transfers, without_direct
from reshard.transport.locals import LocalTensors, local_tensors
from reshard.transport.messages import (
    BIG_BYTES,
    DEFAULT_BUDGET_BYTES,
    DeltaPayload,
    Packed,
    StagingKey,
    Unpacked,
    align,
    describe,
    landed,
    link_summary,
    local_view,
    messages,
    packed_size,
    round_staging,
    slice_key,
    staging_need,
    torch_dtype,
)
from reshard.transport.posting import Op, off_device_locals, post_ops
from reshard.transport.shm_links import ShmLinks
from reshard.transport.stats import ExecStats, count_cast

if TYPE_CHECKING:
    import torch

    from reshard.transport.group import RefitGroup
    from reshard.transport.wire import Export

__all__ = [
    "BIG_BYTES",
    "DEFAULT_BUDGET_BYTES",
    "HEADER_TAG",
    "ExecStats",
    "Executor",
    "align",
    "checksum",
    "is_direct",
    "link_summary",
    "local_view",
    "messages",
    "no_wire_text",
    "staging_need",
    "wire_transfers",
    "without_direct",
]

HEADER_TAG = 1 << 24
"""Tag of a delta header (payloads take tag 0, their checksums tag 1)."""

_GLOO_SOURCE = re.compile(r"\[[^\]]*\.cc:\d+\] ")

tamper: Callable[[int, int, int, torch.Tensor], torch.Tensor] | None = None
"""Test hook: ``tamper(rank, peer, tag, buf)`` returns the bytes to send in
place of ``buf``, after their checksum was taken (tests corrupt a message in
flight with it). ``None`` in normal use."""


class _How(enum.Enum):
    """How a received message lands."""

    INPLACE = "inplace"
    """Straight into its destination (one contiguous slice on the group's device)."""
    STAGED = "staged"
    """Packed in the arena, unpacked once the round completed."""
    DELTA = "delta"
    """A delta payload in the arena, applied once the round completed."""
    PART = "part"
    """A delta part that is a message of its own, landed with its payload's."""


@dataclass(slots=True)
class _Recv:
    """One message this rank receives in a round."""

    buf: torch.Tensor | None
    """``None``: nothing travels (a delta whose parts are all ``same``)."""
    peer: int
    tag: int
    msg: list[Transfer]
    how: _How
    parts: list[tuple[int, int, int]] = field(default_factory=list)
    """A delta payload's parts: ``(encoding, changed, bytes)`` per transfer."""
    own: dict[int, torch.Tensor | None] = field(default_factory=dict)
    """A delta payload's parts that are messages of their own, by transfer
    index: the staging they land in, or ``None`` (received in place)."""


class _Send(NamedTuple):
    """One message this rank sends in a round."""

    zero_copy: bool
    """Sent straight from its source (nothing to pack first)."""
    peer: int
    tag: int
    make: Callable[[], torch.Tensor]
    """Its bytes (packing them into the arena, when it is packed)."""


def _ready(buf: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A message's bytes that need no packing."""
    return lambda: buf


@dataclass(slots=True)
class _Pending:
    """A round whose messages are posted but not yet waited on."""

    round: Round
    recv_ops: list[_Recv]
    works: list
    staging: int
    sums_in: dict = field(default_factory=dict)
    """peer -> the tensor the peer's checksums arrive in (``checksums=True``)."""
    keep: list = field(default_factory=list)


class Executor:
    """Runs a :class:`RankPlan` on a :class:`RefitGroup`.

    ``sources``: this rank's source tensors (trainer side), ``destinations``:
    its destination tensors (engine side; they may materialize on demand);
    both :class:`~reshard.transport.locals.LocalTensors` (or mappings), told
    of every round that completed on this rank (``landed``, when every byte
    it received so far has landed), after ``after_round(i)`` (a progress
    line).
    ``exports``: per source rank, the tensors it exported to shared memory
    (every rank passes the same; see the module docstring). ``delta``: the
    peers this refit exchanges deltas with (see the module docstring).
    ``arena``: a staging arena an earlier executor used, taken when it is
    large enough (a fresh host allocation faults in every page again).
    """

    def __init__(
        self,
        group: RefitGroup,
        plan: RankPlan,
        *,
        sources: Mapping[str, torch.Tensor] | LocalTensors | None = None,
        destinations: Mapping[str, torch.Tensor] | LocalTensors | None = None,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        big_bytes: int = BIG_BYTES,
        device: torch.device | str = "cpu",
        after_round: Callable[[int], None] | None = None,
        refit: int = 0,
        checksums: bool = False,
        exports: Mapping[int, Mapping[str, Export]] | None = None,
        delta: DeltaRun | None = None,
        arena: torch.Tensor | None = None,
    ) -> None:
        import torch

        self.checksums = checksums
        self._stats: ExecStats | None = None
        self.group = group
        self._exports = {
            r: es for r, es in (exports or {}).items() if r == plan.rank or group.direct_link(r, plan.rank)
        }
        self._direct_in: dict[int, list[tuple[int, Transfer]]] = {}
        self._direct_out: dict[int, list[tuple[int, Transfer]]] = {}
        if self._exports:
            plan = without_direct(group, plan, self._exports, self._direct_in, self._direct_out)
        self.plan = plan
        if group.no_wire:
            wired = wire_transfers(plan)
            if wired:
                raise RefitError("transfer", {plan.rank: no_wire_text(group, wired)}, version=refit)
        self.sources = local_tensors(sources if sources is not None else {})
        self.destinations = local_tensors(destinations if destinations is not None else {})
        self.big_bytes = big_bytes
        self.device = torch.device(device)
        self.after_round = after_round
        self.refit = refit
        self.delta = delta
        self._delta_peers = delta.peers if delta is not None else frozenset()
        self.off_device = off_device_locals(self.sources, self.device) | off_device_locals(
            self.destinations, self.device
        )
        """Local tensors not on the group's device: their messages are staged
        through the arena (which is), never posted in place."""
        need = staging_need(plan, big_bytes, delta_peers=self._delta_peers, off_device=self.off_device)
        if need > budget_bytes:
            raise ValueError(
                f"rank {plan.rank}: its busiest round needs {need} bytes of staging, over the budget of "
                f"{budget_bytes}; plan with smaller rounds"
            )
        self.arena = arena
        """The staging arena this executor used, whole (to hand to the next one)."""
        if not need:
            self._arena = None
        else:
            if arena is None or arena.device != self.device or arena.numel() < need:
                arena = self.arena = torch.empty(need, dtype=torch.uint8, device=self.device)
            self._arena = arena.narrow(0, 0, need)
        self._stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        """The stream this executor packs and unpacks on (the caller's): what
        its waits order NCCL's work before, and synchronize."""
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="reshard-wait")
        self._checked: set[tuple[str, str]] = set()
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._shm = ShmLinks(group, plan, big_bytes=big_bytes, refit=refit, stop=self._stop)
        self._open_exports()

    def _timed(self, phase: str, since: float) -> None:
        if self._stats is not None:
            self._stats.timed(phase, time.perf_counter() - since)

    def _error(self, text: str) -> RefitError:
        return RefitError("transfer", {self.plan.rank: text}, version=self.refit)

    def _read_direct(self, rnd: Round, stats: ExecStats) -> None:
        """Copy this round's direct transfers out of the senders' exported
        tensors, and count what receivers read from this rank's."""
        me = self.plan.rank
        t0 = time.perf_counter()
        for peer, t in self._direct_out.get(rnd.index, ()):
            n = t.nbytes
            stats.sent(peer, self.group.direct_link(me, peer), payload=n, dense=n, wire=n, messages=0)
            stats.direct_bytes += n
        devices: set = set()
        for peer, t in self._direct_in.get(rnd.index, ()):
            link = self.group.direct_link(peer, me)
            dst = local_view(self._tensor(t, "dst"), t.dst, t.box)
            src = self._open_export(peer, t)
            dst.copy_(local_view(src, t.src, t.box))
            if dst.is_cuda:
                devices.update((dst.device, src.device))
            if t.dst.dtype and t.dst.dtype != t.dtype:
                count_cast(stats, t)
            n = t.nbytes
            stats.received(peer, link, payload=n, dense=n, wire=n, landed=landed(t), messages=0)
            stats.direct_bytes += n
            if self.delta is not None:
                self.delta.touched.add(t.dst.local)
        if devices:
            import torch

            # The sender may write its tensors again as soon as this rank
            # reports the refit done: every copy out of them must have run.
            for dev in devices:
                torch.cuda.current_stream(dev).synchronize()
        stats.timed("direct", time.perf_counter() - t0)

    def _open_export(self, peer: int, t: Transfer) -> torch.Tensor:
        """Source rank ``peer``'s exported tensor that ``t`` reads (mapped or
        opened once, then kept), or a clear error."""
        try:
            if not self.group.peer_alive(peer):
                raise RuntimeError("its process is gone")
            return self.group.exported(peer, self._exports[peer][t.src.local])
        except (OSError, RuntimeError, ValueError) as e:
            if self.group.direct_link(peer, self.plan.rank) == "ipc":
                where = "GPU memory (CUDA IPC)"
                hint = (
                    "; a sender whose CUDA allocator uses expandable_segments (PYTORCH_CUDA_ALLOC_CONF) shares "
                    "its memory through pidfd_getfd, which needs ptrace permission over the sender's process"
                )
            else:
                where, hint = "shared memory", ""
            raise self._error(
                f"cannot read {t.tensor!r} ({t.src.local!r}) from rank {peer}'s {where}: {e}{hint}"
            ) from e

    def _open_exports(self) -> None:
        """Map or open every exported tensor this rank reads, before any round
        is posted: one that cannot be opened fails the refit on every rank
        before a byte moves, not in the middle of a round."""
        seen: set[tuple[int, str]] = set()
        for items in self._direct_in.values():
            for peer, t in items:
                if (peer, t.src.local) not in seen:
                    seen.add((peer, t.src.local))
                    self._open_export(peer, t)

    # -- views -------------------------------------------------------------

    def _tensor(self, t: Transfer, side: str) -> torch.Tensor:
        if side == "src":
            table = self.destinations if t.kind == "fwd" else self.sources
            slot = t.src
        else:
            table = self.destinations
            slot = t.dst
        try:
            tensor = table[slot.local]
        except KeyError:
            raise KeyError(
                f"rank {self.plan.rank}: no local tensor {slot.local!r} for {t.tensor}{t.box} ({t.kind})"
            ) from None
        key = (side if t.kind != "fwd" else "dst", slot.local)
        if key not in self._checked:
            # Mappings may materialize tensors lazily (an engine's parameters):
            # check each against its layout before the first byte touches it.
            have = str(tensor.dtype).removeprefix("torch.")
            if tuple(tensor.shape) != tuple(slot.local_shape) or (slot.dtype and have != slot.dtype):
                raise self._error(
                    f"local tensor {slot.local!r} for {t.tensor!r} is {list(tensor.shape)} "
                    f"{have}, its layout says {list(slot.local_shape)} {slot.dtype}"
                )
            self._checked.add(key)
        return tensor

    def _bytes_view(self, t: Transfer, side: str) -> torch.Tensor:
        """A uint8 view of a transfer's slice, which the plan says is contiguous."""
        import torch

        slot = t.src if side == "src" else t.dst
        v = local_view(self._tensor(t, side), slot, t.box)
        if not v.is_contiguous():
            raise self._error(
                f"local tensor {slot.local!r} is not contiguous in memory; reshard needs contiguous local tensors"
            )
        if v.device != self.device:
            # Known only now for a tensor materialized on demand: never post it.
            raise self._error(
                f"local tensor {slot.local!r} for {t.tensor!r} is on {v.device}, the refit group's device is "
                f"{self.device}; reshard receives into and sends from tensors on the group's device only "
                "(others are staged when they are known before the refit starts)"
            )
        out = v.view(-1).view(torch.uint8)
        if out.numel() != t.nbytes:
            # The local checks make this impossible; gloo would take a shorter
            # message into a longer buffer without a word, so never post one.
            raise self._error(
                f"local tensor {slot.local!r}: its slice {t.box} is {out.numel()} bytes here, "
                f"{t.nbytes} in the plan ({t.dtype})"
            )
        return out

    # -- running -------------------------------------------------------------

    def run(self) -> ExecStats:
        """Run every round. Round ``k+1`` is posted before round ``k`` is waited
        on (its packing overlaps round ``k``'s bytes on the wire), unless it
        forwards what round ``k`` brings; rounds use alternate halves of the
        arena."""
        stats = ExecStats(rank=self.plan.rank)
        self._stats = stats
        if self.delta is not None:
            stats.delta_peers = sorted(self._delta_peers)
            stats.dense_peers = dict(sorted(self.delta.dense.items()))
        t0 = self._t0 = time.perf_counter()
        half = staging_need(
            self.plan, self.big_bytes, pipelined=False, delta_peers=self._delta_peers, off_device=self.off_device
        )
        pending: _Pending | None = None
        try:
            for k, rnd in enumerate(self.plan.rounds):
                if pending is not None and any(t.kind == "fwd" for ts in rnd.sends.values() for t in ts):
                    self._finish(pending, stats)
                    pending = None
                started = self._start(rnd, stats, base=(k % 2) * half)
                in_flight = started.staging + (pending.staging if pending is not None else 0)
                stats.peak_staging_bytes = max(stats.peak_staging_bytes, in_flight)
                if pending is not None:
                    self._finish(pending, stats)
                pending = started
            if pending is not None:
                self._finish(pending, stats)
        finally:
            self._stop.set()
            self._pool.shutdown(wait=False, cancel_futures=True)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _finish(self, p: _Pending, stats: ExecStats) -> None:
        self._wait_works(p.works, sorted({r.peer for r in p.recv_ops} | set(p.round.sends)), stats=stats)
        if self.checksums:
            self._verify(p, stats)
        touched = self.delta.touched if self.delta is not None else None
        delta_before = stats.delta_seconds
        t0 = time.perf_counter()
        for r in p.recv_ops:
            if r.how is _How.PART:
                continue  # landed with its payload's (below)
            if r.how is _How.DELTA:
                assert touched is not None
                try:
                    apply_payload(r.msg, r.parts, r.buf, self._tensor, touched, stats, own=r.own)
                except ValueError as e:
                    raise self._error(f"the delta from rank {r.peer}: {e}") from e
                continue
            if touched is not None:
                touched.update(t.dst.local for t in r.msg)
            if r.how is not _How.STAGED:
                continue
            assert r.buf is not None
            pos = 0
            for t in r.msg:
                dst = local_view(self._tensor(t, "dst"), t.dst, t.box)
                # Viewed as the wire dtype; copy_ casts when the local keeps another.
                dst.copy_(r.buf.narrow(0, pos, t.nbytes).view(torch_dtype(t.dtype)).view(t.box.sizes))
                if t.dst.dtype and t.dst.dtype != t.dtype:
                    count_cast(stats, t)
                pos += align(t.nbytes) if len(r.msg) > 1 else t.nbytes
        t1 = time.perf_counter()
        stats.timed("unpack", t1 - t0 - (stats.delta_seconds - delta_before))
        for t in p.round.copies:
            src = local_view(self._tensor(t, "src"), t.src, t.box)
            dst = local_view(self._tensor(t, "dst"), t.dst, t.box)
            dst.copy_(src)
            if t.dst.dtype and t.dst.dtype != t.dtype:
                count_cast(stats, t)
            stats.bytes_copied += t.nbytes
            stats.bytes_landed += landed(t)
            if touched is not None:
                touched.add(t.dst.local)
        t2 = time.perf_counter()
        if p.round.copies:
            stats.timed("copy", t2 - t1)
        stats.landed_seconds = t2 - self._t0
        stats.rounds += 1
        if self.after_round is not None:
            self.after_round(p.round.index)
        changed = frozenset(touched) if touched is not None else None
        self.sources.landed(p.round.index, None)
        self.destinations.landed(p.round.index, changed)
        stats.timed("after_round", time.perf_counter() - t2)

    def _start(self, rnd: Round, stats: ExecStats, base: int) -> _Pending:
        """Post round ``rnd``: delta payloads encoded and headers exchanged,
        receives and sends laid out, snapshots brought up to date, every
        message posted, direct reads done. ``base``: the offset of the
        arena's half this round stages in."""
        staging_bytes, offsets = round_staging(rnd, self.big_bytes, self._delta_peers, self.off_device)
        offsets = {k: v + base for k, v in offsets.items()}
        payloads, encoded, headers_in, later = self._deltas(rnd, offsets, stats)
        recv_ops = self._receives(rnd, offsets, headers_in, stats)
        send_ops = self._sends(rnd, offsets, payloads, stats)
        delta = self.delta
        if delta is not None and delta.snapshots is not None:
            ts = time.perf_counter()
            snapshot_dense(rnd, self._delta_peers, delta.snapshots, encoded, self._tensor, self.device)
            stats.timed("snapshot", time.perf_counter() - ts)
        recvs = [r for r in recv_ops if r.buf is not None]
        sums_in = self._checksum_buffers(recvs)
        keep: list = []
        works = self._post([(r.buf, r.peer, r.tag) for r in recvs], send_ops, sums_in, keep)
        if later:
            assert delta is not None and delta.snapshots is not None
            count_later(later, delta.snapshots, stats)
        if self._direct_in or self._direct_out:
            self._read_direct(rnd, stats)
        return _Pending(rnd, recv_ops, works, staging_bytes, sums_in, keep)

    def _deltas(
        self, rnd: Round, offsets: dict[StagingKey, int], stats: ExecStats
    ) -> tuple[dict[int, Payload], set[tuple], dict[int, list[tuple[int, int]]], list]:
        """A delta refit's round: this rank's payloads to its delta peers,
        encoded into the arena (a sender), the transfers they cover, and the
        peers' headers, exchanged now (every delta rank). Empty without deltas."""
        delta = self.delta
        if delta is None:
            return {}, set(), {}, []
        payloads: dict[int, Payload] = {}
        encoded: set[tuple] = set()
        later: list = []
        if delta.snapshots is not None and self._arena is not None:
            payloads, encoded, later = encode_round(
                rnd,
                self._delta_peers,
                delta.snapshots,
                self._arena,
                offsets,
                self._tensor,
                self.device,
                stats,
                speeds=delta.speeds,
                big_bytes=self.big_bytes,
            )
        return payloads, encoded, self._exchange_headers(rnd, payloads), later

    def _receives(
        self, rnd: Round, offsets: dict[StagingKey, int], headers_in: dict[int, list[tuple[int, int]]], stats: ExecStats
    ) -> list[_Recv]:
        """The round's receives: straight into the destination when it is one
        contiguous slice, else into staging; a delta peer's payload, of the
        size its header announced (its big ``dense`` parts: messages of their
        own, in place where the destination is contiguous)."""
        import torch

        arena = self._arena
        out: list[_Recv] = []
        for peer in sorted(rnd.recvs):
            transfers = rnd.recvs[peer]
            link = self._link(peer)
            dense = sum(t.nbytes for t in transfers)
            landing = sum(landed(t) for t in transfers)
            if peer in self._delta_peers:
                try:
                    parts = header_parts(transfers, headers_in[peer])
                except ValueError as e:
                    raise self._error(f"rank {peer} sent a delta {e}") from e
                own = [
                    own_message(enc, t.box.numel, dtype_size(wire_dtype(t)), self.big_bytes)
                    for t, (enc, _, _) in zip(transfers, parts)
                ]
                total = sum(n for (*_, n), o in zip(parts, own) if not o)
                at = offsets[DeltaPayload(peer, sending=False)]
                tag = 0
                delta = _Recv(None, peer, -1, transfers, _How.DELTA, parts)
                if total:
                    assert arena is not None
                    delta.buf, delta.tag = arena.narrow(0, at, total), 0
                    tag = 1
                out.append(delta)
                stage = at + pad(total)  # the region holds every part at its dense size, 8-aligned
                wire = total + HEADER_BYTES * len(transfers)
                for i, t in enumerate(transfers):
                    if not own[i]:
                        continue
                    dst = local_view(self._tensor(t, "dst"), t.dst, t.box)
                    size = t.box.numel * dst.element_size()
                    if dst.is_contiguous() and t.dst.local not in self.off_device:
                        buf, delta.own[i] = dst.view(-1).view(torch.uint8), None
                    else:
                        assert arena is not None
                        buf = delta.own[i] = arena.narrow(0, stage, size)
                        stage += pad(size)
                    out.append(_Recv(buf, peer, tag, [t], _How.PART))
                    tag += 1
                    wire += size
                stats.received(
                    peer,
                    link,
                    payload=wire - HEADER_BYTES * len(transfers),
                    dense=dense,
                    wire=wire,
                    landed=landing,
                    messages=tag,
                )
                continue
            msgs = messages(transfers, self.big_bytes)
            for i, msg in enumerate(msgs):
                off = offsets.get(Unpacked(peer, i))
                if off is not None:
                    assert arena is not None
                    out.append(_Recv(arena.narrow(0, off, packed_size(msg)), peer, i, msg, _How.STAGED))
                else:
                    out.append(_Recv(self._bytes_view(msg[0], "dst"), peer, i, msg, _How.INPLACE))
            stats.received(peer, link, payload=dense, dense=dense, wire=dense, landed=landing, messages=len(msgs))
        return out

    def _sends(
        self, rnd: Round, offsets: dict[StagingKey, int], payloads: dict[int, Payload], stats: ExecStats
    ) -> list[_Send]:
        """The round's sends: straight from the source when it is one
        contiguous slice, else packed (a slice sent to several peers once); a
        delta peer's payload. Packing is deferred until the send is posted,
        and on gloo zero-copy sends go first, so packing overlaps bytes
        already on the wire."""
        out: list[_Send] = []
        packed: set[StagingKey] = set()
        for peer in sorted(rnd.sends):
            transfers = rnd.sends[peer]
            link = self._link(peer)
            dense = sum(t.nbytes for t in transfers)
            if peer in payloads:
                buf, _, own = payloads[peer]
                bufs = ([buf] if buf.numel() else []) + own
                for tag, b in enumerate(bufs):
                    out.append(_Send(True, peer, tag, _ready(b)))
                payload = sum(b.numel() for b in bufs)
                wire = payload + HEADER_BYTES * len(transfers)
                stats.sent(peer, link, payload=payload, dense=dense, wire=wire, messages=len(bufs))
                continue
            msgs = messages(transfers, self.big_bytes)
            for i, msg in enumerate(msgs):
                off = offsets.get(Packed(peer, i))
                t = msg[0]
                skey = slice_key(t)
                if off is not None:
                    out.append(_Send(False, peer, i, self._packer(msg, off, packed_size(msg))))
                elif (soff := offsets.get(skey)) is not None:
                    out.append(_Send(False, peer, i, self._slice_packer(t, soff, skey, packed)))
                else:
                    out.append(_Send(True, peer, i, _ready(self._bytes_view(t, "src"))))
            stats.sent(peer, link, payload=dense, dense=dense, wire=dense, messages=len(msgs))
        if self.group.backend != "nccl":
            # Messages carry their index as tag, so gloo matches them in any order.
            out.sort(key=lambda s: not s.zero_copy)
        return out

    def _checksum_buffers(self, recvs: list[_Recv]) -> dict[int, torch.Tensor]:
        """Per peer, the buffer its checksums of this round arrive in (one row
        per message; ``checksums=True`` only)."""
        if not self.checksums:
            return {}
        import torch

        counts: dict[int, int] = {}
        for r in recvs:
            counts[r.peer] = counts.get(r.peer, 0) + 1
        return {peer: torch.empty((n, 2), dtype=torch.int64, device=self.device) for peer, n in sorted(counts.items())}

    def _packer(self, msg: list[Transfer], off: int, n: int) -> Callable[[], torch.Tensor]:
        def pack() -> torch.Tensor:
            arena = self._arena
            assert arena is not None
            t0 = time.perf_counter()
            pos = off
            for t in msg:
                src = local_view(self._tensor(t, "src"), t.src, t.box)
                arena.narrow(0, pos, t.nbytes).view(src.dtype).view(t.box.sizes).copy_(src)
                pos += align(t.nbytes) if len(msg) > 1 else t.nbytes
            self._timed("pack", t0)
            return arena.narrow(0, off, n)

        return pack

    def _slice_packer(
        self, t: Transfer, off: int, key: StagingKey, packed: set[StagingKey]
    ) -> Callable[[], torch.Tensor]:
        """A non-contiguous big slice, packed once for every peer that gets it."""

        def pack() -> torch.Tensor:
            arena = self._arena
            assert arena is not None
            buf = arena.narrow(0, off, t.nbytes)
            if key not in packed:
                t0 = time.perf_counter()
                src = local_view(self._tensor(t, "src"), t.src, t.box)
                buf.view(src.dtype).view(t.box.sizes).copy_(src)
                packed.add(key)
                self._timed("pack", t0)
            return buf

        return pack

    # -- deltas ----------------------------------------------------------------

    def _exchange_headers(self, rnd: Round, payloads: dict[int, Payload]) -> dict[int, list[tuple[int, int]]]:
        """Send this round's delta headers, receive the peers' (blocking, with
        the usual watch for aborts and the timeout): ``(encoding, changed)``
        per transfer, by peer."""
        import torch

        recv_peers = sorted(p for p in rnd.recvs if p in self._delta_peers)
        if not recv_peers and not payloads:
            return {}
        ins = {p: torch.empty((len(rnd.recvs[p]), 2), dtype=torch.int64, device=self.device) for p in recv_peers}
        outs = {
            p: torch.tensor(rows, dtype=torch.int64, device=self.device).view(-1, 2)
            for p, (_, rows, _) in payloads.items()
        }
        ops = [Op(False, buf, p, HEADER_TAG) for p, buf in ins.items()]
        ops += [Op(True, buf, p, HEADER_TAG) for p, buf in outs.items()]
        works = self._post_ops(ops)
        self._wait_works(
            works, sorted(set(recv_peers) | set(outs)), what="delta headers", stats=self._stats, phase="headers"
        )
        return {p: [(int(e), int(k)) for e, k in buf.cpu().tolist()] for p, buf in ins.items()}

    # -- posting and waiting ------------------------------------------------------

    def _post(self, recvs: list, sends: list[_Send], sums_in: dict, keep: list) -> list:
        """Post one round's receives and sends (one NCCL group); with checksums,
        each peer's checksum message follows its data messages. Every send is
        packed (and checksummed) before anything is posted, so nothing that
        may raise runs inside the NCCL group (:mod:`reshard.transport.posting`)."""
        if not recvs and not sends:
            return []
        group = self.group
        shm_in: dict[int, list[tuple[int, torch.Tensor]]] = {}
        shm_out: dict[int, list[tuple[int, torch.Tensor]]] = {}
        ops: list[Op] = []
        for buf, peer, tag in recvs:
            if group.shares_memory(peer):
                shm_in.setdefault(peer, []).append((tag, buf))
            else:
                ops.append(Op(False, buf, peer, tag))
        for peer, buf in sums_in.items():
            ops.append(Op(False, buf, peer, buf.shape[0]))
        sums_out: dict[int, dict[int, torch.Tensor]] = {}
        for _, peer, tag, make in sends:
            buf = make()
            if self.checksums:
                t0 = time.perf_counter()
                sums_out.setdefault(peer, {})[tag] = checksum(buf, group.backend)
                assert self._stats is not None
                self._stats.checksum_seconds += time.perf_counter() - t0
            if tamper is not None:
                buf = tamper(self.plan.rank, peer, tag, buf)
                keep.append(buf)
            if group.shares_memory(peer):
                shm_out.setdefault(peer, []).append((tag, buf))
            else:
                ops.append(Op(True, buf, peer, tag))
        if sums_out:
            import torch

            for peer, by_tag in sums_out.items():
                table = torch.stack([by_tag[i] for i in range(len(by_tag))]).to(self.device)
                keep.append(table)
                ops.append(Op(True, table, peer, len(by_tag)))
        works = self._post_ops(ops)
        for peer, bufs in shm_in.items():
            works.append(self._shm.receive(peer, bufs))
        for peer, bufs in shm_out.items():
            self._shm.send(peer, bufs)
        return works

    def _post_ops(self, ops: list[Op]) -> list:
        """Post ``ops`` on the group's process group (one NCCL group, closed
        whatever happens; every buffer checked against the group's device
        first)."""
        if not ops:
            return []
        group = self.group
        pg = group.pg
        if pg is None:
            why = "the refit group is closed"
            if group.no_wire:
                why = f"the refit group has no process group: {group.no_wire}"
            raise self._error(why)
        try:
            return post_ops(pg, ops, device=self.device, backend=group.backend, coalesce=group.coalesces)
        except ValueError as e:
            raise self._error(str(e)) from e

    def _link(self, peer: int) -> str:
        return "shm" if self.group.shares_memory(peer) else self.group.backend

    def _verify(self, p: _Pending, stats: ExecStats) -> None:
        """Check every message of a finished round against its sender's checksum."""
        import torch

        if not p.sums_in:
            return
        t0 = time.perf_counter()
        backend = self.group.backend
        got: dict[int, list[torch.Tensor]] = {}
        msgs: dict[int, list[_Recv]] = {}
        for r in p.recv_ops:
            if r.buf is not None:
                got.setdefault(r.peer, []).append(checksum(r.buf, backend))
                msgs.setdefault(r.peer, []).append(r)
        bad = []
        for peer, sent in p.sums_in.items():
            mine = torch.stack(got.get(peer, [])).to(sent.device) if got.get(peer) else sent[:0]
            if mine.shape != sent.shape:
                bad.append(f"rank {peer} sent checksums for {sent.shape[0]} messages, {mine.shape[0]} arrived")
                continue
            diff = (mine != sent).any(dim=1).nonzero().flatten().tolist()
            for i in diff:
                r = msgs[peer][i]
                what = "delta of " if r.how is _How.DELTA else ""
                bad.append(
                    f"message {i} from rank {peer} to rank {self.plan.rank} ({what}{describe(r.msg)}; "
                    f"{r.buf.numel()} bytes) arrived corrupted (checksum {sent[i].tolist()} sent, "
                    f"{mine[i].tolist()} received)"
                )
        stats.checksum_seconds += time.perf_counter() - t0
        if bad:
            more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise self._error(f"checksum mismatch in round {p.round.index}: " + "; ".join(bad[:3]) + more)

    def _wait_works(
        self, works: list, peers: list[int], what: str = "a round", stats: ExecStats | None = None, phase: str = "wait"
    ) -> None:
        """Wait for posted works, watching the store for an abort and the
        clock for the timeout (the wait itself runs in a helper thread); the
        time blocked counts as ``phase`` in ``stats``."""
        if not works:
            return
        if stats is not None:
            t0 = time.perf_counter()
            try:
                self._wait_works(works, peers, what)
            finally:
                stats.timed(phase, time.perf_counter() - t0)
            return
        group = self.group
        stream = self._stream

        def wait_all() -> None:
            if stream is None:
                for w in works:
                    w.wait()
                return
            import torch

            # NCCL's wait orders the current stream after the work: make that
            # this executor's stream (not this helper thread's default one, which
            # an engine serving beside a staged refit keeps busy), then wait for it.
            with torch.cuda.stream(stream):
                for w in works:
                    w.wait()
            stream.synchronize()

        fut = self._pool.submit(wait_all)
        deadline = time.monotonic() + group.config.timeout_s
        next_check = 0.0
        while True:
            try:
                fut.result(timeout=0.05)
                return
            except cf.TimeoutError:
                pass
            except Exception as e:
                text = _GLOO_SOURCE.sub("", str(e).split(". This is typically")[0])
                raise self._error(f"{text} (while exchanging with ranks {peers})") from e
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.25
                why = group.cancelled() if group.cancelled is not None else None
                if why:
                    raise self._error(f"cancelled: {why}")
                msg = group.aborted()
                if msg is not None:
                    raise self._error(f"stopped: {msg}")
            if now >= deadline:
                raise self._error(
                    f"{what} did not complete within {group.config.timeout_s}s (exchanging with ranks {peers}: "
                    "one of them, or the link to it, is down, hung or too slow)"
                )
