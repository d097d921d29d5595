"""Execute one rank's plan on a refit group.

Per round: transfers to (from) each peer become messages, both sides cut
them the same way (:func:`messages`): a transfer of at least
``big_bytes`` is a message of its own, received straight into its
destination when the destination slice is contiguous and sent straight from
its source when the source slice is contiguous (zero copy); smaller
transfers to one peer are packed into one message. Non-contiguous slices go
through a staging arena whose size the plan fixes in advance
(:func:`staging_need`); a slice sent to several peers is packed once.
Messages of a round are posted together (one NCCL group) and waited on;
a forward reads what this rank received in an earlier round.

Integrity (``checksums=True``, every rank alike): with each round, a sender
sends every peer one more small message (tag: the number of messages) with
a checksum of each message it sent, taken from the bytes it posted; the
receiver checks what arrived before it unpacks anything and raises
:class:`RefitError` naming the message's tensors, boxes and both ranks.
Checksums are CRC-32 (zlib) for gloo, where buffers are in host memory, and a
position-weighted 64-bit Fletcher sum computed on the device for NCCL. A
leader checks what it received before it forwards it, and checksums what it
forwards afresh.

Shared memory: messages to and from a peer this rank shares memory with
(:meth:`RefitGroup.shares_memory`) go through a channel of
:mod:`reshard.transport.shm` instead of the process group, cut the same way
and laid out in the channel's slot in message order; checksums still travel
over the process group. The stats count bytes per link (``shm``, ``gloo``,
``nccl``). A transfer whose source tensor the colocated sender exported
(``exports``) is no message at all: the receiver copies the slice straight
out of the sender's mapped storage while the round's messages are in
flight (``direct_bytes``); both sides leave it out of their messages alike,
since both see the same exports.

Failure: if a round fails or another rank signals an abort, the executor
raises at once (its waits run in a helper thread so the store can be
watched), and the caller closes the group so peers blocked on this rank
fail too.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import re
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import msgspec

from reshard.errors import RefitError
from reshard.plan.items import RankPlan, Round, Transfer

if TYPE_CHECKING:
    import torch

    from reshard.transport.group import RefitGroup
    from reshard.transport.wire import Export

__all__ = [
    "BIG_BYTES",
    "DEFAULT_BUDGET_BYTES",
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

BIG_BYTES = 1 << 20
"""Transfers at least this large travel as their own message."""

DEFAULT_BUDGET_BYTES = 256 << 20
"""Staging a rank may use for a refit unless it says otherwise."""

_ALIGN = 64
_GLOO_SOURCE = re.compile(r"\[[^\]]*\.cc:\d+\] ")
_FLETCHER_CHUNK = 1 << 24

tamper: Callable[[int, int, int, torch.Tensor], torch.Tensor] | None = None
"""Test hook: ``tamper(rank, peer, tag, buf)`` returns the bytes to send in
place of ``buf``, after their checksum was taken (tests corrupt a message in
flight with it). ``None`` in normal use."""


def align(n: int) -> int:
    """``n`` rounded up to the staging alignment (every packed slice starts aligned)."""
    return -(-n // _ALIGN) * _ALIGN


def packed_size(msg: list[Transfer]) -> int:
    """Bytes of a message: each transfer padded to the arena alignment, so every
    slice in a packed buffer can be viewed as its dtype."""
    if len(msg) == 1:
        return msg[0].nbytes
    return sum(align(t.nbytes) for t in msg)


def messages(transfers: list[Transfer], big_bytes: int = BIG_BYTES) -> list[list[Transfer]]:
    """Cut one peer's transfers of one round into messages, identically on both sides:
    the packed small transfers first (if any), then each big transfer alone."""
    small = [t for t in transfers if t.nbytes < big_bytes]
    big = [[t] for t in transfers if t.nbytes >= big_bytes]
    return ([small] if small else []) + big


def local_view(tensor: torch.Tensor, slot, box) -> torch.Tensor:
    """The region of global ``box`` in the local ``tensor`` of ``slot``, in
    global dim order (a view)."""
    offs, sizes = slot.local_box(box)
    v = tensor
    for d, (o, s) in enumerate(zip(offs, sizes, strict=True)):
        if o != 0 or s != v.shape[d]:
            v = v.narrow(d, o, s)
    if slot.is_plain():
        return v
    kept, to_global, _ = slot.axes()
    return v.reshape([v.shape[k] for k in kept]).permute(to_global)


def _receives_in_place(t: Transfer) -> bool:
    """Can ``t`` be received straight into its destination (one contiguous run of the wire dtype)?"""
    return t.dst.dtype in ("", t.dtype) and _is_contiguous_slice(t.dst, t.box)


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _is_contiguous_slice(slot, box) -> bool:
    """Is the local region of ``box`` one contiguous run (row-major), in global dim order?"""
    if not slot.is_plain():
        return False
    offs, sizes = slot.local_box(box)
    shape = slot.local_shape
    # After the first dim with more than one element, every dim must be whole.
    seen_partial = False
    for s, n in zip(sizes, shape, strict=True):
        if seen_partial and s != n:
            return False
        if s > 1:
            seen_partial = True
    del offs
    return True


def staging_need(plan: RankPlan, big_bytes: int = BIG_BYTES, *, pipelined: bool = True) -> int:
    """Staging bytes ``plan`` needs: the busiest round's, twice when rounds are
    pipelined (two rounds in flight use alternate halves of the arena)."""
    need = 0
    for rnd in plan.rounds:
        need = max(need, _round_staging(rnd, plan.rank, big_bytes)[0])
    return 2 * need if pipelined and len(plan.rounds) > 1 else need


def link_summary(
    plan: RankPlan, big_bytes: int = BIG_BYTES
) -> tuple[dict[int, tuple[int, int, int]], dict[int, tuple[int, int, int]]]:
    """``(sends, recvs)``: per peer, ``(messages, bytes, digest)`` of what this
    plan sends it and expects from it. The digest covers every message's
    round, index, size and slices, so two peers whose plans differ in any
    way that matters on the wire are caught before any byte moves."""
    out: tuple[dict[int, list], dict[int, list]] = ({}, {})
    for rnd in plan.rounds:
        for side, by_peer in ((0, rnd.sends), (1, rnd.recvs)):
            for peer, transfers in by_peer.items():
                rows = out[side].setdefault(peer, [])
                for i, msg in enumerate(messages(transfers, big_bytes)):
                    rows.append((rnd.index, i, [(t.ordinal, t.box.offsets, t.box.sizes, t.nbytes) for t in msg]))
    summary: tuple[dict[int, tuple[int, int, int]], dict[int, tuple[int, int, int]]] = ({}, {})
    for side in (0, 1):
        for peer, rows in out[side].items():
            digest = hashlib.blake2b(msgspec.msgpack.encode(rows), digest_size=8).digest()
            nbytes = sum(n for _, _, msg in rows for *_, n in msg)
            summary[side][peer] = (len(rows), nbytes, int.from_bytes(digest, "little", signed=True))
    return summary


def _round_staging(rnd: Round, rank: int, big_bytes: int) -> tuple[int, dict]:
    """(bytes, layout) of the staging a round needs; layout maps keys to offsets."""
    offsets: dict[tuple, int] = {}
    total = 0

    def take(key: tuple, n: int) -> None:
        nonlocal total
        if key not in offsets:
            offsets[key] = total
            total += align(n)

    for peer in sorted(rnd.sends):
        for i, msg in enumerate(messages(rnd.sends[peer], big_bytes)):
            if len(msg) > 1 or msg[0].nbytes < big_bytes:
                take(("send", peer, i), packed_size(msg))
            elif not _is_contiguous_slice(msg[0].src, msg[0].box):
                t = msg[0]
                # Pack once, send to every peer that gets the same slice.
                take(("slice", t.kind, t.src.local, t.src.offset, t.box), t.nbytes)
    for peer in sorted(rnd.recvs):
        for i, msg in enumerate(messages(rnd.recvs[peer], big_bytes)):
            if len(msg) > 1 or msg[0].nbytes < big_bytes or not _receives_in_place(msg[0]):
                take(("recv", peer, i), packed_size(msg))
    return total, offsets


def checksum(buf: torch.Tensor, backend: str) -> torch.Tensor:
    """Checksum of a message (a 1-D uint8 tensor): two int64.

    gloo (host memory): ``[CRC-32, length]``. NCCL (device memory): a
    Fletcher-style pair ``[sum w_i, sum i * w_i]`` over 32-bit words ``w_i``
    (then the tail bytes) with 64-bit wraparound, which is independent of
    the order of the reduction, so both sides agree; it catches any change
    of one word and any swap of two different words.
    """
    import torch

    n = buf.numel()
    if backend != "nccl":
        host = buf.detach().cpu() if buf.device.type != "cpu" else buf.detach()
        return torch.tensor([zlib.crc32(host.numpy().data), n], dtype=torch.int64)
    b = buf.detach()
    head = n - n % 4
    if b.data_ptr() % 4:
        b = b.clone()
    a = torch.zeros((), dtype=torch.int64, device=b.device)
    w = torch.zeros((), dtype=torch.int64, device=b.device)
    words = b[:head].view(torch.int32)
    for start in range(0, words.numel(), _FLETCHER_CHUNK):
        x = words[start : start + _FLETCHER_CHUNK].to(torch.int64)
        idx = torch.arange(start + 1, start + 1 + x.numel(), dtype=torch.int64, device=b.device)
        a += x.sum()
        w += (x * idx).sum()
    if head < n:
        x = b[head:].to(torch.int64)
        idx = torch.arange(head + 1, n + 1, dtype=torch.int64, device=b.device)
        a += x.sum()
        w += (x * idx).sum()
    return torch.stack([a, w])


def _count_cast(stats: ExecStats, t: Transfer) -> None:
    key = f"{t.dtype}->{t.dst.dtype}"
    stats.casts[key] = stats.casts.get(key, 0) + t.nbytes


def _describe(msg: list[Transfer], limit: int = 3) -> str:
    text = ", ".join(f"{t.tensor!r}{t.box}" for t in msg[:limit])
    return text + (f" and {len(msg) - limit} more" if len(msg) > limit else "")


@dataclass(slots=True)
class _Pending:
    """A round whose messages are posted but not yet waited on."""

    round: Round
    recv_ops: list
    works: list
    staging: int
    sums_in: dict = field(default_factory=dict)
    """peer -> the tensor the peer's checksums arrive in (``checksums=True``)."""
    keep: list = field(default_factory=list)


class _ShmWork:
    """A shared-memory receive, waited on like a process-group work."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.wait = run


@dataclass(slots=True)
class ExecStats:
    """What one rank moved in one refit (payload bytes, without padding)."""

    rank: int
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    rounds: int = 0
    peak_staging_bytes: int = 0
    seconds: float = 0.0
    recv_by_peer: dict[int, int] = field(default_factory=dict)
    send_by_peer: dict[int, int] = field(default_factory=dict)
    checksum_seconds: float = 0.0
    """Time spent taking and checking checksums (``checksums=True``)."""
    casts: dict[str, int] = field(default_factory=dict)
    """Bytes received (or copied) in one dtype and cast into a local tensor of
    another, by ``"src->dst"`` dtype pair (empty when every dtype matched)."""
    recv_by_link: dict[str, int] = field(default_factory=dict)
    """Bytes received per link: ``shm`` (shared memory), ``gloo`` or ``nccl``."""
    send_by_link: dict[str, int] = field(default_factory=dict)
    direct_bytes: int = 0
    """Of the ``shm`` bytes: those read straight from a colocated sender's
    exported tensors (received) or read so by a receiver (sent)."""

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def is_direct(group: RefitGroup, src: int, dst: int, t: Transfer, exports: Mapping[int, Mapping[str, Export]]) -> bool:
    """Does ``t`` (from ``src`` to ``dst``) skip the wire, read by ``dst``
    straight from ``src``'s exported tensor? Both ranks decide alike: from
    the hellos and the same exports."""
    if t.kind == "fwd" or not group.direct_link(src, dst):
        return False
    e = exports.get(src, {}).get(t.src.local)
    return (
        e is not None
        and e.shape == tuple(t.src.local_shape)
        and e.dtype == t.dtype
        and (not t.src.dtype or t.src.dtype == e.dtype)
    )


def without_direct(
    group: RefitGroup,
    plan: RankPlan,
    exports: Mapping[int, Mapping[str, Export]],
    direct_in: dict[int, list[tuple[int, Transfer]]] | None = None,
    direct_out: dict[int, list[tuple[int, Transfer]]] | None = None,
) -> RankPlan:
    """``plan`` without the transfers that skip the wire (see :func:`is_direct`);
    those are kept aside per round in ``direct_in`` and ``direct_out``."""
    me = plan.rank
    direct_in = {} if direct_in is None else direct_in
    direct_out = {} if direct_out is None else direct_out

    def split(rnd: Round, by_peer: dict[int, list[Transfer]], out: dict, sending: bool) -> dict:
        kept: dict[int, list[Transfer]] = {}
        for peer, ts in by_peer.items():
            for t in ts:
                src, dst = (me, peer) if sending else (peer, me)
                if is_direct(group, src, dst, t, exports):
                    out.setdefault(rnd.index, []).append((peer, t))
                else:
                    kept.setdefault(peer, []).append(t)
        return kept

    rounds = [
        replace(
            rnd,
            sends=split(rnd, rnd.sends, direct_out, True),
            recvs=split(rnd, rnd.recvs, direct_in, False),
        )
        for rnd in plan.rounds
    ]
    return replace(plan, rounds=rounds)


def wire_transfers(plan: RankPlan, *, sends_only: bool = False) -> list[tuple[str, int, Transfer]]:
    """``("send" | "recv", peer, transfer)`` for every transfer of ``plan``
    that travels over the process group (shared-memory channels included)."""
    out: list[tuple[str, int, Transfer]] = []
    for rnd in plan.rounds:
        for side, by_peer in (("send", rnd.sends), ("recv", rnd.recvs)):
            if sends_only and side == "recv":
                continue
            for peer, ts in by_peer.items():
                out.extend((side, peer, t) for t in ts)
    return out


def no_wire_text(group: RefitGroup, wired: list[tuple[str, int, Transfer]]) -> str:
    """Why a plan that needs the process group cannot run on ``group``, naming
    its first transfers (``wired``, from :func:`wire_transfers`)."""
    me = group.rank
    parts = []
    for side, peer, t in wired[:3]:
        src, dst = (me, peer) if side == "send" else (peer, me)
        why = (
            "forwarded"
            if t.kind == "fwd"
            else (
                "not exported by its sender"
                if group.direct_link(src, dst)
                else f"rank {dst} cannot map rank {src}'s GPU"
            )
        )
        parts.append(f"{t.tensor!r}{t.box} from rank {src} to rank {dst} ({t.nbytes} bytes; {why})")
    more = f" and {len(wired) - 3} more" if len(wired) > 3 else ""
    return f"{'; '.join(parts)}{more} must cross the process group, which this group has not: {group.no_wire}"


class Executor:
    """Runs a :class:`RankPlan` on a :class:`RefitGroup`.

    ``sources`` maps local names to this rank's source tensors (trainer side),
    ``destinations`` to its destination tensors (engine side; a mapping may
    materialize tensors lazily). ``after_round(i)`` runs after round ``i``
    completed on this rank, when every byte it received so far has landed.
    ``exports``: per source rank, the tensors it exported to shared memory
    (every rank passes the same; see the module docstring).
    """

    def __init__(
        self,
        group: RefitGroup,
        plan: RankPlan,
        *,
        sources: Mapping[str, torch.Tensor] | None = None,
        destinations: Mapping[str, torch.Tensor] | None = None,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        big_bytes: int = BIG_BYTES,
        device: torch.device | str = "cpu",
        after_round: Callable[[int], None] | None = None,
        refit: int = 0,
        checksums: bool = False,
        exports: Mapping[int, Mapping[str, Export]] | None = None,
    ) -> None:
        import torch

        self.checksums = checksums
        self._stats: ExecStats | None = None
        self.group = group
        self.plan = plan
        self._exports = {
            r: es for r, es in (exports or {}).items() if r == plan.rank or group.direct_link(r, plan.rank)
        }
        self._direct_in: dict[int, list[tuple[int, Transfer]]] = {}
        self._direct_out: dict[int, list[tuple[int, Transfer]]] = {}
        if self._exports:
            plan = self._without_direct(plan)
        self.plan = plan
        if group.no_wire:
            wired = wire_transfers(plan)
            if wired:
                raise RefitError("transfer", {plan.rank: no_wire_text(group, wired)}, version=refit)
        self.sources = sources if sources is not None else {}
        self.destinations = destinations if destinations is not None else {}
        self.big_bytes = big_bytes
        self.device = torch.device(device)
        self.after_round = after_round
        self.refit = refit
        need = staging_need(plan, big_bytes)
        if need > budget_bytes:
            raise ValueError(
                f"rank {plan.rank}: its busiest round needs {need} bytes of staging, over the budget of "
                f"{budget_bytes}; plan with smaller rounds"
            )
        self._arena = torch.empty(need, dtype=torch.uint8, device=self.device) if need else None
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="reshard-wait")
        self._checked: set[tuple[str, str]] = set()
        self._stop = threading.Event()
        # Per shared-memory peer: the slot its channel needs (the busiest round).
        self._shm_slots: dict[tuple[str, int], int] = {}
        for rnd in plan.rounds:
            for side, by_peer in (("send", rnd.sends), ("recv", rnd.recvs)):
                for peer, transfers in by_peer.items():
                    if group.shares_memory(peer):
                        n = sum(align(packed_size(m)) for m in messages(transfers, big_bytes))
                        key = (side, peer)
                        self._shm_slots[key] = max(self._shm_slots.get(key, 0), n)

    def _without_direct(self, plan: RankPlan) -> RankPlan:
        """``plan`` without the transfers that skip the wire (kept aside per round)."""
        return without_direct(self.group, plan, self._exports, self._direct_in, self._direct_out)

    def _read_direct(self, rnd: Round, stats: ExecStats) -> None:
        """Copy this round's direct transfers out of the senders' exported
        tensors, and count what receivers read from this rank's."""
        me = self.plan.rank
        for peer, t in self._direct_out.get(rnd.index, ()):
            link = self.group.direct_link(me, peer)
            stats.bytes_sent += t.nbytes
            stats.direct_bytes += t.nbytes
            stats.send_by_peer[peer] = stats.send_by_peer.get(peer, 0) + t.nbytes
            stats.send_by_link[link] = stats.send_by_link.get(link, 0) + t.nbytes
        devices: set = set()
        for peer, t in self._direct_in.get(rnd.index, ()):
            link = self.group.direct_link(peer, me)
            dst = local_view(self._tensor(t, "dst"), t.dst, t.box)
            try:
                if not self.group.peer_alive(peer):
                    raise RuntimeError("its process is gone")
                src = self.group.exported(peer, self._exports[peer][t.src.local])
            except (OSError, RuntimeError, ValueError) as e:
                raise RefitError(
                    "transfer",
                    {
                        self.plan.rank: f"cannot read {t.tensor!r} ({t.src.local!r}) from rank {peer}'s "
                        f"{'GPU memory (CUDA IPC)' if link == 'ipc' else 'shared memory'}: {e}"
                    },
                    version=self.refit,
                ) from e
            dst.copy_(local_view(src, t.src, t.box))
            if dst.is_cuda:
                devices.update((dst.device, src.device))
            if t.dst.dtype and t.dst.dtype != t.dtype:
                _count_cast(stats, t)
            stats.bytes_received += t.nbytes
            stats.direct_bytes += t.nbytes
            stats.recv_by_peer[peer] = stats.recv_by_peer.get(peer, 0) + t.nbytes
            stats.recv_by_link[link] = stats.recv_by_link.get(link, 0) + t.nbytes
        if devices:
            import torch

            # The sender may write its tensors again as soon as this rank
            # reports the refit done: every copy out of them must have run.
            for dev in devices:
                torch.cuda.current_stream(dev).synchronize()

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
                raise RefitError(
                    "transfer",
                    {
                        self.plan.rank: f"local tensor {slot.local!r} for {t.tensor!r} is {list(tensor.shape)} "
                        f"{have}, its layout says {list(slot.local_shape)} {slot.dtype}"
                    },
                    version=self.refit,
                )
            self._checked.add(key)
        return tensor

    def _bytes_view(self, t: Transfer, side: str) -> torch.Tensor:
        """A uint8 view of a transfer's slice, which the plan says is contiguous."""
        import torch

        v = local_view(self._tensor(t, side), t.src if side == "src" else t.dst, t.box)
        if not v.is_contiguous():
            slot = t.src if side == "src" else t.dst
            raise RefitError(
                "transfer",
                {
                    self.plan.rank: f"local tensor {slot.local!r} is not contiguous in memory; reshard needs "
                    "contiguous local tensors"
                },
                version=self.refit,
            )
        out = v.view(-1).view(torch.uint8)
        if out.numel() != t.nbytes:
            # The local checks make this impossible; gloo would take a shorter
            # message into a longer buffer without a word, so never post one.
            slot = t.src if side == "src" else t.dst
            raise RefitError(
                "transfer",
                {
                    self.plan.rank: f"local tensor {slot.local!r}: its slice {t.box} is {out.numel()} bytes here, "
                    f"{t.nbytes} in the plan ({t.dtype})"
                },
                version=self.refit,
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
        t0 = time.perf_counter()
        half = staging_need(self.plan, self.big_bytes, pipelined=False)
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
        self._wait(p)
        if self.checksums:
            self._verify(p, stats)
        # Unpack staged receives.
        for buf, _peer, _i, msg, staged in p.recv_ops:
            if not staged:
                continue
            pos = 0
            for t in msg:
                dst = local_view(self._tensor(t, "dst"), t.dst, t.box)
                # Viewed as the wire dtype; copy_ casts when the local keeps another.
                dst.copy_(buf.narrow(0, pos, t.nbytes).view(_torch_dtype(t.dtype)).view(t.box.sizes))
                if t.dst.dtype and t.dst.dtype != t.dtype:
                    _count_cast(stats, t)
                pos += align(t.nbytes) if len(msg) > 1 else t.nbytes
        for t in p.round.copies:
            src = local_view(self._tensor(t, "src"), t.src, t.box)
            dst = local_view(self._tensor(t, "dst"), t.dst, t.box)
            dst.copy_(src)
            if t.dst.dtype and t.dst.dtype != t.dtype:
                _count_cast(stats, t)
            stats.bytes_copied += t.nbytes
        stats.rounds += 1
        if self.after_round is not None:
            self.after_round(p.round.index)

    def _start(self, rnd: Round, stats: ExecStats, base: int) -> _Pending:
        staging_bytes, offsets = _round_staging(rnd, self.plan.rank, self.big_bytes)
        offsets = {k: v + base for k, v in offsets.items()}
        arena = self._arena
        recv_ops: list[tuple] = []
        send_ops: list[tuple] = []
        # Receives: straight into the destination when possible, else into staging.
        for peer in sorted(rnd.recvs):
            for i, msg in enumerate(messages(rnd.recvs[peer], self.big_bytes)):
                n = packed_size(msg)
                off = offsets.get(("recv", peer, i))
                if off is not None:
                    assert arena is not None
                    recv_ops.append((arena.narrow(0, off, n), peer, i, msg, True))
                else:
                    recv_ops.append((self._bytes_view(msg[0], "dst"), peer, i, msg, False))
                payload = sum(t.nbytes for t in msg)
                stats.messages_received += 1
                stats.bytes_received += payload
                stats.recv_by_peer[peer] = stats.recv_by_peer.get(peer, 0) + payload
                link = self._link(peer)
                stats.recv_by_link[link] = stats.recv_by_link.get(link, 0) + payload
        # Sends: straight from the source when it is one contiguous slice, else
        # packed. Packing is deferred until the send is posted, and zero-copy
        # sends go first, so packing overlaps with bytes already on the wire.
        packed: set[tuple] = set()
        for peer in sorted(rnd.sends):
            for i, msg in enumerate(messages(rnd.sends[peer], self.big_bytes)):
                n = packed_size(msg)
                off = offsets.get(("send", peer, i))
                if off is not None:
                    send_ops.append((1, peer, i, self._packer(msg, off, n)))
                else:
                    t = msg[0]
                    skey = ("slice", t.kind, t.src.local, t.src.offset, t.box)
                    soff = offsets.get(skey)
                    if soff is not None:
                        send_ops.append((1, peer, i, self._slice_packer(t, soff, skey, packed)))
                    else:
                        buf = self._bytes_view(t, "src")
                        send_ops.append((0, peer, i, lambda buf=buf: buf))
                payload = sum(t.nbytes for t in msg)
                stats.messages_sent += 1
                stats.bytes_sent += payload
                stats.send_by_peer[peer] = stats.send_by_peer.get(peer, 0) + payload
                link = self._link(peer)
                stats.send_by_link[link] = stats.send_by_link.get(link, 0) + payload
        if self.group.backend != "nccl":
            # Messages carry their index as tag, so gloo matches them in any order.
            send_ops.sort(key=lambda x: x[0])
        sums_in: dict[int, torch.Tensor] = {}
        if self.checksums:
            import torch

            for peer in sorted(rnd.recvs):
                n = len(messages(rnd.recvs[peer], self.big_bytes))
                sums_in[peer] = torch.empty((n, 2), dtype=torch.int64, device=self.device)
        keep: list = []
        works = self._post(
            [(b, p, i) for b, p, i, _, _ in recv_ops], [(p, i, make) for _, p, i, make in send_ops], sums_in, keep
        )
        if self._direct_in or self._direct_out:
            self._read_direct(rnd, stats)
        return _Pending(rnd, recv_ops, works, staging_bytes, sums_in, keep)

    def _packer(self, msg: list[Transfer], off: int, n: int) -> Callable[[], torch.Tensor]:
        def pack() -> torch.Tensor:
            arena = self._arena
            assert arena is not None
            pos = off
            for t in msg:
                src = local_view(self._tensor(t, "src"), t.src, t.box)
                arena.narrow(0, pos, t.nbytes).view(src.dtype).view(t.box.sizes).copy_(src)
                pos += align(t.nbytes) if len(msg) > 1 else t.nbytes
            return arena.narrow(0, off, n)

        return pack

    def _slice_packer(self, t: Transfer, off: int, key: tuple, packed: set) -> Callable[[], torch.Tensor]:
        """A non-contiguous big slice, packed once for every peer that gets it."""

        def pack() -> torch.Tensor:
            arena = self._arena
            assert arena is not None
            buf = arena.narrow(0, off, t.nbytes)
            if key not in packed:
                src = local_view(self._tensor(t, "src"), t.src, t.box)
                buf.view(src.dtype).view(t.box.sizes).copy_(src)
                packed.add(key)
            return buf

        return pack

    def _post(self, recvs: list, sends: list, sums_in: dict, keep: list) -> list:
        """Post one round's receives and sends (one NCCL group); with checksums,
        each peer's checksum message follows its data messages."""
        if not recvs and not sends:
            return []
        group = self.group
        pg = group.pg
        if pg is None:
            why = "the refit group is closed"
            if group.no_wire:
                why = f"the refit group has no process group: {group.no_wire}"
            raise RefitError("transfer", {self.plan.rank: why}, version=self.refit)
        nccl = group.backend == "nccl"
        works = []
        shm_in: dict[int, list[tuple[int, torch.Tensor]]] = {}
        shm_out: dict[int, list[tuple[int, torch.Tensor]]] = {}
        if nccl:
            pg._start_coalescing(self.device)
        for buf, peer, tag in recvs:
            if group.shares_memory(peer):
                shm_in.setdefault(peer, []).append((tag, buf))
            else:
                works.append(pg.recv([buf], peer, tag))
        for peer, buf in sums_in.items():
            works.append(pg.recv([buf], peer, buf.shape[0]))
        sums_out: dict[int, dict[int, torch.Tensor]] = {}
        for peer, tag, make in sends:
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
                works.append(pg.send([buf], peer, tag))
        if sums_out:
            import torch

            for peer, by_tag in sums_out.items():
                table = torch.stack([by_tag[i] for i in range(len(by_tag))]).to(self.device)
                keep.append(table)
                works.append(pg.send([table], peer, len(by_tag)))
        if nccl:
            works = [pg._end_coalescing(self.device)]
        for peer, bufs in shm_in.items():
            works.append(self._shm_receive(peer, bufs))
        for peer, bufs in shm_out.items():
            self._shm_send(peer, bufs)
        return works

    # -- shared memory ----------------------------------------------------------

    def _link(self, peer: int) -> str:
        return "shm" if self.group.shares_memory(peer) else self.group.backend

    def _shm_parts(self, bufs: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
        """``(offset, buffer)`` in the slot: messages in index order, each aligned."""
        parts = []
        pos = 0
        for _tag, buf in sorted(bufs, key=lambda x: x[0]):
            parts.append((pos, buf))
            pos += align(buf.numel())
        return parts

    def _shm_watch(self, peer: int, *, main: bool) -> Callable[[], None]:
        """What a shared-memory wait checks: the peer's process is alive; and
        on the main thread, aborts and cancels; on the helper, this refit
        stopping."""
        group = self.group

        def watch() -> None:
            if not group.peer_alive(peer):
                raise RefitError(
                    "transfer",
                    {self.plan.rank: f"rank {peer} (pid {group.hellos[peer].pid}, shared memory) died"},
                    version=self.refit,
                )
            if not main:
                if self._stop.is_set():
                    raise RefitError("transfer", {self.plan.rank: "stopped"}, version=self.refit)
                return
            why = group.cancelled() if group.cancelled is not None else None
            if why:
                raise RefitError("transfer", {self.plan.rank: f"cancelled: {why}"}, version=self.refit)
            msg = group.aborted(self.refit)
            if msg is not None:
                raise RefitError("transfer", {self.plan.rank: f"stopped: {msg}"}, version=self.refit)

        return watch

    def _shm_send(self, peer: int, bufs: list[tuple[int, torch.Tensor]]) -> None:
        """Copy a round's messages to ``peer`` into its channel (waiting for the slot)."""
        group = self.group
        slot = self._shm_slots[("send", peer)]
        seq = group.shm_seq(self.plan.rank, peer, slot)
        deadline = time.monotonic() + group.config.timeout_s
        watch = self._shm_watch(peer, main=True)
        try:
            ch = group.channel(self.plan.rank, peer, slot, deadline=deadline, watch=watch)
            ch.put(seq, self._shm_parts(bufs), watch, deadline)
        except TimeoutError as e:
            raise RefitError(
                "transfer", {self.plan.rank: f"{e} (sending to rank {peer} through shared memory)"}, version=self.refit
            ) from e

    def _shm_receive(self, peer: int, bufs: list[tuple[int, torch.Tensor]]) -> _ShmWork:
        """A work whose ``wait()`` copies a round's messages from ``peer``'s channel."""
        group = self.group
        slot = self._shm_slots[("recv", peer)]
        seq = group.shm_seq(peer, self.plan.rank, slot)
        watch = self._shm_watch(peer, main=False)
        parts = self._shm_parts(bufs)

        def run() -> None:
            deadline = time.monotonic() + group.config.timeout_s
            try:
                ch = group.channel(peer, self.plan.rank, slot, deadline=deadline, watch=watch)
                ch.get(seq, parts, watch, deadline)
            except TimeoutError as e:
                raise RuntimeError(f"{e} (receiving from rank {peer} through shared memory)") from e

        return _ShmWork(run)

    def _verify(self, p: _Pending, stats: ExecStats) -> None:
        """Check every message of a finished round against its sender's checksum."""
        import torch

        if not p.sums_in:
            return
        t0 = time.perf_counter()
        backend = self.group.backend
        got: dict[int, list[torch.Tensor]] = {}
        for buf, peer, _i, _msg, _staged in p.recv_ops:
            got.setdefault(peer, []).append(checksum(buf, backend))
        bad = []
        for peer, sent in p.sums_in.items():
            mine = torch.stack(got.get(peer, [])).to(sent.device) if got.get(peer) else sent[:0]
            if mine.shape != sent.shape:
                bad.append(f"rank {peer} sent checksums for {sent.shape[0]} messages, {mine.shape[0]} arrived")
                continue
            diff = (mine != sent).any(dim=1).nonzero().flatten().tolist()
            msgs = messages(p.round.recvs[peer], self.big_bytes)
            for i in diff:
                bad.append(
                    f"message {i} from rank {peer} to rank {self.plan.rank} ({_describe(msgs[i])}; "
                    f"{packed_size(msgs[i])} bytes) arrived corrupted (checksum {sent[i].tolist()} sent, "
                    f"{mine[i].tolist()} received)"
                )
        stats.checksum_seconds += time.perf_counter() - t0
        if bad:
            more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise RefitError(
                "transfer",
                {self.plan.rank: f"checksum mismatch in round {p.round.index}: " + "; ".join(bad[:3]) + more},
                version=self.refit,
            )

    def _wait(self, p: _Pending) -> None:
        """Wait for a round's messages, watching the store for an abort and the
        clock for the timeout (the wait itself runs in a helper thread)."""
        if not p.works:
            return
        group = self.group
        nccl = group.backend == "nccl"
        works = p.works
        peers = sorted({x[1] for x in p.recv_ops} | set(p.round.sends))

        def wait_all() -> None:
            for w in works:
                w.wait()
            if nccl:
                import torch

                torch.cuda.current_stream(self.device).synchronize()

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
                raise RefitError(
                    "transfer", {self.plan.rank: f"{text} (while exchanging with ranks {peers})"}, version=self.refit
                ) from e
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.25
                why = group.cancelled() if group.cancelled is not None else None
                if why:
                    raise RefitError("transfer", {self.plan.rank: f"cancelled: {why}"}, version=self.refit)
                msg = group.aborted(self.refit)
                if msg is not None:
                    raise RefitError("transfer", {self.plan.rank: f"stopped: {msg}"}, version=self.refit)
            if now >= deadline:
                raise RefitError(
                    "transfer",
                    {self.plan.rank: f"a round did not complete within {group.config.timeout_s}s"},
                    version=self.refit,
                )
