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

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from reshard.plan.items import RankPlan
from reshard.plan.layout import Layout
from reshard.plan.specs import GridSpec, PieceSpec, build_layout
from reshard.transport.group import GroupConfig
from reshard.transport.session import DEFAULT_BUDGET_BYTES, RefitSession, RefitStats

if TYPE_CHECKING:
    import torch

__all__ = ["Receiver"]


class Receiver:
    """Pulls one engine worker's slices in refits (see the module docstring)."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        pieces: Sequence[PieceSpec] = (),
        *,
        config: GroupConfig,
        rank: int,
        grids: Sequence[GridSpec] = (),
        layout: Layout | None = None,
        device: torch.device | str | None = None,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        round_bytes: int | None = None,
        check_tensors: bool = True,
        progress: bool | None = None,
        private_base: bool = False,
    ) -> None:
        """``tensors``: local name -> tensor (a mapping may materialize
        tensors lazily; then pass ``check_tensors=False``, and each tensor is
        checked when a refit first touches it). ``rank``: this worker's refit
        rank (``config.num_sources + engine worker index``). Local tensors
        are checked against the layout at every pull (shape, dtype,
        contiguity), where a problem reaches every rank before any byte moves.
        ``private_base`` (``GroupConfig.delta``): only reshard writes the
        tensors refits land in (an engine's staging buffers, not its live
        weights), so their checksums are taken once a refit succeeded, in a
        thread, instead of at the next plan step."""
        if rank < config.num_sources:
            raise ValueError(f"refit rank {rank} is a source rank; engine workers start at {config.num_sources}")
        if layout is None:
            layout = build_layout(rank, pieces, grids)
        if device is None:
            first = next(iter(tensors.values()), None) if check_tensors else None
            device = first.device if first is not None else "cpu"
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
            lazy=not check_tensors,
            progress=progress,
        )
        self.session.delta.private = private_base

    def connect(self) -> None:
        """Join the refit group now (``pull`` does it on first use)."""
        self.session.connect()

    def set_layout(self, layout: Layout, tensors: Mapping[str, torch.Tensor] | None = None) -> bool:
        """Keep ``layout`` (into ``tensors``, when given) from the next pull
        on; returns whether it changed (then every rank replans)."""
        changed = self.session.set_layout(layout, tensors)
        if changed:
            self.layout = layout
        return changed

    def pull(
        self,
        refit: int,
        *,
        method: str = "reshard",
        destinations: Mapping[str, torch.Tensor] | None = None,
        after_round: Callable[[int], None] | None = None,
        before_transfer: Callable[[RankPlan], None] | None = None,
        touched: set[str] | None = None,
        after_transfer: Callable[[], None] | None = None,
        refuse: str | None = None,
    ) -> RefitStats:
        """Receive refit number ``refit``. ``destinations`` overrides the
        tensors to write into for this refit (checked like the tensors given
        at construction, unless it says ``reshard_lazy = True``: then each is
        checked when first touched); ``before_transfer(plan)`` runs
        once every rank agreed to go ahead, before the first byte moves;
        ``after_round(i)`` after each round of this rank. ``method``:
        ``reshard``, or ``gather_broadcast`` (the baseline). ``touched``
        (``GroupConfig.delta``): a set the local tensors whose values changed
        join as rounds complete, so ``after_round`` can act on them.
        ``after_transfer()`` runs once this worker's last round completed,
        before every rank agrees on the outcome (its failure fails the refit
        on every rank). ``refuse``: why this worker cannot take the refit (an
        engine out of room for it): every rank raises
        :class:`reshard.RefitError` with it at step ``enter``, before any byte
        moves, and the next refit runs on the same group."""
        if method == "gather_broadcast":
            return self.session.refit_baseline(refit, destinations=destinations, refuse=refuse)
        if method != "reshard":
            raise ValueError(f"unknown refit method {method!r}; use 'reshard' or 'gather_broadcast'")
        return self.session.refit(
            refit,
            destinations=destinations,
            after_round=after_round,
            before_transfer=before_transfer,
            touched=touched,
            after_transfer=after_transfer,
            refuse=refuse,
        )

    def forget_base(self, why: str) -> None:
        """With ``GroupConfig.delta``: this worker's tensors no longer hold
        what it received last (its engine's apply failed, or something else
        wrote them), so its next refit is dense, with ``why`` as the reason.
        A base that changed unnoticed is caught anyway, by its checksum."""
        self.session.delta.void(why)

    def close(self) -> None:
        self.session.close()
