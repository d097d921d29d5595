"""Learn where SGLang puts every checkpoint box, from SGLang's own loaders.

A dry run, once per TP worker: the model's own ``load_weights`` is called
with meta tensors standing in for the checkpoint tensors, under a dispatch
mode that records every ``copy_`` into a parameter (and every ``fill_`` /
``zero_``, which is how vocabulary padding is cleared) with the storage
offset, sizes and strides of both sides, and does not perform it. SGLang's
parameters stay live and untouched; nothing is allocated.

A ``copy_`` from a view of checkpoint tensor ``T`` into a view of parameter
``P`` becomes a piece: box ``B`` of ``T`` lands in ``P`` at offset ``O``,
dims mapped. Whatever SGLang's loaders do (the stacked-params mapping to
``qkv_proj`` / ``gate_up_proj``, GQA key/value replication, the padded and
split vocabulary, routing a tied embedding) is what we learn; there is no
per-model table. Loaders that compute on the checkpoint tensor (arithmetic,
dtype casts, ``contiguous()`` copies) break the chain from a checkpoint
storage to the parameter: those are reported, and the receiver refuses to
plan with an incomplete layout rather than serve stale weights.

The box arithmetic (:func:`reshard.adapters.vllm.layout.view_box`) and the
result type are the vLLM adapter's; only the lifecycle differs: SGLang keeps
live parameters during an update, vLLM swaps in meta ones.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from reshard.adapters.vllm.layout import LearnedLayout, view_box
from reshard.plan.box import Box
from reshard.plan.layout import TensorMeta
from reshard.plan.specs import PieceSpec

if TYPE_CHECKING:
    import torch

__all__ = ["LearnedLayout", "canonical_tensors_of", "learn_layout", "model_dtype"]


def model_dtype(model: torch.nn.Module) -> str:
    """The floating dtype most of the model's parameters have (``float32``, ``bfloat16``)."""
    counts: dict[str, int] = defaultdict(int)
    for p in model.parameters():
        if p.is_floating_point():
            counts[str(p.dtype).removeprefix("torch.")] += p.numel()
    if not counts:
        raise ValueError("the model has no floating-point parameters")
    return max(counts, key=lambda k: counts[k])


def _dims(src_map: list[int], dst_map: list[int], src_nd: int, dst_nd: int) -> tuple[int, ...] | None:
    """Local dim of each checkpoint dim, from the two views' dim mappings
    (``()``: the same dims in the same order)."""
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


def canonical_tensors_of(model: torch.nn.Module) -> list[TensorMeta]:
    """Checkpoint names, shapes and dtypes of the model an SGLang worker serves.

    SGLang model classes keep the Hugging Face config as ``model.config``; the
    dtype is the one the engine computes in (trainer and engine must agree)."""
    from reshard.models import canonical_tensors

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(f"{type(model).__name__} has no Hugging Face config at .config")
    return canonical_tensors(config.to_dict(), dtype=model_dtype(model))


def learn_layout(model: torch.nn.Module, tensors: Iterable[TensorMeta]) -> LearnedLayout:
    """Dry-run ``model.load_weights`` on meta tensors and record where each
    checkpoint box lands (see the module docstring). The model's weights are
    not written."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    metas = list(tensors)
    by_storage_src: dict[int, TensorMeta] = {}
    fakes = []
    for m in metas:
        t = torch.empty(m.shape, dtype=getattr(torch, m.dtype), device="meta")
        by_storage_src[t.untyped_storage()._cdata] = m
        fakes.append((m.name, t))

    params: dict[int, tuple[str, torch.Tensor]] = {}
    layers: dict[str, list[str]] = defaultdict(list)
    for mod_name, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()) + list(mod._buffers.items()):
            if p is None or p.is_meta:
                continue
            key = p.untyped_storage()._cdata
            if key not in params:
                full = f"{mod_name}.{pname}" if mod_name else pname
                params[key] = (full, p)
                layers[mod_name].append(full)

    copies: list[tuple] = []
    fills: list[tuple] = []
    unsupported: list[str] = []

    def _geom(t: torch.Tensor) -> tuple:
        return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    class Recorder(TorchDispatchMode):
        """Records writes into parameters instead of performing them."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default:
                dst, src = args[0], args[1]
                if dst.untyped_storage()._cdata in params:
                    if isinstance(src, torch.Tensor) and src.is_meta:
                        copies.append((*_geom(dst), *_geom(src)))
                    else:
                        unsupported.append(f"{params[dst.untyped_storage()._cdata][0]}: written from a live tensor")
                    return dst
            elif func in (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default):
                dst = args[0]
                if dst.untyped_storage()._cdata in params:
                    fills.append((*_geom(dst), args[1] if len(args) > 1 else 0))
                    return dst
            elif getattr(func, "_schema", None) is not None and func._schema.is_mutable:
                # Any other in-place write into a parameter is a loader we cannot follow.
                for a in args:
                    if isinstance(a, torch.Tensor) and a.untyped_storage()._cdata in params:
                        name = params[a.untyped_storage()._cdata][0]
                        unsupported.append(f"{name}: written by {func} (not a copy of a checkpoint box)")
                        return a
            return func(*args, **(kwargs or {}))

    with Recorder(), torch.no_grad():
        model.load_weights(iter(fakes))  # type: ignore[operator]

    pieces: list[PieceSpec] = []
    local_shapes: dict[str, tuple[int, ...]] = {}
    covered: dict[str, int] = defaultdict(int)
    for dkey, doff, dsz, dst_str, skey, soff, ssz, sst in copies:
        pname, p = params[dkey]
        src_meta = by_storage_src.get(skey)
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
        pieces.append(PieceSpec(src_meta, sbox, pname, lshape, dbox.offsets, dims))
        covered[pname] += sbox.numel
    zero_fill: dict[str, list[Box]] = defaultdict(list)
    for dkey, doff, dsz, dst_str, value in fills:
        pname, p = params[dkey]
        vb = view_box(doff, dsz, dst_str, tuple(p.shape))
        if vb is None or value != 0:
            unsupported.append(f"{pname}: filled with {value!r} over a region reshard cannot express")
            continue
        if vb[0].numel:
            zero_fill[pname].append(vb[0])
            covered[pname] += vb[0].numel
    uncovered = {}
    for pname, p in params.values():
        if pname in local_shapes and covered[pname] < p.numel():
            uncovered[pname] = p.numel() - covered[pname]
    mine = set(local_shapes)
    return LearnedLayout(
        pieces=pieces,
        local_shapes=local_shapes,
        zero_fill=dict(zero_fill),
        layers={m: [n for n in names if n in mine] for m, names in layers.items() if any(n in mine for n in names)},
        unsupported=unsupported,
        uncovered=uncovered,
    )
