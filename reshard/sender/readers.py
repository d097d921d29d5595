"""Trainer readers: one registration seam for every way a trainer keeps its
weights that ``Sender(model)`` reads.

A :class:`TrainerReader` says what it knows of one trainer, in up to five
hooks, all optional; :func:`reshard.sender.trainers.describe_trainer` runs
them in this order, for every registered reader:

1. ``describe(source, ctx)``: the whole description of a source this reader
   owns outright (a Megatron model with its Hugging Face config), or
   ``None``;
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

Tensors no reader claims are DTensors (FSDP2, TP) or plain replicas
(:func:`reshard.sender.pieces.describe_module`). A new trainer is one
:func:`register_reader` call beside its reader; docs/architecture.md lists
where each kind of change goes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reshard.plan.specs import GridSpec, PieceSpec
from reshard.sender.held import Held

if TYPE_CHECKING:
    import torch

__all__ = ["Description", "ReadContext", "TrainerReader", "known_trainers", "readers", "register_reader", "unwrap"]

Description = tuple[list[PieceSpec], list[GridSpec], "dict[str, torch.Tensor]"]
"""(pieces, grids, local tensors) of one trainer rank, in checkpoint names."""


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
    unwrap: Callable[[Any], tuple[Any, list[str]]] | None = None
    """The model inside a source's wrappers, and the wrappers' names."""
    inner: Callable[[Any, Callable[[str], str | None] | None], Description] | None = None
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


_READERS: list[TrainerReader] = []


def register_reader(reader: TrainerReader) -> TrainerReader:
    """Add ``reader`` (a reader of the same name is replaced, so a module
    imported twice registers once). Returns it."""
    for i, r in enumerate(_READERS):
        if r.name == reader.name:
            _READERS[i] = reader
            return reader
    _READERS.append(reader)
    return reader


def readers() -> tuple[TrainerReader, ...]:
    """The registered readers, in registration order."""
    return tuple(_READERS)


def known_trainers() -> str:
    """What ``Sender(model)`` reads, for error messages."""
    return ", ".join([*(r.name for r in _READERS), "FSDP2 / DTensor", "plain tensors"])


def unwrap(source: Any) -> tuple[Any, list[str]]:
    """The model inside the wrappers the registered readers unwrap, and the
    wrappers' type names, outermost first."""
    chain: list[str] = []
    while True:
        inner = None
        for reader in _READERS:
            if reader.unwrap is not None and (inner := reader.unwrap(source)) is not None:
                break
        if inner is None:
            return source, chain
        chain.append(type(source).__name__)
        source = inner
