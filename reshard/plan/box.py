"""Boxes: rectangular regions of a global tensor, and the splitting rules.

This module is the whole overlap math of the planner. It imports nothing but
msgspec, so every rule here can be tested on hand-worked tables.

Splitting rule (the one DTensor ``Shard(dim)`` and FSDP2 use): a dim of size
``n`` cut into ``k`` parts gives part ``i`` the range
``[min(i*b, n), min((i+1)*b, n))`` with block ``b = ceil(n / k)``; trailing
parts may be short or empty (``torch.chunk`` semantics, padded to ``k``
parts). Some engines use a larger block than ``ceil(n / k)``: vLLM's
vocab-parallel embedding cuts the vocabulary padded to a multiple of 64, so
the last rank holds fewer real rows. Those rules pass ``block`` explicitly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

__all__ = [
    "Box",
    "chunk_block",
    "chunk_range",
    "chunks_overlapping",
    "full_box",
    "merge_boxes",
]


class Box(msgspec.Struct, frozen=True, array_like=True):
    """A rectangular region ``[offsets, offsets + sizes)`` of a tensor.

    ``Box((0, 4), (2, 4))`` is rows 0-1, columns 4-7. Zero-dim tensors have
    ``Box((), ())`` (one element). Sizes may be zero (an empty box).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.offsets)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes, strict=True))

    def is_empty(self) -> bool:
        return any(s == 0 for s in self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The common region, or ``None`` when it is empty."""
        offs = []
        sizes = []
        for a, sa, b, sb in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True):
            lo = a if a > b else b
            hi_a = a + sa
            hi_b = b + sb
            hi = hi_a if hi_a < hi_b else hi_b
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offs), tuple(sizes))

    def contains(self, other: Box) -> bool:
        return all(
            a <= b and b + sb <= a + sa
            for a, sa, b, sb in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True)
        )

    def within(self, shape: Sequence[int]) -> bool:
        """True when the box lies inside a tensor of ``shape``."""
        return len(shape) == self.ndim and all(
            o >= 0 and s >= 0 and o + s <= n for o, s, n in zip(self.offsets, self.sizes, shape, strict=True)
        )

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(a - b for a, b in zip(self.offsets, outer.offsets, strict=True)), self.sizes)

    def __str__(self) -> str:
        if not self.offsets:
            return "[]"
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes, strict=True)) + "]"


def full_box(shape: Sequence[int]) -> Box:
    return Box(tuple(0 for _ in shape), tuple(shape))


def chunk_block(n: int, k: int) -> int:
    """Block size of ``torch.chunk`` cutting ``n`` into ``k`` parts."""
    if k <= 0:
        raise ValueError(f"cannot cut a dim into {k} parts")
    return -(-n // k) if n else 0


def chunk_range(n: int, k: int, i: int, block: int = 0) -> tuple[int, int]:
    """``(start, stop)`` of part ``i`` of ``k`` of a dim of size ``n``.

    ``block`` 0 means ``ceil(n / k)`` (``torch.chunk``); a larger block gives
    the padded rules of vocab-parallel layers. Parts past the end are empty.
    """
    b = block or chunk_block(n, k)
    start = min(i * b, n)
    return start, min(start + b, n)


def chunks_overlapping(n: int, k: int, lo: int, hi: int, block: int = 0) -> range:
    """Indices of the parts that overlap ``[lo, hi)`` (non-empty parts only)."""
    b = block or chunk_block(n, k)
    if b == 0 or hi <= lo:
        return range(0)
    first = lo // b
    last = min((hi - 1) // b, k - 1)
    return range(first, last + 1)


def merge_boxes(boxes: Iterable[Box]) -> list[Box]:
    """Merge boxes that tile larger boxes, dim by dim (last dim first).

    Two boxes merge along dim ``d`` when they agree on every other dim and
    touch along ``d``. The result covers exactly the same elements; it is a
    greedy decomposition, not a minimal one.
    """
    current = sorted(set(boxes), key=lambda b: (b.offsets, b.sizes))
    if not current:
        return []
    ndim = current[0].ndim
    while True:
        before = len(current)
        for d in reversed(range(ndim)):
            current = _merge_along(current, d)
        if len(current) == before:
            return current


def _merge_along(boxes: list[Box], d: int) -> list[Box]:
    groups: dict[tuple, list[Box]] = {}
    for b in boxes:
        key = (b.offsets[:d] + b.offsets[d + 1 :], b.sizes[:d] + b.sizes[d + 1 :])
        groups.setdefault(key, []).append(b)
    merged: list[Box] = []
    for group in groups.values():
        group.sort(key=lambda b: b.offsets[d])
        run = group[0]
        for b in group[1:]:
            if run.offsets[d] + run.sizes[d] == b.offsets[d]:
                sizes = list(run.sizes)
                sizes[d] += b.sizes[d]
                run = Box(run.offsets, tuple(sizes))
            else:
                merged.append(run)
                run = b
        merged.append(run)
    return sorted(merged, key=lambda b: (b.offsets, b.sizes))
