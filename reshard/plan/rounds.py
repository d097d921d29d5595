"""Rounds: the round of every row block of every tensor, the same on every rank."""

from __future__ import annotations

import math
from collections.abc import Sequence

from reshard.plan.box import Box
from reshard.plan.layout import TensorMeta

__all__ = ["DEFAULT_ROUND_BYTES", "SHARE_UNITS", "RoundTable"]

DEFAULT_ROUND_BYTES = 128 << 20
"""Weighted bytes per round unless a rank asks for less (see :class:`RoundTable`)."""

SHARE_UNITS = 1 << 16
"""A tensor's share is counted in this many parts of it (rounded up)."""


class RoundTable:
    """Round of every row block of every tensor; identical on every rank.

    A row block weighs its bytes times the tensor's *share*: the largest
    number of its elements any one rank receives plus the largest number any
    one rank sends from, over its element count (1 when a rank holds or needs
    the whole tensor). A round holds at most ``round_bytes`` of weight, so no
    rank stages more than that per round for its own pieces, while tensors
    cut into many pieces share rounds instead of taking one each.

    Weights are integers in units of ``1 / SHARE_UNITS`` byte: the share is
    rounded up to a multiple of ``1 / SHARE_UNITS`` of the tensor, and no
    other rounding happens, so a layout whose tensors are all ``k`` times
    larger, planned with ``k`` times the budget, gets the same rounds.

    Blocks are packed greedily in tensor order: a block joins the open round
    when it fits, else opens the next. Only a tensor's first block can join
    a round opened before it: a block holds ``rpb = round_bytes // w`` rows
    of weight ``w`` (at least one), so a full block and one more row weigh
    more than a round, and every later block opens its own round. The table
    therefore keeps three integers per tensor (rows per block, blocks, first
    round), built in time linear in the number of tensors, whatever their
    bytes or the round budget.
    """

    def __init__(self, metas: Sequence[TensorMeta], round_bytes: int, shares: Sequence[int] | None = None) -> None:
        if round_bytes <= 0:
            raise ValueError(f"round_bytes must be positive, got {round_bytes}")
        self.round_bytes = round_bytes
        self.rows_per_block: list[int] = []
        self.num_blocks: list[int] = []
        self.first_round: list[int] = []
        budget = round_bytes * SHARE_UNITS
        rows_per_block, num_blocks, first_round = self.rows_per_block, self.num_blocks, self.first_round
        # Tensors of one shape, dtype and share cut alike (a model has a few
        # hundred such kinds for tens of thousands of tensors): work out the
        # cut once per kind; only the packing runs per tensor.
        kinds: dict[tuple, tuple[int, int, int, int]] = {}
        rnd, fill = 0, 0
        for i, meta in enumerate(metas):
            key = (meta.shape, meta.dtype, None if shares is None else shares[i])
            kind = kinds.get(key)
            if kind is None:
                rows = meta.shape[0] if meta.shape else 1
                numel = math.prod(meta.shape)
                share = numel if shares is None else min(max(shares[i], 1), numel)
                row_bytes = meta.nbytes // rows if rows else 0
                # Integer arithmetic only: every rank must cut identically.
                row_weight = row_bytes * -(-share * SHARE_UNITS // numel) if numel else 0
                rpb = max(1, budget // row_weight) if row_weight else max(rows, 1)
                nblocks = max(1, -(-rows // rpb))
                first = min(rpb, rows) * row_weight
                last = (rows - (nblocks - 1) * rpb) * row_weight
                kind = kinds[key] = (rpb, nblocks, first, last)
            rpb, nblocks, first, last = kind
            if fill and fill + first > budget:
                rnd += 1
                fill = 0
            first_round.append(rnd)
            if nblocks == 1:
                fill += first
            else:
                rnd += nblocks - 1
                fill = last
            rows_per_block.append(rpb)
            num_blocks.append(nblocks)
        self.num_rounds = rnd + 1 if metas else 0

    def single(self, ordinal: int) -> int | None:
        """The round of the whole tensor when it is one block, else ``None``."""
        return self.first_round[ordinal] if self.num_blocks[ordinal] == 1 else None

    def block_round(self, ordinal: int, block: int) -> int:
        """The round of row block ``block`` of the tensor at ``ordinal``."""
        if not 0 <= block < self.num_blocks[ordinal]:
            raise IndexError(f"tensor {ordinal} has {self.num_blocks[ordinal]} row blocks, not block {block}")
        return self.first_round[ordinal] + block

    def split(self, ordinal: int, box: Box) -> list[tuple[int, Box]]:
        """``box`` cut at row-block boundaries, with the round of each part."""
        first = self.first_round[ordinal]
        if box.ndim == 0 or self.num_blocks[ordinal] == 1:
            return [(first, box)]
        rpb = self.rows_per_block[ordinal]
        lo, hi = box.offsets[0], box.offsets[0] + box.sizes[0]
        out = []
        for b in range(lo // rpb, (hi - 1) // rpb + 1):
            a, z = max(lo, b * rpb), min(hi, (b + 1) * rpb)
            out.append((first + b, Box((a, *box.offsets[1:]), (z - a, *box.sizes[1:]))))
        return out
