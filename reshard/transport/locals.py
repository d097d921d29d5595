"""A rank's local tensors for refits, with a lifecycle of their own.

One object is the front door of every tensor a refit reads or writes on a
rank: a trainer's shards, an engine worker's parameters materialized layer
by layer inside vLLM's reload, its two-phase staging buffers, a PEFT
policy's merged copies. A plain mapping becomes :class:`Tensors`; a
destination with its own lifecycle (vLLM's layerwise reload, SGLang's
padding, a drafter, in-flight commits) implements :class:`LocalTensors`,
the way torch.distributed.checkpoint's ``LoadPlanner`` resolves and commits
tensors and vLLM's weight-transfer engines start, update and finish: it
never adds a hook to a shared signature.

Call order, per refit, on the tensors of the rank's role (a trainer rank's
sources, an engine worker's destinations: ``Receiver.pull(n, into=...)``):

0. :meth:`LocalTensors.refusal` before the refit is entered: a reason fails
   it on every rank at step ``enter``, before any byte moves;
1. :meth:`LocalTensors.begin` once every rank agreed on the plan, before
   the first byte moves on this rank (raising fails the refit on every rank
   before anything is written);
2. :meth:`LocalTensors.resolve` (``tensors[name]``) whenever the executor
   touches a local tensor: the first call may materialize it. A ``lazy``
   object is checked against the layout there, tensor by tensor, before a
   byte lands in it; the others are checked before the plan is agreed;
3. :meth:`LocalTensors.landed` after each of this rank's rounds, once every
   byte it received so far has landed, with the tensors whose values
   changed so far (delta refits; ``None`` otherwise: any written may have);
4. :meth:`LocalTensors.finish` after this rank's last round, before every
   rank agrees on the outcome: work the rounds handed elsewhere ends here,
   and raising fails the refit on every rank.

A refit that fails leaves the object to its owner (an engine puts back
what it can, and says what it cannot).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from reshard.plan.items import RankPlan

__all__ = ["LocalTensors", "Tensors", "local_tensors"]


class LocalTensors(Mapping):
    """A rank's local tensors for refits (see the module docstring): local
    name -> tensor, with a lifecycle. Subclasses implement :meth:`resolve`,
    ``__iter__`` and ``__len__``, and the steps they need."""

    lazy: bool = False
    """Tensors materialize on demand (an engine's parameters inside its
    reload): checked as the executor first touches each, never all up front,
    and never a delta's base (nothing holds the last refit's bytes)."""
    private: bool = False
    """Only reshard writes these tensors (an engine's staging buffers, not
    its live weights): with delta refits, their checksums are taken once a
    refit succeeded, in a thread, instead of at the next plan step."""

    @property
    def device(self) -> torch.device | None:
        """Where the tensors are (``None``: none known yet). A lazy object
        says so without materializing anything."""
        if self.lazy:
            return None
        for name in self:
            return self.resolve(name).device
        return None

    def refusal(self, refit: int) -> str:
        """0. Why this rank cannot take refit ``refit`` (an engine out of room
        for another version; ``""``: it can). Asked before the ``enter``
        step: a refusal fails the refit on every rank there, before any byte
        moves, and the group stays for the next one."""
        return ""

    def begin(self, plan: RankPlan | None) -> None:
        """1. Every rank agreed on ``plan`` (``None``: a gather-and-broadcast,
        which has no plan of reshard's and no rounds); no byte has moved on
        this rank."""

    def resolve(self, name: str) -> torch.Tensor:
        """2. The local tensor ``name`` (``KeyError`` if there is none)."""
        raise NotImplementedError

    def landed(self, index: int, changed: frozenset[str] | None) -> None:
        """3. This rank's round ``index`` completed; ``changed``: with deltas,
        the local tensors whose values changed so far in this refit."""

    def finish(self) -> None:
        """4. This rank's last round completed; the outcome is not agreed yet."""

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.resolve(name)


class Tensors(LocalTensors):
    """A mapping of tensors as :class:`LocalTensors`, with no lifecycle
    (``refuse``: why this rank cannot take the refit, see :meth:`refusal`)."""

    def __init__(self, tensors: Mapping[str, Any], *, private: bool = False, refuse: str = "") -> None:
        self.tensors = tensors
        self.private = private
        self.refuse = refuse

    def refusal(self, refit: int) -> str:
        return self.refuse

    def resolve(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def local_tensors(tensors: Mapping[str, Any] | LocalTensors) -> LocalTensors:
    """``tensors`` as :class:`LocalTensors` (a plain mapping becomes :class:`Tensors`)."""
    return tensors if isinstance(tensors, LocalTensors) else Tensors(tensors)
