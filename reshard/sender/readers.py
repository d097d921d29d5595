"""Trainer readers: the contract every way a trainer keeps its weights
implements so that ``Sender(model)`` reads it.

A :class:`TrainerReader` says what it knows of one trainer, in up to five
hooks, all optional; :func:`reshard.sender.trainers.describe_trainer` runs
them in this order, for every reader
(:func:`reshard.sender.trainers.readers`: the built-ins in their documented
order, then those a user registered):

1. ``describe(source, ctx)``: the whole :class:`Description` of a source
   this reader owns outright (a Megatron model with its Hugging Face config,
   a PEFT policy), or ``None``;
2. ``unwrap(obj)``: the object inside a wrapper of this trainer
   (``DeepSpeedEngine.module``, DDP's ``module``), or ``None``;
3. ``modules(model, ctx)``: views (:class:`~reshard.sender.held.Held`) of
   the rank's own storage for whole modules this reader reads (FSDP1 units,
   AutoEP layers), and the ids of the tensors they account for;
4. ``tensor(name, t, ctx)``: views of one tensor this reader reads (a ZeRO-3
   partition), or ``None``;
5. ``refuse(name, t, ctx)`` / ``refuse_module(model, ctx)``: why a tensor or
   module left over is one this trainer keeps in a way reshard cannot read
   (a flat parameter outside its unit, a Megatron shard), or ``None``.

A hook claims an object (a source, a wrapper, a tensor) by returning
something for it; one object is claimed by one reader at most, and two
claimants are an error naming both, the object's type and the rank, so no
reader depends on running before another. A hook declines what it does not
know cheaply (a type check), as every reader's hook sees every object.

Tensors no reader claims are DTensors (FSDP2, TP) or plain replicas
(:func:`reshard.sender.pieces.describe_module`). A user's trainer is one
:func:`reshard.sender.trainers.register_reader` call; a built-in one is an
entry in :data:`reshard.sender.trainers.BUILTIN`. docs/architecture.md lists
where each kind of change goes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from reshard.plan.specs import GridSpec, PieceSpec
from reshard.sender.held import Held

if TYPE_CHECKING:
    import torch

    from reshard.transport.locals import LocalTensors

__all__ = ["Description", "ReadContext", "TrainerReader"]


class Description(NamedTuple):
    """What one trainer rank holds, in checkpoint names: what a reader's
    ``describe`` returns and what ``Sender`` builds its layout from."""

    pieces: list[PieceSpec]
    """Boxes of checkpoint tensors at boxes of local tensors."""
    grids: list[GridSpec]
    """Regular grids of DTensors, described by rule."""
    tensors: Mapping[str, torch.Tensor] | LocalTensors
    """The local tensors, by the local names the pieces and grids use (as
    :class:`~reshard.transport.locals.LocalTensors` where they have a
    lifecycle of their own: a PEFT policy's boxes, merged when read)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadContext:
    """What every hook may read besides its own argument."""

    source: Any
    """What the user passed to ``Sender`` (wrappers included)."""
    rank: int
    """This trainer rank's refit rank (named in errors)."""
    where: str
    """The wrappers and the model, outermost first (``DeepSpeedEngine > Qwen2ForCausalLM``)."""
    rename: Callable[[str], str | None] | None
    model_type: str | None
    include_buffers: bool
    source_rank_of: Callable[[int], int] | None
    unwrap: Callable[[Any], tuple[Any, list[str]]]
    """The model inside a source's wrappers, and the wrappers' names."""
    inner: Callable[[Any, Callable[[str], str | None] | None], Description]
    """The description of a source by every other hook, with another
    ``rename`` (a ``describe`` hook that transforms what the trainer holds,
    such as PEFT's merge, reads it this way)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerReader:
    """One trainer's hooks (see the module docstring)."""

    name: str
    """The trainer as errors name it (``FSDP1 (FullyShardedDataParallel)``)."""
    describe: Callable[[Any, ReadContext], Description | None] | None = None
    unwrap: Callable[[Any], Any | None] | None = None
    modules: Callable[[torch.nn.Module, ReadContext], Iterable[tuple[list[Held], set[int]]]] | None = None
    tensor: Callable[[str, torch.Tensor, ReadContext], list[Held] | None] | None = None
    refuse: Callable[[str, torch.Tensor, ReadContext], str | None] | None = None
    refuse_module: Callable[[torch.nn.Module, ReadContext], str | None] | None = None
