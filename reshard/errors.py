"""Exceptions shared by every layer.

One rule: an error that one rank detects reaches every rank as one of these,
naming the step, the tensor, the boxes and the ranks involved.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

__all__ = [
    "MetadataError",
    "MixedWeightsError",
    "PlanError",
    "Problem",
    "RefitError",
    "ReshardError",
    "ServerUnreachable",
    "span",
]


class ReshardError(RuntimeError):
    """Base class of every error reshard raises on purpose."""


class ServerUnreachable(ReshardError):
    """An engine server's HTTP endpoint could not be reached (connection
    refused, reset or timed out): the server is down, not failing. With an
    elastic group (``GroupConfig.min_replicas``) the drivers refit the
    others and name it; otherwise it fails the refit."""


class Problem(msgspec.Struct, frozen=True, kw_only=True):
    """One thing wrong with the inputs of a plan (wire type: ranks exchange these)."""

    kind: str
    """``unknown-tensor``, ``mismatch``, ``out-of-range``, ``overlap``,
    ``uncovered``, ``grid``, ``layout``, ``link`` (a transfer no link of
    the group can carry), ``device`` (a local tensor a refit cannot use
    where it is)."""
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


class MetadataError(ReshardError, ValueError):
    """Refit metadata read from the store is malformed, too large, of a newer
    wire version, or fails authentication (another job token)."""


class RefitError(ReshardError):
    """A refit step failed on one or more ranks; raised on every rank.

    ``errors`` maps rank to that rank's error text; ``step`` names the step
    (``join``, ``layout``, ``enter``, ``version``, ``plan``, ``transfer``,
    ``commit``). ``agreed``: every rank reported and raises this same error
    (a rejection before any byte moved, like a bad layout or a stale refit
    number); otherwise a rank failed or went missing.
    """

    def __init__(self, step: str, errors: dict[int, str], *, version: int | None = None, agreed: bool = False) -> None:
        self.step = step
        self.errors = dict(sorted(errors.items()))
        self.version = version
        self.agreed = agreed
        head = f"refit {'v' + str(version) + ' ' if version is not None else ''}failed at step {step!r}"
        # Ranks that report the same thing are listed once.
        by_message: dict[str, list[int]] = {}
        for r, msg in self.errors.items():
            by_message.setdefault(msg, []).append(r)
        lines = []
        for msg, ranks in by_message.items():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {span(ranks)}"
            text = msg.replace("\n", "\n    ")
            lines.append(f"  {who}: {text}")
        super().__init__(f"{head} on {len(self.errors)} rank(s):\n" + "\n".join(lines))


class MixedWeightsError(RefitError):
    """A refit failed after some of an engine's weights took their new values:
    the engine now mixes old and new weights until a refit succeeds. Drivers
    keep such a server paused (``paused``) rather than let it serve them."""

    paused: bool = False


def span(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    out = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)
