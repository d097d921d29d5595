"""Engines a trainer drives during a refit: the :class:`Engines` protocol.

A trainer rank that is given engines (``Sender.push(n, engines=...)``) tells
them to pull refit ``n`` while it pushes, so one call does the whole update:
pause generation, pull, flush caches, resume. The vLLM adapter provides
:class:`reshard.adapters.vllm.driver.VllmEngines` (offline ``LLM`` objects or
``vllm serve`` URLs); the SGLang adapter provides its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from reshard.transport.group import GroupConfig
from reshard.transport.stats import EngineStats

__all__ = ["EngineStats", "Engines", "push_beside"]

T = TypeVar("T")
R = TypeVar("R")


@runtime_checkable
class Engines(Protocol):
    """What ``Sender.push(engines=...)`` needs from a set of inference engines."""

    def init(self, config: GroupConfig) -> None:
        """Make every engine worker ready to join ``config``'s refit group
        (learn its layout, pick its refit rank). Called once, before the first
        refit; raises if the engines' workers do not add up to
        ``config.num_destinations``."""
        ...

    def refit(self, refit: int, *, method: str = "reshard") -> list[Any]:
        """Pull refit ``refit`` into every engine (blocking until done), with
        generation paused and caches flushed; returns every worker's reply
        (:class:`reshard.adapters.core.replies.WorkerReply`: ``ok``, ``rank``,
        ``stats``). Raises :class:`reshard.RefitError` if any worker failed
        (:class:`reshard.errors.MixedWeightsError` if weights now mix old and
        new)."""
        ...


def push_beside(
    push: Callable[[], T],
    drive: Callable[[threading.Event], R],
    *,
    cancel: Callable[[str | None], None],
) -> tuple[T, R]:
    """Run ``drive(pushed)`` (the engines' side of a refit: pause, pull,
    commit, flush) in a thread while ``push()`` (this rank's side) runs here;
    ``pushed`` is set once the push returned or failed (a two-phase commit
    waits for it). Returns both results.

    If the drive fails, ``cancel(reason)`` makes this rank's push fail at
    once: engines that failed before they joined would leave it waiting for
    them until the timeout (``cancel(None)`` clears a reason left from a
    previous refit first). Errors: the drive's, chained from the push's when
    both failed (the engines' account names every worker's error); else the
    push's."""
    results: list[R] = []
    errors: list[BaseException] = []
    pushed = threading.Event()

    def run() -> None:
        try:
            results.append(drive(pushed))
        except BaseException as e:  # re-raised below
            errors.append(e)
            cancel(f"the engines failed: {e}")

    cancel(None)
    driver = threading.Thread(target=run, name="reshard-drive-engines", daemon=True)
    driver.start()
    try:
        out = push()
    except BaseException as push_error:
        pushed.set()
        driver.join()
        if errors:
            raise errors[0] from push_error
        raise
    pushed.set()
    driver.join()
    if errors:
        raise errors[0]
    return out, results[0]
