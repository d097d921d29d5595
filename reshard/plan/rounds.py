"""Rounds: the round of every row block of every tensor, the same on every rank."""

from __future__ import annotations

import math
from collections.abc import Sequence

from reshard.plan.box import Box
from reshard.plan.layout import TensorMeta

__all__ = ["DEFAULT_ROUND_BYTES", "RoundTable"]

DEFAULT_ROUND_BYTES = 128 << 20
"""Weighted bytes per round unless a rank asks for less (see :class:`RoundTable`)."""


class RoundTable:
    """Round of every row block of every tensor; identical on every rank.

    A row block weighs its bytes times the tensor's *share*: the largest
    number of its elements any one rank receives plus the largest number any
    one rank sends from, over its element count (1 when a rank holds or needs
    the whole tensor). A round holds at most ``round_bytes`` of weight, so no
    rank stages more than that per round for its own pieces, while tensors
    cut into many pieces share rounds instead of taking one each.
    """

    def __init__(self, metas: Sequence[TensorMeta], round_bytes: int, shares: Sequence[int] | None = None) -> None:
        if round_bytes <= 0:
            raise ValueError(f"round_bytes must be positive, got {round_bytes}")
        self.round_bytes = round_bytes
        self.rows_per_block: list[int] = []
        self.block_rounds: list[list[int]] = []
        rnd, fill = 0, 0
        for i, meta in enumerate(metas):
            rows = meta.shape[0] if meta.shape else 1
            numel = math.prod(meta.shape)
            share = numel if shares is None else min(max(shares[i], 1), numel)
            row_bytes = meta.nbytes // rows if rows else 0
            # Integer arithmetic only: every rank must cut identically.
            row_weight = -(-row_bytes * share // numel) if numel else 0
            rpb = max(1, round_bytes // row_weight) if row_weight else max(rows, 1)
            nblocks = max(1, -(-rows // rpb))
            rounds = []
            for b in range(nblocks):
                ub = min(rpb, rows - b * rpb) * row_weight
                if fill and fill + ub > round_bytes:
                    rnd += 1
                    fill = 0
                fill += ub
                rounds.append(rnd)
            self.rows_per_block.append(rpb)
            self.block_rounds.append(rounds)
        self.num_rounds = rnd + 1 if metas else 0

    def split(self, ordinal: int, box: Box) -> list[tuple[int, Box]]:
        """``box`` cut at row-block boundaries, with the round of each part."""
        rounds = self.block_rounds[ordinal]
        if box.ndim == 0 or len(rounds) == 1:
            return [(rounds[0], box)]
        rpb = self.rows_per_block[ordinal]
        lo, hi = box.offsets[0], box.offsets[0] + box.sizes[0]
        out = []
        for b in range(lo // rpb, (hi - 1) // rpb + 1):
            a, z = max(lo, b * rpb), min(hi, (b + 1) * rpb)
            out.append((rounds[b], Box((a, *box.offsets[1:]), (z - a, *box.sizes[1:]))))
        return out
