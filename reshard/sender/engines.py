"""Engines a trainer drives during a refit: the :class:`Engines` protocol.

A trainer rank that is given engines (``Sender.push(n, engines=...)``) tells
them to pull refit ``n`` while it pushes, so one call does the whole update:
pause generation, pull, flush caches, resume. The vLLM adapter provides
:class:`reshard.adapters.vllm.driver.VllmEngines` (offline ``LLM`` objects or
``vllm serve`` URLs); the SGLang adapter provides its own.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from reshard.transport.group import GroupConfig

__all__ = ["Engines"]


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
