"""What a trainer rank holds, read from whichever trainer wraps the model.

:func:`describe_trainer` is what ``Sender(model)`` runs at construction and
at every push, through the registered trainer readers
(:mod:`reshard.sender.readers`, which says what each hook does):

1. a reader that owns the source outright describes it all (Megatron);
2. unwrap, through every reader's ``unwrap``: ``DeepSpeedEngine``
   (``.module``), ``DistributedDataParallel`` / ``DataParallel``
   (``.module``: replicas), ``torch.compile`` (``._orig_mod``); Accelerate's
   ``prepare`` returns one of these, an FSDP1 unit, or a module with DTensor
   parameters (FSDP2);
3. readers of whole modules (FSDP1 units, AutoEP layers) and of single
   tensors (ZeRO-3 partitions) give boxes of the rank's own storage
   (:class:`~reshard.sender.held.Held`), no gather and no copy;
4. everything else (DTensors: FSDP2, TP; plain tensors: replicas, ZeRO-1/2,
   DDP) goes to :func:`~reshard.sender.pieces.describe_module`.

Never silent: a tensor or module that a reader recognizes as one reshard
cannot read raises at once, naming the parameter, the wrapper and the rank
(an empty tensor that is no known partition, a flat parameter outside an
FSDP1 unit, a Megatron tensor-parallel shard, a layer of DeepSpeed's AutoTP).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from reshard.models.names import CheckpointNames
from reshard.plan.specs import GridSpec, PieceSpec
from reshard.sender import deepspeed, fsdp1, lora_adapter, peft
from reshard.sender.held import Held, held_pieces
from reshard.sender.pieces import default_rename, describe_module
from reshard.sender.readers import (
    Description,
    ReadContext,
    TrainerReader,
    known_trainers,
    readers,
    register_reader,
    unwrap,
)

if TYPE_CHECKING:
    import torch

__all__ = ["describe_trainer", "unwrap"]

# The readers of the trainers reshard reads without extra arguments. Each
# module registers its own on import; importing them here makes every
# ``Sender(model)`` see them.
_BUILTIN = (deepspeed.READER, fsdp1.READER, peft.READER, lora_adapter.READER)


def _ddp_module(obj: Any) -> Any | None:
    import torch

    if isinstance(obj, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
        return obj.module
    return None


def _compiled_module(obj: Any) -> Any | None:
    return obj._orig_mod if type(obj).__name__ == "OptimizedModule" and hasattr(obj, "_orig_mod") else None


def _refuse_megatron_shard(name: str, t: torch.Tensor, ctx: ReadContext) -> str | None:
    if not getattr(t, "tensor_model_parallel", False):
        return None
    return (
        f"rank {ctx.rank}: {name!r} of {ctx.where} (shape {list(t.shape)}) is a Megatron-Core tensor-parallel "
        "shard; pass reshard.adapters.megatron.MegatronSource(model, hf_config=...) (or use "
        "megatron_sender), which knows how it is cut"
    )


register_reader(TrainerReader(name="DistributedDataParallel", unwrap=_ddp_module))
register_reader(TrainerReader(name="torch.compile", unwrap=_compiled_module))
register_reader(TrainerReader(name="Megatron-Core", refuse=_refuse_megatron_shard))


def describe_trainer(
    source: torch.nn.Module | Mapping[str, torch.Tensor] | Any,
    *,
    rank: int,
    rename: Callable[[str], str | None] | None = default_rename,
    model_type: str | None = None,
    include_buffers: bool = True,
    source_rank_of: Callable[[int], int] | None = None,
) -> Description:
    """(pieces, grids, local tensors) this trainer rank holds, in checkpoint
    names (see the module docstring). ``model_type`` defaults to the
    unwrapped model's ``config.model_type``."""

    def inner(src: Any, inner_rename: Callable[[str], str | None] | None) -> Description:
        return _read(src, ctx_of(inner_rename))

    def ctx_of(r: Callable[[str], str | None] | None) -> ReadContext:
        return ReadContext(
            source=source,
            rank=rank,
            where=type(source).__name__,
            rename=r,
            model_type=model_type,
            include_buffers=include_buffers,
            source_rank_of=source_rank_of,
            unwrap=unwrap,
            inner=inner,
        )

    ctx = ctx_of(rename)
    for reader in readers():
        if reader.describe is not None and (whole := reader.describe(source, ctx)) is not None:
            return whole
    return _read(source, ctx)


def _read(source: Any, ctx: ReadContext) -> Description:
    """Steps 2-4 of :func:`describe_trainer`."""
    import torch

    rank, rename, include_buffers = ctx.rank, ctx.rename, ctx.include_buffers
    model_type = ctx.model_type
    model, chain = unwrap(source)
    if model_type is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
    ctx = dataclasses.replace(ctx, where=" > ".join([*chain, type(model).__name__]), model_type=model_type)
    held: list[Held] = []
    covered: set[int] = set()
    if isinstance(model, torch.nn.Module):
        for reader in readers():
            if reader.refuse_module is not None and (why := reader.refuse_module(model, ctx)) is not None:
                raise TypeError(why)
        for reader in readers():
            for h, ids in reader.modules(model, ctx) if reader.modules is not None else ():
                held += h
                covered |= ids
        items = _named_tensors(model, include_buffers)
    else:
        items = list(model.items())
    rest: dict[str, torch.Tensor] = {}
    for name, t in items:
        if id(t) in covered:
            continue
        read = _read_tensor(name, t, ctx)
        if read is not None:
            held += read
        else:
            rest[name] = t
    pieces, grids, local = describe_module(
        rest, rank=rank, rename=rename, model_type=model_type, source_rank_of=ctx.source_rank_of
    )
    names = CheckpointNames(model_type)
    more, more_local = held_pieces(held, names=names, rename=rename, rank=rank)
    _refuse_twice(pieces, grids, more, rank)
    local.update(more_local)
    return pieces + more, grids, local


def _read_tensor(name: str, t: torch.Tensor, ctx: ReadContext) -> list[Held] | None:
    """Views of ``t`` from the reader that reads it; ``None``: a DTensor or a
    plain tensor. Raises for a tensor a reader refuses, or one that holds
    nothing no reader can account for."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return None
    for reader in readers():
        if reader.refuse is not None and (why := reader.refuse(name, t, ctx)) is not None:
            raise ValueError(why)
    for reader in readers():
        if reader.tensor is not None and (views := reader.tensor(name, t, ctx)) is not None:
            return views
    if isinstance(t, torch.nn.Parameter) and t.numel() == 0:
        raise ValueError(
            f"rank {ctx.rank}: parameter {name!r} of {ctx.where} is empty (shape {list(t.shape)}) and is not a "
            f"partition reshard knows ({known_trainers()}); the trainer keeps its weights somewhere reshard "
            "cannot see. Pass the model as the trainer wrapped it, or describe its tensors with Sender.from_pieces"
        )
    return None


def _named_tensors(model: torch.nn.Module, include_buffers: bool) -> list[tuple[str, torch.Tensor]]:
    """Parameters, then persistent buffers, each tensor once. (Not through
    ``state_dict()``: FSDP1 and DeepSpeed hook it, and FSDP1's gathers.)"""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for n, p in model.named_parameters():
        seen.add(id(p))
        out.append((n, p))
    if include_buffers:
        for mname, mod in model.named_modules():
            for bname, b in mod.named_buffers(recurse=False):
                if b is None or id(b) in seen or bname in mod._non_persistent_buffers_set:
                    continue
                seen.add(id(b))
                out.append((f"{mname}.{bname}" if mname else bname, b))
    return out


def _refuse_twice(pieces: list[PieceSpec], grids: list[GridSpec], more: list[PieceSpec], rank: int) -> None:
    """One checkpoint tensor read from a flat parameter and from a plain one."""
    plain = {p.tensor.name for p in pieces} | {g.tensor.name for g in grids}
    both = sorted(plain & {p.tensor.name for p in more})
    if both:
        raise ValueError(
            f"rank {rank}: {both[0]!r} is held both in a flat parameter and as a tensor of its own"
            + (f" (and {len(both) - 1} more)" if len(both) > 1 else "")
            + "; pass a rename function that drops one"
        )
