"""Flat ranges of a tensor as boxes.

Trainers that shard a tensor by its flattened elements (DeepSpeed ZeRO-3,
FSDP1's flat parameters) hold a row-major flat range ``[start, stop)`` of
it, not a box. That range is a union of boxes, each a contiguous slice of
the range: a partial first row (itself a range inside the row), a block of
whole rows, a partial last row. Recursing on the partial rows gives at most
``2 * ndim - 1`` boxes (one for a 0-dim or 1-dim tensor), in flat order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from reshard.plan.box import Box

__all__ = ["flat_range_boxes"]


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[Box, int]]:
    """The boxes that tile the row-major flat range ``[start, stop)`` of a
    tensor of ``shape``, in flat order, each with the position of its first
    element in the range (``0`` for the first box). Box ``i`` covers the
    elements ``start + pos_i`` up to ``start + pos_i + numel_i`` exactly, so
    it is a contiguous slice of a 1-dim tensor that holds the range.

    ``flat_range_boxes((3, 4), 2, 9)`` is ``[([0:1, 2:4], 0), ([1:2, 0:4], 2),
    ([2:3, 0:1], 6)]``. An empty range gives ``[]``."""
    shape = tuple(int(n) for n in shape)
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(
            f"flat range [{start}, {stop}) is not inside a tensor of shape {list(shape)} ({numel} elements)"
        )
    out: list[tuple[Box, int]] = []
    if start == stop:
        return out
    if not shape:
        return [(Box((), ()), 0)]
    _boxes(shape, start, stop, (), start, out)
    return out


def _boxes(shape: tuple[int, ...], lo: int, hi: int, prefix: tuple[int, ...], base: int, out: list) -> None:
    """Append the boxes of ``[lo, hi)`` (non-empty) of the trailing dims
    ``shape``, under fixed leading indices ``prefix``; ``base`` is the flat
    index of the whole range's first element, relative to ``prefix``'s block."""
    ones = (1,) * len(prefix)
    if len(shape) == 1:
        out.append((Box((*prefix, lo), (*ones, hi - lo)), lo - base))
        return
    row = math.prod(shape[1:])
    rest = shape[1:]
    first, last = lo // row, (hi - 1) // row
    if first == last:  # inside one row
        off = first * row
        _boxes(rest, lo - off, hi - off, (*prefix, first), base - off, out)
        return
    full_lo = -(-lo // row)  # first whole row
    full_hi = hi // row  # end of the whole rows
    if lo % row:
        off = first * row
        _boxes(rest, lo - off, row, (*prefix, first), base - off, out)
    if full_hi > full_lo:
        zeros = (0,) * len(rest)
        out.append((Box((*prefix, full_lo, *zeros), (*ones, full_hi - full_lo, *rest)), full_lo * row - base))
    if hi % row:
        off = full_hi * row
        _boxes(rest, 0, hi - off, (*prefix, full_hi), base - off, out)
