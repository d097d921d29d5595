"""A refit's destination inside vLLM's layerwise reload: the
:class:`~reshard.transport.locals.LocalTensors` a worker pulls into.

1. ``begin``: every rank agreed on the plan; the worker enters vLLM's reload
   lifecycle (:meth:`LayerwiseUpdate.begin`), so nothing changed before.
2. ``resolve``: a layer's parameter, materialized (and zeroed where the
   checkpoint leaves padding) the first time a round writes into it; or,
   with delta refits, the staging buffer it is kept in (the base the next
   delta patches), from which layers are loaded.
3. ``landed``: the layers whose last round landed are processed (repacked,
   quantized) on the applier's thread while later rounds arrive; with
   deltas, only those whose buffers changed are loaded and processed. Not
   in atomic mode: nothing is processed before every rank reported a
   complete transfer.
4. ``finish``: the applier drains; its error fails the refit on every rank.

With a speculative drafter, ``update`` is a
:class:`~reshard.adapters.vllm.drafter.WithDrafter`: the target's and the
drafter's layerwise reloads side by side, names under ``drafter:`` the
drafter's (or the drafter's alone, in vLLM's draft session).

Used as a context manager around the pull: leaving it on an error stops
the applier after the layer in progress, so the worker can put back what
was not processed (:meth:`LayerwiseUpdate.abort`).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from reshard.adapters.vllm.applier import Applier
from reshard.adapters.vllm.drafter import WithDrafter
from reshard.adapters.vllm.update import LayerwiseUpdate
from reshard.transport.locals import LocalTensors

if TYPE_CHECKING:
    import torch

    from reshard.plan.items import RankPlan

__all__ = ["LayerwiseRefit"]


class LayerwiseRefit(LocalTensors):
    """One refit of one vLLM worker (see the module docstring). ``buffers``:
    with delta refits, the staging buffers (the base); ``None``: bytes land
    in the layers' parameters, materialized on demand. ``pool``: the thread
    layers are processed on (kept by the worker from one refit to the next);
    ``idle``: it yields to the receive (on a CPU, see :class:`Applier`)."""

    def __init__(
        self,
        update: LayerwiseUpdate | WithDrafter,
        pool: cf.ThreadPoolExecutor,
        *,
        idle: bool,
        buffers: Mapping[str, torch.Tensor] | None = None,
        atomic: bool = False,
    ) -> None:
        self.update = update
        self.buffers = buffers
        self.atomic = atomic
        self.lazy = buffers is None
        # The buffers are the engine's base, written by reshard alone.
        self.private = buffers is not None
        if buffers is None:
            self.applier = Applier(update.after_round, pool, idle=idle)
        else:
            # (With a drafter, WithDrafter splits the buffers between the two reloads.)
            self.applier = Applier(lambda i, changed: update.load_released(buffers, changed, i), pool, idle=idle)

    def __enter__(self) -> LayerwiseRefit:
        self.applier.__enter__()
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.applier.__exit__(kind, value, tb)

    def begin(self, plan: RankPlan | None) -> None:
        self.update.begin(plan)

    def resolve(self, name: str) -> torch.Tensor:
        if self.buffers is not None:
            return self.buffers[name]
        return self.update.param(name)

    def landed(self, index: int, changed: frozenset[str] | None) -> None:
        if self.atomic:
            return
        if self.buffers is None:
            self.applier.released(index)
        else:
            # What changed so far, taken on the executor's thread.
            self.applier.released(index, changed if changed is not None else frozenset(self.buffers))

    def finish(self) -> None:
        self.applier.drain()

    def __iter__(self) -> Iterator[str]:
        return iter(self.buffers if self.buffers is not None else self.update.layer_of)

    def __len__(self) -> int:
        return len(self.buffers if self.buffers is not None else self.update.layer_of)
