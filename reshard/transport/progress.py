"""A one-line progress bar for long refits, on a terminal.

A refit that is still running after ``after_s`` seconds draws, on one rank
(refit rank 0 by default, when its stderr is a terminal), a line it rewrites
after each round at most every ``every_s`` seconds: the bytes this rank moved
so far (sent, received and copied) of its plan's total, the rate and the
rounds. Short refits draw nothing; the line ends when the refit does.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from reshard.plan.items import RankPlan

__all__ = ["Progress", "wants_progress"]

_WIDTH = 24


def wants_progress(progress: bool | None, rank: int) -> bool:
    """``progress``: ``None`` (refit rank 0 draws it when its stderr is a terminal), or forced on or off."""
    if progress is not None:
        return progress
    return rank == 0 and sys.stderr is not None and sys.stderr.isatty()


class Progress:
    """Draws the progress of one refit of one rank; call it after each round
    (``after_round``), then :meth:`close`."""

    def __init__(
        self,
        refit: int,
        plan: RankPlan,
        *,
        stream: TextIO | None = None,
        after_s: float = 1.0,
        every_s: float = 0.2,
    ) -> None:
        self.refit = refit
        self.rank = plan.rank
        self.stream = stream if stream is not None else sys.stderr
        self.after_s = after_s
        self.every_s = every_s
        self.round_bytes = {
            r.index: sum(t.nbytes for ts in (*r.sends.values(), *r.recvs.values()) for t in ts)
            + sum(t.nbytes for t in r.copies)
            for r in plan.rounds
        }
        self.total_bytes = sum(self.round_bytes.values())
        self.total_rounds = len(plan.rounds)
        self.done_bytes = 0
        self.done_rounds = 0
        self.t0 = time.perf_counter()
        self._drawn_at = 0.0
        self.drawn = 0
        """Lines drawn so far."""

    def __call__(self, round_index: int) -> None:
        self.done_bytes += self.round_bytes.get(round_index, 0)
        self.done_rounds += 1
        now = time.perf_counter()
        last = self.done_rounds >= self.total_rounds
        if now - self.t0 < self.after_s or (now - self._drawn_at < self.every_s and not last):
            return
        self._drawn_at = now
        self.stream.write("\r" + self.line(now - self.t0))
        self.stream.flush()
        self.drawn += 1

    def line(self, seconds: float) -> str:
        total = self.total_bytes
        frac = self.done_bytes / total if total else self.done_rounds / max(self.total_rounds, 1)
        bar = "#" * int(frac * _WIDTH)
        rate = self.done_bytes / max(seconds, 1e-9) / 1e9
        return (
            f"reshard refit {self.refit} rank {self.rank} [{bar:<{_WIDTH}}] {frac:4.0%} "
            f"{self.done_bytes / 1e9:.2f}/{total / 1e9:.2f} GB {rate:.2f} GB/s "
            f"round {self.done_rounds}/{self.total_rounds}"
        )

    def close(self) -> None:
        """End the line (if one was drawn)."""
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
