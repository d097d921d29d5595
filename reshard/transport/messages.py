"""How a round's transfers become messages, and the staging they need.

Pure arithmetic on a :class:`~reshard.plan.items.RankPlan`, the same on
both sides of every pair, so that a receive never gets fewer or more bytes
than it posts: per round and peer, transfers of at least ``big_bytes``
travel alone, received straight into their destination when its slice is
contiguous (and of the wire dtype) and sent straight from their source when
that is contiguous (zero copy); smaller ones to one peer are packed into one
message, each slice aligned so that it can be viewed as its dtype. Staging
is laid out per round (:func:`round_staging`) and bounded in advance
(:func:`staging_need`); :func:`link_summary` digests every pair's messages
for the plan step, where two plans that differ on the wire are refused.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from reshard.errors import RefitError
from reshard.plan.box import Box
from reshard.plan.delta_format import dense_size
from reshard.plan.items import RankPlan, Round, Transfer
from reshard.plan.layout import Slot, dtype_size

if TYPE_CHECKING:
    import torch

    from reshard.transport import wire

__all__ = [
    "BIG_BYTES",
    "DEFAULT_BUDGET_BYTES",
    "DeltaPayload",
    "Packed",
    "Slice",
    "StagingKey",
    "Unpacked",
    "align",
    "check_links",
    "describe",
    "is_contiguous_slice",
    "landed",
    "link_problem",
    "link_summary",
    "local_view",
    "messages",
    "packed_size",
    "receives_in_place",
    "round_staging",
    "slice_key",
    "staging_bound",
    "staging_need",
    "torch_dtype",
]

BIG_BYTES = 1 << 20
"""Transfers at least this large travel as their own message."""

DEFAULT_BUDGET_BYTES = 256 << 20
"""Staging a rank may use for a refit unless it says otherwise."""

_ALIGN = 64


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


def local_view(tensor: torch.Tensor, slot: Slot, box: Box) -> torch.Tensor:
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


def receives_in_place(t: Transfer) -> bool:
    """Can ``t`` be received straight into its destination (one contiguous run of the wire dtype)?"""
    return t.dst.dtype in ("", t.dtype) and is_contiguous_slice(t.dst, t.box)


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def is_contiguous_slice(slot: Slot, box: Box) -> bool:
    """Is the local region of ``box`` one contiguous run (row-major), in global dim order?"""
    if not slot.is_plain():
        return False
    _, sizes = slot.local_box(box)
    # After the first dim with more than one element, every dim must be whole.
    seen_partial = False
    for s, n in zip(sizes, slot.local_shape, strict=True):
        if seen_partial and s != n:
            return False
        if s > 1:
            seen_partial = True
    return True


def landed(t: Transfer) -> int:
    """Bytes ``t`` writes into its destination, in the destination's dtype."""
    if not t.dst.dtype or t.dst.dtype == t.dtype:
        return t.nbytes
    return t.box.numel * dtype_size(t.dst.dtype)


def describe(msg: list[Transfer], limit: int = 3) -> str:
    """The first transfers of a message, for errors."""
    text = ", ".join(f"{t.tensor!r}{t.box}" for t in msg[:limit])
    return text + (f" and {len(msg) - limit} more" if len(msg) > limit else "")


def staging_need(
    plan: RankPlan,
    big_bytes: int = BIG_BYTES,
    *,
    pipelined: bool = True,
    delta_peers: frozenset[int] = frozenset(),
    off_device: frozenset[str] = frozenset(),
) -> int:
    """Staging bytes ``plan`` needs: the busiest round's, twice when rounds are
    pipelined (two rounds in flight use alternate halves of the arena).
    ``delta_peers``: peers whose messages are sparse deltas (each round's
    payload staged whole, at most the dense size in the destination dtype;
    see :mod:`reshard.transport.delta`). ``off_device``: local tensors not on
    the group's device, whose messages are always staged (see
    :func:`round_staging`)."""
    need = 0
    for rnd in plan.rounds:
        need = max(need, round_staging(rnd, big_bytes, delta_peers, off_device)[0])
    return 2 * need if pipelined and len(plan.rounds) > 1 else need


def staging_bound(
    plan: RankPlan, big_bytes: int, maybe_delta: frozenset[int], off_device: frozenset[str] = frozenset()
) -> int:
    """An upper bound of :func:`staging_need` for any choice of which of
    ``maybe_delta`` move deltas (known only once the plan is agreed): per
    round, each such peer's larger staging, dense or delta (slices sent to
    several peers counted for each)."""
    if not maybe_delta:
        return staging_need(plan, big_bytes, off_device=off_device)
    need = 0
    for rnd in plan.rounds:
        total = round_staging(rnd, big_bytes, maybe_delta, off_device)[0]
        for side, by_peer in ((0, rnd.sends), (1, rnd.recvs)):
            for peer, ts in by_peer.items():
                if peer not in maybe_delta:
                    continue
                one = Round(rnd.index, sends={peer: ts}) if side == 0 else Round(rnd.index, recvs={peer: ts})
                dense = round_staging(one, big_bytes, off_device=off_device)[0]
                total += max(0, dense - align(sum(dense_size(t) for t in ts)))
        need = max(need, total)
    return 2 * need if len(plan.rounds) > 1 else need


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


@dataclass(frozen=True, slots=True)
class Packed:
    """Staging of message ``index`` to ``peer``, packed before it is sent."""

    peer: int
    index: int


@dataclass(frozen=True, slots=True)
class Unpacked:
    """Staging of message ``index`` from ``peer``, unpacked once it arrived."""

    peer: int
    index: int


@dataclass(frozen=True, slots=True)
class Slice:
    """Staging of one big non-contiguous (or off-device) source slice, packed
    once for every peer that gets it."""

    kind: str
    local: str
    offset: tuple[int, ...]
    box: Box


@dataclass(frozen=True, slots=True)
class DeltaPayload:
    """Staging of a delta peer's payload of a round (``sending``: this
    rank's to it, else its to this rank)."""

    peer: int
    sending: bool


StagingKey = Packed | Unpacked | Slice | DeltaPayload
"""Where a round's staging goes (:func:`round_staging`): one key type per
use, so that two uses never share a key by accident."""


def round_staging(
    rnd: Round, big_bytes: int, delta_peers: frozenset[int] = frozenset(), off_device: frozenset[str] = frozenset()
) -> tuple[int, dict[StagingKey, int]]:
    """(bytes, layout) of the staging a round needs; layout maps keys to offsets.

    A delta peer's messages of the round are one payload (:class:`DeltaPayload`)
    of at most the dense size of its transfers in their destination dtype (see
    :func:`reshard.plan.delta_format.dense_size`). A big message from or
    into a local tensor of ``off_device`` (one not on the group's device:
    host memory in an NCCL group, say) is staged like a non-contiguous one:
    the process group only ever sees the arena, which is on its device.
    Which messages are staged is this rank's own business; the messages
    themselves, cut by :func:`messages`, are the same on both sides."""
    offsets: dict[StagingKey, int] = {}
    total = 0

    def take(key: StagingKey, n: int) -> None:
        nonlocal total
        if key not in offsets:
            offsets[key] = total
            total += align(n)

    for peer in sorted(rnd.sends):
        if peer in delta_peers:
            take(DeltaPayload(peer, True), sum(dense_size(t) for t in rnd.sends[peer]))
            continue
        for i, msg in enumerate(messages(rnd.sends[peer], big_bytes)):
            if len(msg) > 1 or msg[0].nbytes < big_bytes:
                take(Packed(peer, i), packed_size(msg))
            elif not is_contiguous_slice(msg[0].src, msg[0].box) or msg[0].src.local in off_device:
                t = msg[0]
                # Pack once, send to every peer that gets the same slice.
                take(slice_key(t), t.nbytes)
    for peer in sorted(rnd.recvs):
        if peer in delta_peers:
            take(DeltaPayload(peer, False), sum(dense_size(t) for t in rnd.recvs[peer]))
            continue
        for i, msg in enumerate(messages(rnd.recvs[peer], big_bytes)):
            if (
                len(msg) > 1
                or msg[0].nbytes < big_bytes
                or not receives_in_place(msg[0])
                or msg[0].dst.local in off_device
            ):
                take(Unpacked(peer, i), packed_size(msg))
    return total, offsets


def slice_key(t: Transfer) -> Slice:
    """The staging of a big source slice ``t`` reads (the same for every peer it goes to)."""
    return Slice(t.kind, t.src.local, t.src.offset, t.box)


def check_links(statuses: list[wire.Status], refit: int) -> None:
    """Every message a plan sends is one its receiver's plan expects, with the
    same size (checked by every rank on the same statuses, before any byte
    moves: a receive never gets fewer or more bytes than it posted)."""
    bad = _link_errors(statuses, None)
    if bad:
        raise RefitError("plan", bad, version=refit, agreed=True)


def link_problem(statuses: list[wire.Status], refit: int, rank: int) -> str:
    """What :func:`check_links` finds wrong between ``rank`` and its peers,
    from their statuses alone (``""``: nothing)."""
    return next(iter(_link_errors(statuses, rank).values()), "")


def _link_errors(statuses: list[wire.Status], rank: int | None) -> dict[int, str]:
    """Per rank, a pair of plans that disagree (``rank``: only its pairs)."""
    by_rank = {s.rank: s for s in statuses}
    bad: dict[int, str] = {}
    for s in statuses:
        for peer in sorted(set(s.sends) | {r for r, o in by_rank.items() if s.rank in o.recvs}):
            if rank is not None and rank not in (s.rank, peer):
                continue
            mine = s.sends.get(peer)
            other = by_rank.get(peer)
            theirs = other.recvs.get(s.rank) if other is not None else None
            if mine == theirs:
                continue
            sent = f"{mine[0]} message(s), {mine[1]} bytes" if mine else "nothing"
            expected = f"{theirs[0]} message(s), {theirs[1]} bytes" if theirs else "nothing"
            if mine and theirs and mine[:2] == theirs[:2]:
                expected += " of other slices"
            text = (
                f"rank {s.rank}'s plan sends rank {peer} {sent}, rank {peer}'s plan expects {expected}: the ranks "
                "planned from different inputs (nothing was sent)"
            )
            bad.setdefault(s.rank, text)
            bad.setdefault(peer, text)
    return bad
