"""What an engine worker answers a driver: one typed reply (msgspec).

vLLM's worker extension returns it as a plain dict (``collective_rpc`` over
HTTP carries JSON), SGLang's loader posts it to the refit store as JSON;
drivers turn the replies of every worker into one error with
:func:`raise_for_replies`. Where the only channel back is an exception's
text (vLLM's weight-transfer API: an HTTP error body, or an executor's
error), the replies ride in its last line (:func:`with_replies`) and the
driver turns them back into the same typed error (:func:`raise_from_text`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

import msgspec

from reshard.errors import MixedWeightsError, RefitError, ReshardError

__all__ = ["WorkerReply", "failure", "raise_for_replies", "raise_from_text", "with_replies"]

_MARK = "reshard-replies: "
"""Starts the line of an error's text that carries its workers' replies (JSON)."""


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


def with_replies(text: str, replies: Sequence[WorkerReply]) -> str:
    """``text`` with ``replies`` in its last line, for a channel that carries
    only an exception's text."""
    return f"{text}\n{_MARK}{msgspec.json.encode(list(replies)).decode()}"


def raise_from_text(text: str, what: str, *, version: int | None = None) -> None:
    """If ``text`` carries workers' replies (:func:`with_replies`), raise the
    error they make (:func:`raise_for_replies`: typed, a
    :class:`MixedWeightsError` where weights now mix); otherwise return.
    ``text``: an error's text as it reached a driver, an exception's message
    (vLLM's executor quotes its worker's) or an HTTP error body (JSON)."""
    if _MARK not in text:
        return
    if text.lstrip().startswith("{"):
        with contextlib.suppress(ValueError):
            text = next((t for t in _strings(json.loads(text)) if _MARK in t), text)
    start = text.rindex(_MARK) + len(_MARK)
    try:
        # The replies end where their JSON does: a wrapper's words may follow.
        raw, _ = json.JSONDecoder().raw_decode(text, start)
        replies = msgspec.convert(raw, list[WorkerReply], strict=False)
    except (ValueError, msgspec.ValidationError):
        return
    raise_for_replies(replies, what, version=version)


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []
