"""Learn where vLLM puts every checkpoint box, from vLLM's own loaders.

A dry run, once per engine worker: inside vLLM's layerwise reload lifecycle
every parameter is a meta tensor of its checkpoint-loading shape, so we call
the model's own ``load_weights`` with meta tensors standing in for the
checkpoint tensors, under a dispatch mode that records every ``copy_`` (and
every ``fill_``, which is how padding is cleared) with the storage offset,
sizes and strides of both sides. A ``copy_`` from a view of checkpoint
tensor ``T`` into a view of parameter ``P`` becomes a piece: box ``B`` of
``T`` lands in ``P`` at offset ``O``, dims mapped. Nothing is read from a
per-model table; whatever the loaders do (fused ``qkv_proj`` with GQA
replication, ``gate_up_proj``, vocab padding, ``FusedMoE`` expert stacks,
expert parallelism) is what we learn. No memory is used: it is all meta.

Loaders that compute on the checkpoint tensor (arithmetic, dtype casts,
``contiguous()`` copies) break the chain from a checkpoint storage to the
parameter; those copies are reported, and the engine refuses to plan with
an incomplete layout instead of serving stale weights.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from reshard.plan.box import Box
from reshard.plan.layout import TensorMeta
from reshard.plan.specs import PieceSpec

if TYPE_CHECKING:
    import torch

__all__ = ["LearnedLayout", "learn_layout", "view_box"]


@dataclass(slots=True)
class LearnedLayout:
    """What one engine worker keeps: pieces, and per parameter what is zeroed."""

    pieces: list[PieceSpec]
    local_shapes: dict[str, tuple[int, ...]]
    """Checkpoint-loading shape of every parameter that receives a piece."""
    zero_fill: dict[str, list[Box]] = field(default_factory=dict)
    """Regions the loaders clear (vocab padding), by parameter."""
    layers: dict[str, list[str]] = field(default_factory=dict)
    """Parameter names by owning module name."""
    unsupported: list[str] = field(default_factory=list)
    """Copies whose source is not a view of a checkpoint tensor (and why)."""
    uncovered: dict[str, int] = field(default_factory=dict)
    """Parameters whose loadable elements the pieces do not all cover (count missing)."""


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    acc = 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def view_box(
    offset: int, sizes: tuple[int, ...], strides: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[Box, list[int]] | None:
    """The box a strided view covers in a contiguous tensor of ``shape``, and
    for each view dim the tensor dim it runs along (-1 for extent 1), or
    ``None`` when the view is not a box (steps, overlaps)."""
    cstr = _contiguous_strides(shape)
    nd = len(shape)
    offs = []
    rem = offset
    for d in range(nd):
        q, rem = divmod(rem, cstr[d]) if cstr[d] else (0, rem)
        offs.append(q)
    if rem != 0:
        return None
    box_sizes = [1] * nd
    mapping: list[int] = []
    used: set[int] = set()
    for size, stride in zip(sizes, strides, strict=True):
        if size == 1:
            mapping.append(-1)
            continue
        cands = [d for d in range(nd) if cstr[d] == stride and d not in used and shape[d] > 1]
        if len(cands) != 1:
            cands = [d for d in cands if offs[d] + size <= shape[d]][:1]
            if not cands:
                return None
        d = cands[0]
        used.add(d)
        mapping.append(d)
        box_sizes[d] = size
    box = Box(tuple(offs), tuple(box_sizes))
    if not box.within(shape):
        return None
    return box, mapping


def _dims(src_map: list[int], dst_map: list[int], src_nd: int, dst_nd: int) -> tuple[int, ...] | None:
    """Local dim of each checkpoint dim, from the two views' dim mappings."""
    dims = [-1] * src_nd
    used = set()
    for s, d in zip(src_map, dst_map, strict=True):
        if s >= 0 and d >= 0:
            dims[s] = d
            used.add(d)
        elif (s >= 0) != (d >= 0):
            return None
    free = [d for d in range(dst_nd) if d not in used]
    for g in range(src_nd):
        if dims[g] < 0:
            if not free:
                return None
            dims[g] = free.pop(0)
    if dims == list(range(src_nd)) and src_nd == dst_nd:
        return ()
    return tuple(dims)


@contextlib.contextmanager
def _quiet(names: Iterable[str]):
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels, strict=True):
            lg.setLevel(lv)


def learn_layout(model: torch.nn.Module, model_config, tensors: Iterable[TensorMeta]) -> LearnedLayout:
    """Dry-run ``model.load_weights`` on meta tensors and record where each
    checkpoint box lands. The model is back to its live weights afterwards."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from vllm.model_executor.model_loader.reload import layerwise

    metas = list(tensors)
    by_storage_src: dict[int, TensorMeta] = {}
    fakes = []
    for m in metas:
        t = torch.empty(m.shape, dtype=getattr(torch, m.dtype), device="meta")
        by_storage_src[t.untyped_storage()._cdata] = m
        fakes.append((m.name, t))

    copies: list[tuple] = []
    fills: list[tuple] = []
    unsupported: list[str] = []

    params: dict[int, tuple[str, torch.Tensor]] = {}

    class Recorder(TorchDispatchMode):
        """Records writes into parameters and does not perform them: most
        parameters are meta here, but some (``bias``) stay live during a
        reload and must not be touched by a dry run."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default:
                dst, src = args[0], args[1]
                if isinstance(src, torch.Tensor) and src.is_meta and dst.untyped_storage()._cdata in params:
                    copies.append(
                        (
                            dst.untyped_storage()._cdata,
                            dst.storage_offset(),
                            tuple(dst.shape),
                            tuple(dst.stride()),
                            src.untyped_storage()._cdata,
                            src.storage_offset(),
                            tuple(src.shape),
                            tuple(src.stride()),
                        )
                    )
                    return dst
            elif func in (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default):
                dst = args[0]
                value = args[1] if len(args) > 1 else 0
                if dst.untyped_storage()._cdata in params:
                    fills.append(
                        (
                            dst.untyped_storage()._cdata,
                            dst.storage_offset(),
                            tuple(dst.shape),
                            tuple(dst.stride()),
                            value,
                        )
                    )
                    return dst
            return func(*args, **(kwargs or {}))

    quiet = ["vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload"]
    layerwise.initialize_layerwise_reload(model)
    layers: dict[str, list[str]] = defaultdict(list)
    try:
        for mod_name, mod in model.named_modules():
            for pname, p in list(mod._parameters.items()) + list(mod._buffers.items()):
                if p is None:
                    continue
                full = f"{mod_name}.{pname}" if mod_name else pname
                key = p.untyped_storage()._cdata
                if key not in params:
                    params[key] = (full, p)
                    layers[mod_name].append(full)
                # The dry run calls vLLM's loaders directly, not the reload wrappers.
                if hasattr(p, "weight_loader"):
                    p.weight_loader = layerwise._get_original_loader(p)
        with Recorder(), torch.no_grad():
            model.load_weights(iter(fakes))  # type: ignore[operator]
    finally:
        with _quiet(quiet):
            layerwise.finalize_layerwise_reload(model, model_config)

    pieces: list[PieceSpec] = []
    local_shapes: dict[str, tuple[int, ...]] = {}
    covered: dict[str, int] = defaultdict(int)
    for dkey, doff, dsz, dst_str, skey, soff, ssz, sst in copies:
        dst_entry = params.get(dkey)
        src_meta = by_storage_src.get(skey)
        if dst_entry is None:
            continue  # a copy between temporaries inside a loader
        pname, p = dst_entry
        if src_meta is None:
            unsupported.append(f"{pname}: loaded from a computed tensor (not a view of a checkpoint tensor)")
            continue
        lshape = tuple(p.shape)
        src = view_box(soff, ssz, sst, src_meta.shape)
        dst = view_box(doff, dsz, dst_str, lshape)
        if src is None or dst is None or len(ssz) != len(dsz):
            unsupported.append(f"{pname} <- {src_meta.name}: a strided or reshaped view reshard cannot express")
            continue
        (sbox, smap), (dbox, dmap) = src, dst
        dims = _dims(smap, dmap, len(src_meta.shape), len(lshape))
        if dims is None:
            unsupported.append(f"{pname} <- {src_meta.name}: dims cannot be matched")
            continue
        local_shapes[pname] = lshape
        local_dtype = str(p.dtype).removeprefix("torch.")
        pieces.append(PieceSpec(src_meta, sbox, pname, lshape, dbox.offsets, dims, local_dtype))
        covered[pname] += sbox.numel
    zero_fill: dict[str, list[Box]] = defaultdict(list)
    for dkey, doff, dsz, dst_str, value in fills:
        entry = params.get(dkey)
        if entry is None:
            continue
        pname, p = entry
        vb = view_box(doff, dsz, dst_str, tuple(p.shape))
        if vb is None or value != 0:
            unsupported.append(f"{pname}: filled with {value!r} over a region reshard cannot express")
            continue
        zero_fill[pname].append(vb[0])
        covered[pname] += vb[0].numel
    uncovered = {}
    for pname, p in params.values():
        if pname not in local_shapes:
            continue
        want = getattr(p, "weight_loader_numel", p.numel())
        if covered[pname] < want:
            uncovered[pname] = want - covered[pname]
    mine = {n for n in local_shapes}
    return LearnedLayout(
        pieces=pieces,
        local_shapes=local_shapes,
        zero_fill=dict(zero_fill),
        layers={m: [n for n in names if n in mine] for m, names in layers.items() if any(n in mine for n in names)},
        unsupported=unsupported,
        uncovered=uncovered,
    )
