"""Learning an engine's layout from its own loaders: a dry run of its
``load_weights`` on meta tensors, recorded.

The checkpoint tensors are meta tensors of their canonical shapes and dtypes;
a dispatch mode records every ``copy_`` into a parameter (and every
``fill_`` / ``zero_``, which is how loaders clear padding) with the storage
offset, sizes and strides of both sides, and does not perform it. A ``copy_``
from a view of checkpoint tensor ``T`` into a view of parameter ``P`` becomes
a piece: box ``B`` of ``T`` lands in ``P`` at offset ``O``, dims mapped.
Whatever the loaders do (fused ``qkv_proj`` with GQA replication,
``gate_up_proj``, vocabulary padding, expert stacks, expert parallelism) is
what is learned; there is no per-model table. Loaders that compute on the
checkpoint tensor (arithmetic, dtype casts, ``contiguous()`` copies) break
the chain from a checkpoint storage to the parameter: those are reported,
and receivers refuse to plan with an incomplete layout instead of serving
stale weights.

Engine adapters differ only in how the parameters are laid out during the
dry run (vLLM swaps in meta parameters inside its layerwise reload; SGLang
keeps live ones) and call :func:`record_loads` with them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reshard.plan.box import Box
from reshard.plan.layout import TensorMeta
from reshard.plan.specs import PieceSpec

if TYPE_CHECKING:
    import torch

__all__ = ["LearnedLayout", "match_dims", "record_loads", "view_box"]


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
    """Writes reshard cannot follow (and why)."""
    uncovered: dict[str, int] = field(default_factory=dict)
    """Parameters whose loadable elements the pieces do not all cover (count missing)."""

    def problems(self) -> list[str]:
        """Why a refit with this layout would leave stale weights (empty: none)."""
        out = [f"cannot follow this loader: {u}" for u in self.unsupported]
        out += [
            f"parameter {n!r}: {k} loadable elements are written by no checkpoint tensor"
            for n, k in self.uncovered.items()
        ]
        return out


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


def match_dims(src_map: list[int], dst_map: list[int], src_nd: int, dst_nd: int) -> tuple[int, ...] | None:
    """Local dim of each checkpoint dim, from the two views' dim mappings
    (``()``: the same dims in the same order), or ``None`` when they do not match."""
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


def record_loads(
    params: dict[int, tuple[str, torch.Tensor]],
    layers: dict[str, list[str]],
    tensors: Iterable[TensorMeta],
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any],
    *,
    strict: bool,
) -> LearnedLayout:
    """Run ``load(checkpoint tensors)`` on meta stand-ins for ``tensors`` and
    learn where each box lands.

    ``params`` maps a storage id to ``(parameter name, tensor)`` for every
    parameter the loaders may write, ``layers`` lists parameter names by
    module. ``strict``: any write into a parameter that is not a copy of a
    checkpoint box is unsupported (live parameters, which the dry run must not
    touch); otherwise such writes run (parameters that are meta tensors).
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

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

    def geom(t: torch.Tensor) -> tuple:
        return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    class Recorder(TorchDispatchMode):
        """Records writes into parameters instead of performing them."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default:
                dst, src = args[0], args[1]
                if dst.untyped_storage()._cdata in params:
                    if isinstance(src, torch.Tensor) and src.is_meta:
                        copies.append((*geom(dst), *geom(src)))
                        return dst
                    if strict:
                        unsupported.append(f"{params[dst.untyped_storage()._cdata][0]}: written from a live tensor")
                        return dst
            elif func in (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default):
                dst = args[0]
                if dst.untyped_storage()._cdata in params:
                    fills.append((*geom(dst), args[1] if len(args) > 1 else 0))
                    return dst
            elif strict and getattr(func, "_schema", None) is not None and func._schema.is_mutable:
                # Any other in-place write into a parameter is a loader we cannot follow.
                for a in args:
                    if isinstance(a, torch.Tensor) and a.untyped_storage()._cdata in params:
                        name = params[a.untyped_storage()._cdata][0]
                        unsupported.append(f"{name}: written by {func} (not a copy of a checkpoint box)")
                        return a
            return func(*args, **(kwargs or {}))

    with Recorder(), torch.no_grad():
        load(iter(fakes))

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
        dims = match_dims(smap, dmap, len(src_meta.shape), len(lshape))
        if dims is None:
            unsupported.append(f"{pname} <- {src_meta.name}: dims cannot be matched")
            continue
        local_shapes[pname] = lshape
        local_dtype = str(p.dtype).removeprefix("torch.")
        pieces.append(PieceSpec(src_meta, sbox, pname, lshape, dbox.offsets, dims, local_dtype))
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
        if pname not in local_shapes:
            continue
        want = getattr(p, "weight_loader_numel", p.numel())
        if covered[pname] < want:
            uncovered[pname] = want - covered[pname]
    mine = set(local_shapes)
    return LearnedLayout(
        pieces=pieces,
        local_shapes=local_shapes,
        zero_fill=dict(zero_fill),
        layers={m: [n for n in names if n in mine] for m, names in layers.items() if any(n in mine for n in names)},
        unsupported=unsupported,
        uncovered=uncovered,
    )
