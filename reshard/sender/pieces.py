"""What a trainer rank holds: DTensor placements, plain tensors, fused names.

DTensor parameters whose placements are ``Shard``/``Replicate`` (FSDP2,
TP, FSDP2 over TP) become one grid rule over their device mesh, checked
against DTensor's own ``compute_local_shape_and_global_offset`` for this
rank; anything a grid cannot say becomes an explicit piece of this rank's
local box. Plain tensors are replicas: each rank that has one publishes the
whole tensor. Parameters that transformers fuses in its modeling code
(``mlp.experts.gate_up_proj``) are split into the checkpoint tensors they
are made of, each intersected with this rank's local box.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from reshard.models.names import CheckpointNames, CheckpointPiece
from reshard.plan.box import Box, full_box
from reshard.plan.layout import Grid, Mesh, TensorMeta, grid_box
from reshard.plan.specs import GridSpec, PieceSpec

if TYPE_CHECKING:
    import torch

__all__ = ["checkpoint_pieces", "default_rename", "describe_module", "dtensor_grid"]

_PREFIXES = re.compile(r"(^|\.)(_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module|_compiled_module)\.")


def default_rename(name: str) -> str | None:
    """Strip FSDP, activation-checkpoint and ``torch.compile`` wrapper
    prefixes, and DDP's leading ``module.``."""
    name = _PREFIXES.sub(r"\1", name)
    return name.removeprefix("module.")


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def dtensor_grid(
    t: torch.Tensor, *, source_rank_of: Callable[[int], int] | None = None, meshes: dict | None = None
) -> tuple[Mesh, tuple[tuple[int, ...], ...]] | None:
    """(mesh, shard spec) of a DTensor's placements, or ``None`` when a grid
    cannot express them (``Partial`` raises: it must be reduced first).
    ``meshes``: a cache of device meshes already read (by object; reading
    one's ranks costs torch a layout computation each time)."""
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    placements = t.placements  # type: ignore[attr-defined]
    mesh = t.device_mesh  # type: ignore[attr-defined]
    ndim = t.dim()
    plain: list[list[int]] = [[] for _ in range(ndim)]
    strided: list[list[int]] = [[] for _ in range(ndim)]
    for axis, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ValueError(f"a DTensor with a Partial placement on mesh dim {axis} cannot be sent; reduce it first")
        if isinstance(p, Replicate):
            continue
        if isinstance(p, Shard):
            # _StridedShard is a Shard subclass: FSDP2 over TP marks the FSDP
            # axis strided; the TP cut applies first.
            (strided if type(p).__name__ == "_StridedShard" else plain)[p.dim % ndim].append(axis)
            continue
        return None
    shard = tuple(tuple(plain[d] + strided[d]) for d in range(ndim))
    if meshes is None:
        meshes = {}
    key = ("mesh", id(mesh))
    if key not in meshes:
        ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
        if source_rank_of is not None:
            ranks = [source_rank_of(r) for r in ranks]
        meshes[key] = (mesh, Mesh(shape=tuple(mesh.mesh.shape), ranks=tuple(ranks)))
    return meshes[key][1], shard


def _local_box(t: torch.Tensor, cache: dict) -> Box:
    """This rank's box of DTensor ``t``; ``cache`` holds those computed for
    the same shape, mesh and placements (every layer's tensors repeat them)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = t.device_mesh  # type: ignore[attr-defined]
    key = ("box", tuple(t.shape), id(mesh), tuple(t.placements))  # type: ignore[attr-defined]
    if key not in cache:
        shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)  # type: ignore[attr-defined]
        cache[key] = (mesh, Box(tuple(int(o) for o in offset), tuple(int(s) for s in shape)))
    return cache[key][1]


def _coordinate(mesh, cache: dict) -> tuple[int, ...]:
    key = ("coord", id(mesh))
    if key not in cache:
        cache[key] = (mesh, tuple(int(c) for c in mesh.get_coordinate()))
    return cache[key][1]


def describe_module(
    tensors: Mapping[str, torch.Tensor],
    *,
    rank: int,
    rename: Callable[[str], str | None] | None = default_rename,
    model_type: str | None = None,
    source_rank_of: Callable[[int], int] | None = None,
) -> tuple[list[PieceSpec], list[GridSpec], dict[str, torch.Tensor]]:
    """(pieces, grids, local tensors) this rank holds of ``tensors`` (a
    module's DTensors and plain tensors, by parameter name)."""
    from torch.distributed.tensor import DTensor

    items = list(tensors.items())
    names = CheckpointNames(model_type)
    pieces: list[PieceSpec] = []
    grids: list[GridSpec] = []
    local: dict[str, torch.Tensor] = {}
    # Device meshes, coordinates and local boxes repeat for every layer; the
    # cache keeps each mesh alive beside its id for the length of the call.
    cache: dict = {}
    for name, t in items:
        cname = rename(name) if rename is not None else name
        if cname is None:
            continue
        dtype = _dtype_name(t)
        split = names.split(cname, tuple(t.shape))
        is_dt = isinstance(t, DTensor)
        if is_dt:
            lt = t.to_local()  # type: ignore[attr-defined]
            box = _local_box(t, cache)
        else:
            lt = t.detach()
            box = full_box(t.shape)
        if tuple(lt.shape) != box.sizes:
            raise ValueError(f"{name!r}: local shard of shape {list(lt.shape)} but its box is {box}")
        # (Contiguity and dtypes are checked against the layout at each push.)
        local_name = cname
        if local_name in local:
            raise ValueError(f"two tensors map to the checkpoint name {cname!r}; pass a rename function")
        if is_dt and len(split) == 1 and split[0].name == cname:
            spec = dtensor_grid(t, source_rank_of=source_rank_of, meshes=cache)
            meta = TensorMeta(cname, tuple(t.shape), dtype)
            if spec is not None:
                mesh, shard = spec
                grid = Grid(tensors=(0, 1, 1), mesh=mesh, shard=shard)
                coord = _coordinate(t.device_mesh, cache)  # type: ignore[attr-defined]
                if grid_box(grid, meta.shape, coord) == box:
                    # Every rank of the mesh publishes the grid, also one whose
                    # shard is empty (a tensor with fewer rows than ranks): the
                    # grid speaks for all of them, so all must say it alike.
                    grids.append(GridSpec(meta, mesh, shard))
                    local[local_name] = lt
                    continue
        if box.is_empty():
            continue  # this rank holds nothing of it (an uneven split's empty tail)
        local[local_name] = lt
        if is_dt and len(split) == 1 and split[0].name == cname:
            pieces.append(PieceSpec(meta, box, local_name, box.sizes))
            continue
        pieces += checkpoint_pieces(split, dtype, box, local_name)
    return pieces, grids, local


def checkpoint_pieces(split: Sequence[CheckpointPiece], dtype: str, box: Box, local: str) -> list[PieceSpec]:
    """Explicit pieces of a local tensor that holds box ``box`` of a model
    parameter (of shape ``box.sizes``): each checkpoint tensor the parameter
    is made of (``split``) intersected with the box."""
    ndim = box.ndim
    pieces = []
    for cp in split:
        meta = TensorMeta(cp.name, cp.shape, dtype)
        ck_dims = cp.dims or tuple(range(len(cp.shape)))
        off = cp.offset or (0,) * ndim
        # The checkpoint tensor's region inside the parameter.
        region_sizes = [1] * ndim
        for g, d in enumerate(ck_dims):
            region_sizes[d] = cp.shape[g]
        region = Box(tuple(off), tuple(region_sizes))
        inter = region.intersect(box)
        if inter is None:
            continue
        gbox = Box(
            tuple(inter.offsets[d] - off[d] for d in ck_dims),
            tuple(inter.sizes[d] for d in ck_dims),
        )
        # Where that box's origin sits in the local shard.
        loff = tuple(inter.offsets[d] - box.offsets[d] for d in range(ndim))
        pieces.append(PieceSpec(meta, gbox, local, box.sizes, loff, cp.dims))
    return pieces
