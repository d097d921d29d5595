"""Flat ranges as boxes (``reshard.plan.flat``), against a brute-force map of
every element's flat index: the ranges ZeRO-3 and FSDP1 ranks hold."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.plan.box import Box, chunk_range
from reshard.plan.flat import flat_range_boxes

SETTINGS = settings(max_examples=400, deadline=None)
LIMIT = 1 << 18
"""Largest tensor drawn (elements), so the brute-force map stays small."""


@st.composite
def shapes(draw) -> tuple[int, ...]:
    """1-4 dims of sizes 1..97 (a dim drawn later is capped so the tensor stays under LIMIT)."""
    ndim = draw(st.integers(1, 4))
    out: list[int] = []
    for _ in range(ndim):
        out.append(draw(st.integers(1, min(97, LIMIT // math.prod(out)))))
    return tuple(out)


@st.composite
def ranges(draw, shape: tuple[int, ...]) -> tuple[int, int]:
    n = math.prod(shape)
    row = math.prod(shape[1:])
    kind = draw(st.sampled_from(["partition", "any", "empty", "one_row", "many_rows"]))
    if kind == "partition":  # a ZeRO-3 partition: ceil(n / world) elements each, the last short or empty
        world = draw(st.integers(1, 8))
        return chunk_range(n, world, draw(st.integers(0, world - 1)))
    if kind == "empty":
        a = draw(st.integers(0, n))
        return a, a
    if kind == "one_row":
        r = draw(st.integers(0, shape[0] - 1))
        a = draw(st.integers(r * row, (r + 1) * row))
        return a, draw(st.integers(a, (r + 1) * row))
    if kind == "many_rows" and shape[0] > 2:
        a = draw(st.integers(0, row))
        return a, draw(st.integers(max(a, n - row), n))
    a = draw(st.integers(0, n))
    return a, draw(st.integers(a, n))


def _check(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[Box, int]]:
    boxes = flat_range_boxes(shape, start, stop)
    index = np.arange(math.prod(shape)).reshape(shape)  # every element's flat index
    pos = 0
    for box, at in boxes:
        assert box.within(shape) and not box.is_empty(), (box, shape)
        assert at == pos, f"box {box} starts at {at} in the range, after {pos} elements"
        got = index[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))].reshape(-1)
        # The box is exactly the next contiguous slice of the range, in row-major order.
        assert np.array_equal(got, np.arange(start + pos, start + pos + box.numel)), (shape, start, stop, box)
        pos += box.numel
    assert pos == stop - start
    assert len(boxes) <= max(1, 2 * len(shape) - 1), (shape, start, stop, boxes)
    return boxes


@SETTINGS
@given(st.data())
def test_flat_ranges_are_tiled_by_contiguous_boxes(data):
    shape = data.draw(shapes())
    start, stop = data.draw(ranges(shape))
    _check(shape, start, stop)


@SETTINGS
@given(shapes(), st.integers(1, 8))
def test_the_partitions_of_a_world_tile_the_tensor_once(shape, world):
    n = math.prod(shape)
    seen = np.zeros(shape, dtype=np.int64)
    for r in range(world):
        for box, _ in _check(shape, *chunk_range(n, world, r)):
            seen[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))] += 1
    assert (seen == 1).all()


@pytest.mark.parametrize(
    ("shape", "start", "stop", "want"),
    [
        ((3, 4), 2, 9, [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 1))]),
        ((3, 4), 4, 12, [((1, 0), (2, 4))]),
        ((3, 4), 5, 7, [((1, 1), (1, 2))]),
        (
            (2, 3, 4),
            5,
            23,
            [((0, 1, 1), (1, 1, 3)), ((0, 2, 0), (1, 1, 4)), ((1, 0, 0), (1, 2, 4)), ((1, 2, 0), (1, 1, 3))],
        ),
        ((7,), 4, 7, [((4,), (3,))]),
        ((5, 1), 1, 4, [((1, 0), (3, 1))]),
        ((3, 4), 6, 6, []),
    ],
)
def test_hand_worked_ranges(shape, start, stop, want):
    assert [(b.offsets, b.sizes) for b, _ in _check(shape, start, stop)] == want


def test_a_zero_dim_tensor_is_one_box_and_bad_ranges_are_refused():
    assert flat_range_boxes((), 0, 1) == [(Box((), ()), 0)]
    assert flat_range_boxes((), 1, 1) == []
    with pytest.raises(ValueError, match=r"flat range \[3, 13\) is not inside a tensor of shape \[3, 4\]"):
        flat_range_boxes((3, 4), 3, 13)
    with pytest.raises(ValueError, match="not inside"):
        flat_range_boxes((3, 4), 5, 4)
