"""What a trainer rank holds, read from whichever trainer wraps the model.

:func:`describe_trainer` is what ``Sender(model)`` runs at construction and
at every push:

1. unwrap: ``DeepSpeedEngine`` (``.module``), ``DistributedDataParallel`` /
   ``DataParallel`` (``.module``: replicas), ``torch.compile``
   (``._orig_mod``); Accelerate's ``prepare`` returns one of these, an FSDP1
   unit, or a module with DTensor parameters (FSDP2);
2. FSDP1 units and AutoEP layers are read by their own readers
   (:mod:`~reshard.sender.fsdp1`, :mod:`~reshard.sender.deepspeed`), ZeRO-3
   parameters from their partitions; each gives boxes of the rank's own
   storage (:class:`~reshard.sender.held.Held`), no gather and no copy;
3. everything else (DTensors: FSDP2, TP; plain tensors: replicas, ZeRO-1/2,
   DDP) goes to :func:`~reshard.sender.pieces.describe_module`.

Never silent: a parameter that none of these accounts for raises at once,
naming the parameter, the wrapper and the rank (an empty tensor that is no
known partition, a flat parameter outside an FSDP1 unit, a Megatron
tensor-parallel shard, a layer of DeepSpeed's AutoTP).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from reshard.models.names import CheckpointNames
from reshard.plan.specs import GridSpec, PieceSpec
from reshard.sender.deepspeed import (
    autoep_config,
    autoep_held,
    autoep_layers,
    deepspeed_engine_module,
    is_zero3_param,
    zero3_held,
)
from reshard.sender.fsdp1 import fsdp1_held, fsdp1_units, is_flat_param
from reshard.sender.held import Held, held_pieces
from reshard.sender.pieces import default_rename, describe_module

if TYPE_CHECKING:
    import torch

__all__ = ["describe_trainer", "unwrap"]

_KNOWN = (
    "DeepSpeed ZeRO-1/2/3 (DeepSpeedEngine, zero.Init, AutoEP), FSDP1 (FullyShardedDataParallel), "
    "FSDP2 / DTensor, DistributedDataParallel, plain tensors"
)


def unwrap(source: Any) -> tuple[Any, list[str]]:
    """The model inside the wrappers reshard reads through, and the wrappers'
    type names, outermost first."""
    import torch

    chain: list[str] = []
    while True:
        inner = deepspeed_engine_module(source)
        if inner is None and isinstance(source, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
            inner = source.module
        if inner is None and type(source).__name__ == "OptimizedModule" and hasattr(source, "_orig_mod"):
            inner = source._orig_mod
        if inner is None:
            return source, chain
        chain.append(type(source).__name__)
        source = inner


def describe_trainer(
    source: torch.nn.Module | Mapping[str, torch.Tensor],
    *,
    rank: int,
    rename: Callable[[str], str | None] | None = default_rename,
    model_type: str | None = None,
    include_buffers: bool = True,
    source_rank_of: Callable[[int], int] | None = None,
) -> tuple[list[PieceSpec], list[GridSpec], dict[str, torch.Tensor]]:
    """(pieces, grids, local tensors) this trainer rank holds, in checkpoint
    names (see the module docstring). ``model_type`` defaults to the
    unwrapped model's ``config.model_type``."""
    import torch

    model, chain = unwrap(source)
    if type(model).__module__.split(".")[0] == "peft":
        raise TypeError(
            f"rank {rank}: the model is a PEFT {type(model).__name__}: its adapters would have to be merged into "
            "the base weights before a refit, which reshard does not do yet; merge them (merge_and_unload) "
            "or refit the base model"
        )
    ep_config = autoep_config(source)
    if model_type is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
    where = " > ".join([*chain, type(model).__name__])
    held: list[Held] = []
    covered: set[int] = set()
    if isinstance(model, torch.nn.Module):
        _refuse_unknown_layers(model, where, rank)
        for path, unit in fsdp1_units(model):
            h, ids = fsdp1_held(path, unit, where=where, rank=rank)
            held += h
            covered |= ids
        for path, layer in autoep_layers(model):
            h, ids = autoep_held(path, layer, where=where, rank=rank, config=ep_config)
            held += h
            covered |= ids
        items = _named_tensors(model, include_buffers)
    else:
        items = list(model.items())
    rest: dict[str, torch.Tensor] = {}
    for name, t in items:
        if id(t) in covered:
            continue
        _refuse_unaccounted(name, t, where, rank)
        if is_zero3_param(t):
            held += zero3_held(name, t, where=where, rank=rank)
            continue
        rest[name] = t
    pieces, grids, local = describe_module(
        rest, rank=rank, rename=rename, model_type=model_type, source_rank_of=source_rank_of
    )
    names = CheckpointNames(model_type)
    more, more_local = held_pieces(held, names=names, rename=rename, rank=rank)
    _refuse_twice(pieces, grids, more, rank)
    local.update(more_local)
    return pieces + more, grids, local


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


def _refuse_unknown_layers(model: torch.nn.Module, where: str, rank: int) -> None:
    """Layers that shard their weights in ways reshard does not read yet."""
    for path, mod in model.named_modules():
        cls = type(mod)
        if cls.__module__.startswith("deepspeed.module_inject.layers") and any(
            c.__name__ == "TensorParallel_Layer" for c in cls.__mro__
        ):
            raise TypeError(
                f"rank {rank}: layer {path!r} ({cls.__name__}) of {where} is a DeepSpeed AutoTP "
                "tensor-parallel layer, which reshard does not read yet; describe its tensors with "
                "Sender.from_pieces"
            )


def _refuse_unaccounted(name: str, t: torch.Tensor, where: str, rank: int) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return
    if is_flat_param(t):
        raise ValueError(
            f"rank {rank}: {name!r} of {where} is an FSDP1 flat parameter of shape {list(t.shape)} outside "
            "any FullyShardedDataParallel unit reshard can see; pass the FSDP-wrapped model itself"
        )
    if getattr(t, "tensor_model_parallel", False):
        raise ValueError(
            f"rank {rank}: {name!r} of {where} (shape {list(t.shape)}) is a Megatron-Core tensor-parallel "
            "shard; use reshard.adapters.megatron.megatron_sender, which knows how it is cut"
        )
    if getattr(t, "allreduce", True) is False:
        raise ValueError(
            f"rank {rank}: {name!r} of {where} (shape {list(getattr(t, 'ds_shape', t.shape))}) is a DeepSpeed MoE "
            "expert parameter (deepspeed.moe, allreduce=False): each expert-parallel rank holds other experts "
            "under the same name, which reshard does not read yet; use AutoEP (expert_parallel in the config) "
            "or describe the experts with Sender.from_pieces"
        )
    if isinstance(t, torch.nn.Parameter) and t.numel() == 0 and not is_zero3_param(t):
        raise ValueError(
            f"rank {rank}: parameter {name!r} of {where} is empty (shape {list(t.shape)}) and is not a "
            f"partition reshard knows ({_KNOWN}); the trainer keeps its weights somewhere reshard cannot "
            "see. Pass the model as the trainer wrapped it, or describe its tensors with Sender.from_pieces"
        )


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
