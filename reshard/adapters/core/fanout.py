"""Several engines driven as one: each refit runs on every engine at once.

A driver (:class:`reshard.adapters.vllm.driver.VllmEngines`,
:class:`reshard.adapters.sglang.SglangEngines`) implements the per-engine
sequence (pause, pull, flush caches, resume unless the weights are mixed);
:func:`fan_out` runs it for every engine concurrently and raises one error,
a :class:`~reshard.errors.MixedWeightsError` first: an engine left paused
with mixed weights is what an operator must hear about.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from reshard.errors import MixedWeightsError

__all__ = ["fan_out"]

E = TypeVar("E")
R = TypeVar("R")


def fan_out(engines: Sequence[E], fn: Callable[[E], R], *, name: str = "reshard-engine") -> list[R]:
    """``[fn(e) for e in engines]``, run concurrently (one thread per engine)."""
    results: list[R | None] = [None] * len(engines)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = fn(engines[i])
        except BaseException as e:  # re-raised below, mixed weights first
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        mixed = [e for e in errors if isinstance(e, MixedWeightsError)]
        raise (mixed or errors)[0]
    return results  # type: ignore[return-value]
