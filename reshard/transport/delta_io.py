"""One round of a delta refit, for the executor: a sender encodes its
transfers to each delta peer (per transfer: the part
:mod:`reshard.transport.encoding` picks with the sender's speeds, in the
format of :mod:`reshard.plan.delta_format`) into one payload, the parts
back to back, except ``dense`` parts of at least ``big_bytes``, which are
messages of their own sent from the snapshot
(:func:`~reshard.plan.delta_format.own_message`), and keeps its snapshot
up to date; a receiver reads the peers' headers, sizes their payloads and
messages, and patches the parts onto its tensors.

The executor owns the process group, the staging arena and the waits; these
functions own what the bytes mean.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from reshard.plan.delta_format import (
    DENSE,
    NAMES,
    SAME,
    Speeds,
    choose,
    dense_size,
    own_message,
    pad,
    part_size,
    wire_dtype,
)
from reshard.plan.items import Round, Transfer
from reshard.plan.layout import dtype_size
from reshard.transport.delta import Snapshots, snapshot_key
from reshard.transport.encoding import apply_part, encode_part
from reshard.transport.messages import DeltaPayload, StagingKey, local_view
from reshard.transport.stats import ExecStats

if TYPE_CHECKING:
    import torch

__all__ = [
    "Payload",
    "apply_payload",
    "count_later",
    "encode_round",
    "header_parts",
    "predict_dense",
    "snapshot_dense",
]

Payload = tuple["torch.Tensor", list[tuple[int, int]], list["torch.Tensor"]]
"""A peer's payload of one round, its header rows ``(encoding, changed)``,
and the bytes of its parts that are messages of their own (in order)."""

TensorOf = Callable[[Transfer, str], "torch.Tensor"]
"""The executor's local tensor of a transfer's ``src`` or ``dst`` side (checked)."""


def encode_round(
    rnd: Round,
    peers: frozenset[int],
    snaps: Snapshots,
    arena: torch.Tensor,
    offsets: dict[StagingKey, int],
    tensor_of: TensorOf,
    device: torch.device,
    stats: ExecStats,
    *,
    speeds: Speeds | None = None,
    big_bytes: int,
) -> tuple[dict[int, Payload], set[tuple], list]:
    """Encode this round's transfers to every delta peer in ``peers`` into its
    payload (in the arena, at ``offsets[DeltaPayload(peer, sending=True)]``) and its own
    messages; a box sent to several peers is compared once. Brings the
    snapshot entries it compared up to date. Returns the payloads by peer,
    the snapshot keys encoded, and the parts whose count and snapshot copy
    wait until their sends are posted (:func:`count_later`)."""
    import torch

    out: dict[int, Payload] = {}
    later: list[tuple[Transfer, torch.Tensor, torch.Tensor, bool]] = []
    done: dict[tuple, tuple[int, int, torch.Tensor]] = {}
    t0 = time.perf_counter()
    gather = 0.0
    for peer in sorted(p for p in rnd.sends if p in peers):
        transfers = rnd.sends[peer]
        buf = arena.narrow(0, offsets[DeltaPayload(peer, sending=True)], sum(dense_size(t) for t in transfers))
        pos = 0
        rows = []
        own: list[torch.Tensor] = []
        for t in transfers:
            key = snapshot_key(t)
            hit = done.get(key)
            fresh = hit is None
            if hit is None:
                predicted = predict_dense(t, snaps.last_changed(t), speeds)
                tg = time.perf_counter()
                new = snaps.new_values(t, tensor_of(t, "src"))
                gather += time.perf_counter() - tg
                snap = snaps.entry(t, device)
                e = dtype_size(wire_dtype(t))
                if predicted and own_message(DENSE, t.box.numel, e, big_bytes):
                    # A message of its own: its header says 0 (not counted before
                    # it is sent). Counted only every RECOUNT-th refit, to see
                    # whether it still goes dense; otherwise the snapshot is
                    # only copied. A contiguous run of the source is sent from
                    # it at once and copied once posted, while on the wire.
                    count = snaps.recount(t, RECOUNT)
                    if _in_place(new, tensor_of(t, "src")):
                        hit = done[key] = (DENSE, 0, new.view(torch.uint8))
                        later.append((t, new, snap, count))
                    else:
                        if count:
                            _, k, _ = encode_part(new, snap, buf.narrow(0, pos, 0), dense=True)
                            _counted(snaps, t, k, stats)
                        else:
                            snap.view(new.shape).copy_(new)
                        hit = done[key] = (DENSE, 0, snap.view(torch.uint8))
                    stats.encodings["dense"] = stats.encodings.get("dense", 0) + 1
                    rows.append((DENSE, 0))
                    own.append(hit[2])
                    continue
                if predicted and not snaps.recount(t, RECOUNT):
                    # Not its refit to be counted (as above): the snapshot is
                    # only copied, and the part goes dense from it.
                    snap.view(new.shape).copy_(new)
                    hit = done[key] = (DENSE, 0, snap.view(torch.uint8))
                else:
                    enc, k, n = encode_part(new, snap, buf.narrow(0, pos, dense_size(t)), speeds, dense=predicted)
                    snaps.encoded(t, k)
                    # A dense part's bytes are the snapshot's, now that it holds the new values.
                    hit = done[key] = (enc, k, snap.view(torch.uint8) if enc == DENSE else buf.narrow(0, pos, n))
                    stats.delta_elements += t.box.numel
                    stats.delta_changed += k
            enc, k, part = hit
            stats.encodings[NAMES[enc]] = stats.encodings.get(NAMES[enc], 0) + 1
            rows.append((enc, k))
            if own_message(enc, t.box.numel, dtype_size(wire_dtype(t)), big_bytes):
                own.append(part)
                continue
            if enc == DENSE or not fresh:
                buf.narrow(0, pos, part.numel()).copy_(part)
            pos += pad(part.numel())
        out[peer] = (buf.narrow(0, 0, pos), rows, own)
    stats.delta_seconds += time.perf_counter() - t0
    # "encode" is the whole of it; "gather" the part spent casting or gathering
    # new values that are not one contiguous run of the wire dtype.
    stats.timed("encode", time.perf_counter() - t0)
    stats.timed("gather", gather)
    return out, set(done), later


def _in_place(new: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``new`` is a contiguous run of the source tensor itself (not a
    cast or gathered copy), so it can be sent as it is."""
    if new.dim() != 1 or not new.is_contiguous():
        return False
    start, end = src.data_ptr(), src.data_ptr() + src.numel() * src.element_size()
    return start <= new.data_ptr() < end


RECOUNT = 4
"""A part predicted dense has its changes counted every this many refits
(the others only copy the snapshot): what tells the sender that a part
pays as a delta again."""


def _counted(snaps: Snapshots, t: Transfer, k: int, stats: ExecStats) -> None:
    snaps.encoded(t, k)
    stats.delta_elements += t.box.numel
    stats.delta_changed += k


def count_later(later: list, snaps: Snapshots, stats: ExecStats) -> None:
    """The parts :func:`encode_round` sent dense straight from the source:
    bring the snapshot up to date (counting their changes, when it is their
    refit to be counted), after their sends were posted (the source does
    not change during a refit)."""
    import torch

    if not later:
        return
    t0 = time.perf_counter()
    none = torch.empty(0, dtype=torch.uint8)  # host: empty, never written (a count only)
    for t, new, snap, count in later:
        if count:
            _, k, _ = encode_part(new, snap, none, dense=True)
            _counted(snaps, t, k, stats)
        else:
            snap.copy_(new)
    stats.delta_seconds += time.perf_counter() - t0
    stats.timed("encode", time.perf_counter() - t0)


def predict_dense(t: Transfer, last: float | None, speeds: Speeds | None) -> bool:
    """Whether ``t``'s part goes dense without looking for its changes: with
    the share of changes its box had when last counted it would not pay (a
    training step changes about as many as the one before). The sender then
    only copies, and counts every :data:`RECOUNT`-th refit; the count is the
    next prediction. (With half that share, parts between once and twice
    the share where deltas stop paying were encoded in full every refit and
    then sent dense anyway: 1.1-1.3x a dense refit at 6-8% changed.)"""
    if last is None or speeds is None:
        return False
    n = t.box.numel
    return choose(n, math.ceil(last * n), dtype_size(wire_dtype(t)), speeds) == DENSE


def snapshot_dense(
    rnd: Round,
    peers: frozenset[int],
    snaps: Snapshots,
    encoded: set[tuple],
    tensor_of: TensorOf,
    device: torch.device,
) -> None:
    """Bring the snapshot entries of this round's boxes for the peers that
    move dense (``peers`` are those that move deltas), and that the snapshot
    keeps, up to date: the next refit may be a delta for them. Runs after
    the round's deltas were encoded (``encoded``), so no delta is taken
    against an entry updated first."""
    done = set(encoded)
    for peer in sorted(rnd.sends):
        if peer in peers or peer not in snaps.admitted:
            continue
        for t in rnd.sends[peer]:
            key = snapshot_key(t)
            if t.kind != "pull" or key in done:
                continue
            done.add(key)
            entry = snaps.entry(t, device)
            entry.view(t.box.sizes).copy_(local_view(tensor_of(t, "src"), t.src, t.box))


def header_parts(transfers: list[Transfer], header: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(encoding, changed, bytes)`` of each part a peer's header announces
    for ``transfers``; ``ValueError`` naming the transfer for a header that
    cannot be its sender's (checked before any receive is posted for it)."""
    parts = []
    for t, (enc, k) in zip(transfers, header, strict=True):
        n = t.box.numel
        try:
            # A dense part may say 0: sent before its changes were counted.
            if not 0 <= k <= n or (enc == SAME and k) or (enc not in (SAME, DENSE) and not k):
                raise ValueError(f"{k} of {n} elements changed")
            size = part_size(enc, n, k, dtype_size(wire_dtype(t)))
        except ValueError as e:
            raise ValueError(f"its header does not fit {t.tensor!r}{t.box} (encoding {enc}, {k} changed): {e}") from e
        parts.append((enc, k, size))
    return parts


def apply_payload(
    transfers: list[Transfer],
    parts: list[tuple[int, int, int]],
    buf: torch.Tensor | None,
    tensor_of: TensorOf,
    touched: set[str],
    stats: ExecStats,
    *,
    own: Mapping[int, torch.Tensor | None] | None = None,
) -> None:
    """Patch a payload's parts onto this rank's tensors (its base); the
    destination tensors that changed join ``touched``. ``own``: the parts
    (by transfer index) that were messages of their own, landed in place
    (``None``) or in the staging given, copied now. ``ValueError`` naming
    the transfer for a malformed part."""
    t0 = time.perf_counter()
    pos = 0
    own = own or {}
    for i, (t, (enc, k, n)) in enumerate(zip(transfers, parts, strict=True)):
        stats.encodings[NAMES[enc]] = stats.encodings.get(NAMES[enc], 0) + 1
        stats.delta_elements += t.box.numel
        stats.delta_changed += k
        if enc == SAME:
            continue
        touched.add(t.dst.local)
        if i in own:
            staged = own[i]
            if staged is not None:
                dst = local_view(tensor_of(t, "dst"), t.dst, t.box)
                dst.copy_(staged.view(dst.dtype).view(dst.shape))
            continue
        assert buf is not None
        dst = local_view(tensor_of(t, "dst"), t.dst, t.box)
        try:
            apply_part(enc, k, buf.narrow(0, pos, n), dst)
        except ValueError as e:
            raise ValueError(f"the part for {t.tensor!r}{t.box} is malformed: {e}") from e
        pos += n
    stats.delta_seconds += time.perf_counter() - t0
    stats.timed("patch", time.perf_counter() - t0)
