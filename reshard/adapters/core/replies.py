"""What an engine worker answers a driver: one typed reply (msgspec).

vLLM's worker extension returns it as a plain dict (``collective_rpc`` over
HTTP carries JSON), SGLang's loader posts it to the refit store as JSON;
drivers turn the replies of every worker into one error with
:func:`raise_for_replies`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from reshard.errors import MixedWeightsError, RefitError, ReshardError

__all__ = ["WorkerReply", "failure", "raise_for_replies"]


class WorkerReply(msgspec.Struct, kw_only=True):
    """One worker's outcome of one driver call."""

    ok: bool
    rank: int = -1
    """The worker's refit rank (-1: not known yet)."""
    error: str = ""
    type: str = ""
    """The exception's class name."""
    step: str | None = None
    """The refit step that failed (:class:`reshard.RefitError`)."""
    errors: dict[int, str] | None = None
    """Per refit rank, when the error is a :class:`reshard.RefitError`."""
    mixed: bool = False
    """A failed refit left this worker's weights mixing old and new."""
    stats: dict[str, Any] = msgspec.field(default_factory=dict)
    id: str = ""
    """The command it answers (SGLang)."""
    tp_rank: int = -1
    version: int = 1

    def to_builtins(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def parse(cls, value: Any) -> WorkerReply:
        if isinstance(value, WorkerReply):
            return value
        if isinstance(value, str | bytes):
            return msgspec.json.decode(value, type=cls)
        # JSON (vLLM's HTTP server) turns the int keys of ``errors`` into strings.
        return msgspec.convert(value, cls, strict=False)


def failure(e: BaseException, *, rank: int = -1, mixed: bool = False, **fields: Any) -> WorkerReply:
    """The reply for a worker that raised ``e``."""
    errors = getattr(e, "errors", None)
    return WorkerReply(
        ok=False,
        rank=rank,
        error=str(e),
        type=type(e).__name__,
        step=getattr(e, "step", None),
        errors={int(k): str(v) for k, v in errors.items()} if errors else None,
        mixed=mixed or isinstance(e, MixedWeightsError),
        **fields,
    )


def raise_for_replies(replies: Sequence[WorkerReply], what: str, *, version: int | None = None) -> None:
    """Raise one error for every worker that failed: :class:`MixedWeightsError`
    if any worker's weights now mix old and new, else the :class:`RefitError`
    the workers agree on, else a :class:`ReshardError` naming each failure."""
    bad = [r for r in replies if not r.ok]
    if not bad:
        return
    step = next((r.step for r in bad if r.step), None)
    errors: dict[int, str] = {}
    for r in bad:
        errors.update(r.errors or {r.rank: r.error})
    if any(r.mixed for r in bad):
        raise MixedWeightsError(step or what, errors, version=version)
    if step:
        raise RefitError(step, errors, version=version)
    raise ReshardError(f"{what} failed on {len(bad)} worker(s): " + "; ".join(r.error for r in bad))
