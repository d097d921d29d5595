"""Exceptions shared by every layer.

One rule: an error that one rank detects reaches every rank as one of these,
naming the step, the tensor, the boxes and the ranks involved.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

__all__ = ["PlanError", "Problem", "RefitError", "ReshardError"]


class ReshardError(RuntimeError):
    """Base class of every error reshard raises on purpose."""


class Problem(msgspec.Struct, frozen=True, kw_only=True):
    """One thing wrong with the inputs of a plan (wire type: ranks exchange these)."""

    kind: str
    """``unknown-tensor``, ``mismatch``, ``out-of-range``, ``overlap``,
    ``uncovered``, ``grid``, ``layout``."""
    message: str
    tensor: str = ""
    ranks: tuple[int, ...] = ()

    def __str__(self) -> str:
        return self.message


class PlanError(ReshardError, ValueError):
    """The layouts cannot be planned; nothing was sent."""

    def __init__(self, problems: Sequence[Problem], *, limit: int = 20) -> None:
        self.problems = list(problems)
        lines = [f"  - {p}" for p in self.problems[:limit]]
        more = len(self.problems) - limit
        if more > 0:
            lines.append(f"  ... and {more} more")
        super().__init__(f"refit plan rejected ({len(self.problems)} problem(s)):\n" + "\n".join(lines))


class RefitError(ReshardError):
    """A refit step failed on one or more ranks; raised on every rank.

    ``errors`` maps rank to that rank's error text; ``step`` names the step
    (``join``, ``layout``, ``plan``, ``transfer``, ``commit``).
    """

    def __init__(self, step: str, errors: dict[int, str], *, version: int | None = None) -> None:
        self.step = step
        self.errors = dict(sorted(errors.items()))
        self.version = version
        head = f"refit {'v' + str(version) + ' ' if version is not None else ''}failed at step {step!r}"
        body = "\n".join(f"  rank {r}: {msg}" for r, msg in self.errors.items())
        super().__init__(f"{head} on {len(self.errors)} rank(s):\n{body}")
