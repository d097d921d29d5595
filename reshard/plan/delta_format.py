"""The delta wire format: the encodings of a part, their sections and sizes.

One place for every number of the format, in integer arithmetic with no
torch and no numpy: the encoders (:mod:`reshard.transport.encoding`, numpy
and torch; :mod:`reshard.transport.encoding_jit`, compiled) write and read
parts by these offsets, a receiver sizes its peers' parts from their
headers with :func:`part_size`, and the cost model
(:mod:`reshard.costmodel.delta`) predicts sizes from the same formulas.

A *part* is one transfer's values in its destination dtype (the *wire
dtype*), ``n`` elements of ``e`` bytes, ``k`` of them changed. Its bytes:

========== ===================================================== =========================
encoding   sections, in order (each starts at a multiple of 8)    size
========== ===================================================== =========================
``same``   none                                                  0
``dense``  the ``n`` values                                      ``pad(n e)``
``sparse`` the ``k`` changed values; one int32 count per block   ``pad(k e) + pad(4 ceil(n / 65536))
           of 65536 elements; per change its uint16 offset in    + pad(2 k)``
           its block
``bitmask`` the ``k`` changed values; one bit per element         ``pad(k e) + pad(ceil(n / 8))``
           (little-endian bit order in each byte)
========== ===================================================== =========================

A change costs its value and 2 bytes in ``sparse`` (a flat 32-bit index
would cost 4). Ahead of its payload a sender sends a header per transfer,
``(encoding, k)`` as two int64 (:data:`HEADER_BYTES`), so the receiver
knows every part's size before it arrives, whatever the sender chose.

The choice (:func:`choose`): the smallest encoding, unless it would not pay
in time (:class:`Speeds`, measured by the sender): a part whose changes
cost more to gather and patch than its saved bytes take on the wire goes
``dense``. A ``dense`` part of at least the executor's big-message size is a
message of its own, sent from the sender's snapshot and received in place;
smaller parts travel back to back in the round's payload
(:func:`own_message`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from reshard.plan.items import Transfer
from reshard.plan.layout import dtype_size

__all__ = [
    "ALIGN",
    "BITMASK",
    "BLOCK",
    "BLOCK_SHIFT",
    "DENSE",
    "HEADER_BYTES",
    "NAMES",
    "SAME",
    "SPARSE",
    "Sections",
    "Speeds",
    "blocks",
    "choose",
    "dense_from",
    "dense_size",
    "mask_bytes",
    "own_message",
    "pad",
    "part_size",
    "pays",
    "sections",
    "wire_dtype",
    "wire_ratio",
]

SAME, DENSE, SPARSE, BITMASK = 0, 1, 2, 3
NAMES = ("same", "dense", "sparse", "bitmask")
BLOCK_SHIFT = 16
BLOCK = 1 << BLOCK_SHIFT
"""Elements per block of the ``sparse`` encoding (positions are 16-bit offsets in it)."""
ALIGN = 8
"""Every section of a part starts at a multiple of this many bytes."""
HEADER_BYTES = 16
"""A delta header's bytes per transfer: its encoding and changed count (two int64)."""


def pad(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def blocks(n: int) -> int:
    """Blocks of the ``sparse`` encoding for ``n`` elements."""
    return -(-n // BLOCK)


def mask_bytes(n: int) -> int:
    """Bytes of the ``bitmask`` encoding's bits for ``n`` elements."""
    return -(-n // 8)


class Sections(NamedTuple):
    """Where each section of a part starts, and the part's size. ``values``:
    the changed values (``dense``: every value) at offset 0; ``counts``: the
    ``sparse`` block counts; ``positions``: the ``sparse`` offsets or the
    ``bitmask`` bits (0 where the encoding has no such section)."""

    values: int
    counts: int
    positions: int
    size: int


def sections(enc: int, n: int, k: int, itemsize: int) -> Sections:
    """The sections of a part of ``n`` elements of ``itemsize`` bytes, ``k`` of them changed."""
    if enc == SAME:
        return Sections(0, 0, 0, 0)
    if enc == DENSE:
        return Sections(n * itemsize, 0, 0, pad(n * itemsize))
    values = pad(k * itemsize)
    if enc == SPARSE:
        at = values + pad(4 * blocks(n))
        return Sections(k * itemsize, values, at, at + pad(2 * k))
    if enc == BITMASK:
        return Sections(k * itemsize, 0, values, values + pad(mask_bytes(n)))
    raise ValueError(f"unknown delta encoding {enc}")


def part_size(enc: int, n: int, k: int, itemsize: int) -> int:
    """Bytes of a part of ``n`` elements of ``itemsize`` bytes, ``k`` of them changed."""
    return sections(enc, n, k, itemsize).size


class Speeds(NamedTuple):
    """What a delta costs in time beside a pass over the data (which a dense
    part kept in the snapshot takes too): measured by the sender
    (:mod:`reshard.transport.delta_speed` says how)."""

    wire_s_per_byte: float
    """Seconds a byte costs on this rank's links (from its last dense refit)."""
    change_s: float
    """Seconds one changed element costs: the sender gathering it, the receiver patching it."""


def pays(n: int, k: int, itemsize: int, speeds: Speeds | None) -> bool:
    """Whether the smallest exact encoding of a part (``k`` of ``n`` elements
    of ``itemsize`` bytes changed) takes less time than sending it dense:
    its bytes on the wire plus ``k`` changes gathered and patched, against
    the dense bytes on the wire. ``speeds=None``: bytes alone decide."""
    best = _smallest(n, k, itemsize)
    if best in (SAME, DENSE) or speeds is None:
        return best != DENSE
    wire = speeds.wire_s_per_byte
    delta = part_size(best, n, k, itemsize) * wire + k * speeds.change_s
    return delta < part_size(DENSE, n, k, itemsize) * wire


def choose(n: int, k: int, itemsize: int, speeds: Speeds | None = None) -> int:
    """The encoding a sender writes: ``same`` when nothing changed, else the
    smallest exact one (ties: ``dense``, then ``sparse``), or ``dense`` when
    that does not pay in time (:func:`pays`). As ``k`` grows the choice only
    moves from ``same`` to ``sparse``, ``bitmask`` and ``dense``."""
    best = _smallest(n, k, itemsize)
    if best in (SAME, DENSE) or pays(n, k, itemsize, speeds):
        return best
    return DENSE


def _smallest(n: int, k: int, itemsize: int) -> int:
    if k == 0:
        return SAME
    best, size = DENSE, part_size(DENSE, n, k, itemsize)
    for enc in (SPARSE, BITMASK):
        s = part_size(enc, n, k, itemsize)
        if s < size:
            best, size = enc, s
    return best


@lru_cache(maxsize=4096)
def dense_from(n: int, itemsize: int, speeds: Speeds | None = None, encs: tuple[int, ...] = (DENSE,)) -> int:
    """The smallest count of changed elements (of ``n``) whose choice is one
    of ``encs`` (``n + 1``: none is); by bisection, the choice being monotone
    in the count. An encoder records changes only as the encoding that
    count will end in needs (and none once it goes ``dense``).

    Kept per arguments: the bisection calls :func:`choose` about 50 times
    (0.2 ms), an encoder asks twice per part, and a refit's parts share a
    few sizes and one :class:`Speeds` (a model's layers repeat)."""
    lo, hi = 1, n + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if choose(n, mid, itemsize, speeds) in encs:
            hi = mid
        else:
            lo = mid + 1
    return lo


def own_message(enc: int, n: int, itemsize: int, big_bytes: int) -> bool:
    """Whether a part travels as a message of its own (a ``dense`` part of at
    least ``big_bytes``: sent from the snapshot, received in place where its
    destination is contiguous) rather than inside the round's payload."""
    return enc == DENSE and n * itemsize >= big_bytes


def wire_dtype(t: Transfer) -> str:
    """The dtype a delta of ``t`` travels in: its destination's (a trainer in
    float32 compares what the engine would get after the cast)."""
    return t.dst.dtype or t.dtype


def dense_size(t: Transfer) -> int:
    """The largest part ``t`` can be (``dense``, in the wire dtype)."""
    return part_size(DENSE, t.box.numel, 0, dtype_size(wire_dtype(t)))


def wire_ratio(changed: float, itemsize: int) -> float:
    """The smallest encoding's bytes over dense bytes for a large part whose
    elements of ``itemsize`` bytes changed with probability ``changed``: the
    sizes above per element, as ``n`` grows (padding vanishes)."""
    if not 0.0 <= changed <= 1.0:
        raise ValueError(f"the changed fraction must be between 0 and 1, got {changed}")
    if changed == 0.0:
        return 0.0
    e = float(itemsize)
    sparse = changed * (e + 2) / e + 4 / (BLOCK * e)
    bitmask = changed + 1 / (8 * e)
    return min(1.0, sparse, bitmask)
