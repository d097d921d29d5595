"""The engine side: a :class:`Receiver` inside every engine worker.

Engine-agnostic: it is given the worker's local tensors and the boxes of the
canonical tensors they hold (explicit :class:`PieceSpec` records or grid
rules). The vLLM and SGLang adapters learn those from the engines' own
loaders and wrap this class.

Call order (every engine worker, collectively with every trainer rank):

1. ``receiver = Receiver(tensors, pieces, config=..., rank=...)``.
2. ``receiver.pull(n)`` for refits ``n = 1, 2, ...``. Problems with the
   layouts raise :class:`reshard.RefitError` on every rank before any byte
   moves; otherwise every byte this worker keeps lands in its tensors.
3. ``receiver.close()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from reshard.plan.layout import Layout
from reshard.plan.specs import GridSpec, PieceSpec, build_layout
from reshard.transport.group import GroupConfig
from reshard.transport.locals import LocalTensors, Tensors, local_tensors
from reshard.transport.session import DEFAULT_BUDGET_BYTES, RefitSession, RefitStats
from reshard.transport.stats import EngineStats

if TYPE_CHECKING:
    import torch

__all__ = ["EngineReceiver", "LocalTensors", "Receiver", "Tensors"]


class Receiver:
    """Pulls one engine worker's slices in refits (see the module docstring)."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | LocalTensors,
        pieces: Sequence[PieceSpec] = (),
        *,
        config: GroupConfig,
        rank: int,
        grids: Sequence[GridSpec] = (),
        layout: Layout | None = None,
        device: torch.device | str | None = None,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        round_bytes: int | None = None,
        progress: bool | None = None,
    ) -> None:
        """``tensors``: local name -> tensor, as a mapping or as
        :class:`LocalTensors` (tensors with a lifecycle of their own: ones
        that materialize on demand are checked when a refit first touches
        them; ones only reshard writes are a delta's base, digested after a
        refit). ``rank``: this worker's refit rank (``config.num_sources +
        engine worker index``). Local tensors are checked against the layout
        at every pull (shape, dtype, contiguity), where a problem reaches
        every rank before any byte moves."""
        if rank < config.num_sources:
            raise ValueError(f"refit rank {rank} is a source rank; engine workers start at {config.num_sources}")
        if layout is None:
            layout = build_layout(rank, pieces, grids)
        tensors = local_tensors(tensors)
        if device is None:
            device = tensors.device or "cpu"
        self.rank = rank
        self.layout = layout
        self.session = RefitSession(
            config,
            rank=rank,
            layout=layout,
            tensors=tensors,
            device=device,
            budget_bytes=budget_bytes,
            round_bytes=round_bytes,
            progress=progress,
        )

    @property
    def config(self) -> GroupConfig:
        """The refit group's configuration, as this worker joins it."""
        return self.session.config

    @property
    def last_refit(self) -> int:
        """The last refit that succeeded on this worker (0: none yet)."""
        return self.session.last_refit

    def connect(self) -> None:
        """Join the refit group now (``pull`` does it on first use)."""
        self.session.connect()

    def set_layout(self, layout: Layout, tensors: Mapping[str, torch.Tensor] | LocalTensors | None = None) -> bool:
        """Keep ``layout`` (into ``tensors``, when given) from the next pull
        on; returns whether it changed (then every rank replans)."""
        changed = self.session.set_layout(layout, tensors)
        if changed:
            self.layout = layout
        return changed

    def pull(
        self, refit: int, *, method: str = "reshard", into: Mapping[str, torch.Tensor] | LocalTensors | None = None
    ) -> RefitStats:
        """Receive refit number ``refit``. ``into``: the tensors to write
        into for this refit, with their lifecycle (:class:`LocalTensors`:
        begun once every rank agreed on the plan, told of every round that
        landed, finished before every rank agrees on the outcome; a mapping
        has none); default: the tensors given at construction. ``method``:
        ``reshard``, or ``gather_broadcast`` (the baseline)."""
        if method == "gather_broadcast":
            return self.session.refit_baseline(refit, into=into)
        if method != "reshard":
            raise ValueError(f"unknown refit method {method!r}; use 'reshard' or 'gather_broadcast'")
        return self.session.refit(refit, into=into)

    def forget_base(self, why: str) -> None:
        """With ``GroupConfig.delta``: this worker's tensors no longer hold
        what it received last (its engine's apply failed, or something else
        wrote them), so its next refit is dense, with ``why`` as the reason.
        A base that changed unnoticed is caught anyway, by its checksum."""
        self.session.delta.void(why)

    def close(self) -> None:
        self.session.close()


@runtime_checkable
class EngineReceiver(Protocol):
    """What an engine's receiver (one per worker: vLLM's, SGLang's) offers
    the worker that drives it; adapter slots (LoRA) have their own."""

    mixed: bool
    """The last refit failed after some weights took their new values."""

    @property
    def kept_bytes(self) -> int:
        """Bytes of checkpoint tensors this worker keeps, in its own dtypes."""
        ...

    def pull(self, refit: int, *, method: str = "reshard") -> EngineStats:
        """Receive refit ``refit`` into the live engine (collective with every
        refit rank); this worker's account of it."""
        ...

    def close(self) -> None: ...
