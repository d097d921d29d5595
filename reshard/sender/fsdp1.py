"""FSDP1 trainers (``FullyShardedDataParallel``), read from their flat parameters.

Each FSDP1 unit flattens the parameters it manages (not those of nested
units) into one ``FlatParameter``: their row-major elements one after the
other (with alignment padding when ``use_orig_params=True``), padded to a
multiple of the shard group's size; rank ``r`` of that group holds chunk
``r``. The handle records, for each parameter, which part of it this
rank's chunk holds and where (``_shard_param_infos``): the rank holds the
flat range ``[intra_param_start_idx, intra_param_end_idx]`` of the
parameter at ``offset_in_shard`` of its chunk. Each such range becomes at
most ``2N-1`` boxes, views of the chunk.

The same for ``use_orig_params`` True (the original parameters are 1-dim
views of the chunk, or empty) and False (only ``_flat_param`` names
exist), with or without a device mesh (it changes the state dict, not the
flat parameters), for every sharding strategy (``NO_SHARD`` holds the
whole flat parameter; ``HYBRID_SHARD`` shards within its group and the
groups are replicas) and mixed precision: the chunk read is
``_local_shard``, the full-precision shard the optimizer steps (low
precision copies exist only during forward and backward). Names are the
unit's path plus ``_fqns``; ``default_rename`` drops ``_fsdp_wrapped_module.``.

FSDP1 attributes read (private; pinned by ``tests/test_trainers.py``):
``FullyShardedDataParallel._handle``, ``FlatParamHandle.flat_param``,
``FlatParameter._fqns``, ``_shapes``, ``_shard_param_infos``,
``_sharded_size``, ``_local_shard`` (set at FSDP1's lazy init, at the first
forward), ``_params``, ``_shared_params``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from reshard.sender.held import Held, flat_held
from reshard.sender.readers import ReadContext, TrainerReader

if TYPE_CHECKING:
    import torch

__all__ = ["READER", "fsdp1_held", "fsdp1_units", "is_flat_param"]


def is_flat_param(t: Any) -> bool:
    """An FSDP1 ``FlatParameter`` (or anything flagged as one)."""
    return bool(getattr(t, "_is_flat_param", False))


def fsdp1_units(module: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(path, FullyShardedDataParallel)`` of every FSDP1 unit in ``module``."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [(n, m) for n, m in module.named_modules() if isinstance(m, FullyShardedDataParallel)]


def fsdp1_held(path: str, unit: Any, *, where: str, rank: int) -> tuple[list[Held], set[int]]:
    """The boxes FSDP1 unit ``unit`` (at ``path``) holds on this rank, as
    views of its local shard; and the ids of the tensors it covers (the flat
    parameter and, with ``use_orig_params``, the original parameters)."""
    handle = getattr(unit, "_handle", None)
    if handle is None:
        return [], set()  # a unit without parameters of its own
    fp = handle.flat_param
    here = f"{where}, FSDP1 unit {path or '<root>'!r}"
    try:
        fqns, shapes, infos = fp._fqns, fp._shapes, fp._shard_param_infos
        sharded_size = tuple(fp._sharded_size)
    except AttributeError as e:
        raise ValueError(
            f"rank {rank}: {here}: its flat parameter has no {e.name!r}; this torch's FSDP1 is not one reshard reads"
        ) from None
    # The shard the optimizer steps: _local_shard once FSDP1 ran its lazy init
    # (first forward), before that the flat parameter itself, still sharded.
    shard = getattr(fp, "_local_shard", None)
    if shard is None:
        if tuple(fp.shape) != sharded_size:
            raise ValueError(
                f"rank {rank}: {here}: its flat parameter has shape {list(fp.shape)}, not its sharded size "
                f"{list(sharded_size)}, and no local shard; reshard cannot map it"
            )
        shard = fp
    if not (len(fqns) == len(shapes) == len(infos)):
        raise ValueError(
            f"rank {rank}: {here}: {len(fqns)} names, {len(shapes)} shapes and {len(infos)} shard records "
            "in its flat parameter; reshard cannot map it"
        )
    if shard.dim() != 1:
        raise ValueError(f"rank {rank}: {here}: a local shard of shape {list(shard.shape)} (expected 1-dim)")
    prefix = f"{path}." if path else ""
    out: list[Held] = []
    for fqn, shape, info in zip(fqns, shapes, infos, strict=True):
        if not info.in_shard:
            continue
        start, stop = int(info.intra_param_start_idx), int(info.intra_param_end_idx) + 1
        offset, numel = int(info.offset_in_shard), int(info.numel_in_shard)
        if numel != stop - start or offset + numel > shard.numel():
            raise ValueError(
                f"rank {rank}: {here}: parameter {fqn!r} of shape {list(shape)}: elements [{start}, {stop}) "
                f"at [{offset}, {offset + numel}) of a local shard of {shard.numel()}; reshard cannot map it"
            )
        flat = shard.detach().narrow(0, offset, numel)
        out += flat_held(prefix + fqn, tuple(int(n) for n in shape), flat, start, stop)
    ids = {id(fp)}
    for group in (getattr(fp, "_params", None), getattr(fp, "_shared_params", None)):
        ids.update(id(p) for p in group or ())
    return out, ids


# -- the reader ----------------------------------------------------------------


def _units(model: torch.nn.Module, ctx: ReadContext) -> Iterator[tuple[list[Held], set[int]]]:
    for path, unit in fsdp1_units(model):
        yield fsdp1_held(path, unit, where=ctx.where, rank=ctx.rank)


def _refuse_stray_flat(name: str, t: torch.Tensor, ctx: ReadContext) -> str | None:
    if not is_flat_param(t):
        return None
    return (
        f"rank {ctx.rank}: {name!r} of {ctx.where} is an FSDP1 flat parameter of shape {list(t.shape)} outside "
        "any FullyShardedDataParallel unit reshard can see; pass the FSDP-wrapped model itself"
    )


READER = TrainerReader(name="FSDP1 (FullyShardedDataParallel)", modules=_units, refuse=_refuse_stray_flat)
"""Each unit's flat parameter, as views of its local shard."""
