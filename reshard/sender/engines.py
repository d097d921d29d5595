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

import msgspec

from reshard.transport.group import GroupConfig

__all__ = ["EngineStats", "Engines", "push_beside"]

T = TypeVar("T")
R = TypeVar("R")


class EngineStats(msgspec.Struct, kw_only=True):
    """One engine worker's account of one refit, typed (``Sender.engine_stats``).

    Built from the ``stats`` of the worker's reply; a field an engine does
    not report keeps its default."""

    rank: int = -1
    """The worker's refit rank."""
    refit: int = 0
    bytes_received: int = 0
    """Bytes that reached the worker, in the dtypes they travel (the trainer's)."""
    bytes_landed: int = 0
    """Of those, the bytes written into the worker's tensors, in the worker's
    dtypes: ``kept_bytes`` after a refit, whatever was cast on arrival."""
    bytes_sent: int = 0
    bytes_copied: int = 0
    """Bytes the worker copied from itself (a slice it both holds and keeps)."""
    messages_received: int = 0
    rounds: int = 0
    peak_staging_bytes: int = 0
    kept_bytes: int = 0
    """Bytes of checkpoint tensors this worker keeps, in its own dtypes: what
    a refit must land (``bytes_landed``). ``bytes_received`` equals it when
    the trainer holds the same dtypes; a trainer in float32 into a bfloat16
    engine sends twice that (see ``casts``)."""
    casts: dict[str, int] = {}
    """Bytes received in one dtype and cast into another on arrival, by
    ``"src->dst"`` dtype pair (counted in the dtype they travel)."""
    plan_seconds: float = 0.0
    agree_seconds: float = 0.0
    transfer_seconds: float = msgspec.field(default=0.0, name="seconds")
    total_seconds: float = 0.0
    """The worker's refit session, from entering the refit to its end."""
    apply_seconds: float = 0.0
    """The engine's own apply (layerwise processing, repacking) of the new weights."""
    refit_seconds: float = 0.0
    """The whole refit on the worker: receive and apply."""
    two_phase: bool = False
    """Received into staging buffers while the engine served, then applied."""
    stage_seconds: float = 0.0
    staging_bytes: int = 0
    paused_seconds: float | None = None
    """How long the engine's generation was paused (``None``: not reported)."""
    engine_seconds: float | None = None
    """The driver's whole call, pause and resume included."""
    atomic: bool = False
    """A failure would have put the old weights back."""
    layers_processed: int = 0
    layers_skipped: int = 0
    """Delta refits into vLLM: layers left as they were (none of their weights changed)."""
    delta: bool = False
    """The worker runs delta refits (``GroupConfig.delta``)."""
    dense_bytes: int = 0
    """What a dense refit moves over the worker's links (sent plus received)."""
    wire_bytes: int = 0
    """What this refit moved over them: ``dense_bytes`` without deltas."""
    delta_peers: list[int] = []
    """Trainer ranks that sent this worker deltas."""
    dense_peers: dict[int, str] = {}
    """Trainer ranks that could have, that sent dense this refit, with why."""
    delta_elements: int = 0
    """Elements the deltas covered; ``delta_changed`` of them changed."""
    delta_changed: int = 0
    encodings: dict[str, int] = {}
    """Delta parts by encoding (``same``, ``dense``, ``sparse``, ``bitmask``)."""

    @classmethod
    def of(cls, reply: Any) -> EngineStats:
        """The stats of a worker's reply (an object with ``rank`` and ``stats``)."""
        stats = dict(getattr(reply, "stats", None) or {})
        stats.setdefault("rank", getattr(reply, "rank", -1))
        return msgspec.convert(stats, cls, strict=False)


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
