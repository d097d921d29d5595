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
what is learned; there is no per-model table.

A piece is only learned when the recording proves the parameter receives
the checkpoint values unchanged, not assumed from the shape of a copy:
every operation the loader runs is followed. A copy is plain when its source
is a view of a checkpoint tensor that nothing wrote into (Gemma-style
loaders add 1 to a norm weight in place before copying it) and nothing
writes into the parameter afterwards. Values that reach a parameter any
other way (computed from a checkpoint tensor, a checkpoint tensor changed in
place, a parameter changed after its copy) make that checkpoint tensor a
*loader tensor*: the refit fetches the region of it the loader reads and
runs the engine's own loader on it (:attr:`LearnedLayout.via_loader`).
Writes reshard cannot attribute to any checkpoint tensor are reported, and
receivers refuse to plan with an incomplete layout instead of serving stale
weights.

Engine adapters differ only in how the parameters are laid out during the
dry run (vLLM swaps in meta parameters inside its layerwise reload; SGLang
keeps live ones) and call :func:`record_loads` with them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reshard.plan.box import Box, full_box, merge_boxes
from reshard.plan.layout import TensorMeta
from reshard.plan.specs import PieceSpec

if TYPE_CHECKING:
    import torch

__all__ = ["LOADER_PREFIX", "LearnedLayout", "ViaLoader", "local_box", "match_dims", "record_loads", "view_box"]


LOADER_PREFIX = "<loader>:"
"""Local name prefix of the buffer a loader tensor is received into
(``<loader>:model.norm.weight``)."""


@dataclass(frozen=True, slots=True)
class ViaLoader:
    """A checkpoint tensor the engine's loader transforms: the region of it
    the loader reads (fetched into a buffer of the tensor's shape, the rest
    zero) and the parameters it writes, with why."""

    tensor: TensorMeta
    region: Box
    params: tuple[str, ...]
    reason: str

    @property
    def local(self) -> str:
        return LOADER_PREFIX + self.tensor.name


@dataclass(slots=True)
class LearnedLayout:
    """What one engine worker keeps: pieces, and per parameter what is zeroed."""

    pieces: list[PieceSpec]
    local_shapes: dict[str, tuple[int, ...]]
    """Checkpoint-loading shape of every parameter that receives a piece (and
    the shape of every loader buffer)."""
    zero_fill: dict[str, list[Box]] = field(default_factory=dict)
    """Regions the loaders clear (vocab padding), by parameter."""
    layers: dict[str, list[str]] = field(default_factory=dict)
    """Parameter names by owning module name."""
    unsupported: list[str] = field(default_factory=list)
    """Writes reshard cannot follow (and why)."""
    uncovered: dict[str, int] = field(default_factory=dict)
    """Parameters whose loadable elements the pieces do not all cover (count missing)."""
    via_loader: dict[str, ViaLoader] = field(default_factory=dict)
    """Checkpoint tensors whose values reach parameters only through the
    engine's loader, by name; each is also a piece (its region, into the
    buffer :attr:`ViaLoader.local`)."""

    @property
    def loader_params(self) -> set[str]:
        """Parameters some loader tensor writes."""
        return {p for v in self.via_loader.values() for p in v.params}

    def whole(self) -> frozenset[str]:
        """Parameters the pieces tile exactly, every element written once:
        nothing in them needs zeroing before a refit writes them."""
        boxes: dict[str, list[Box]] = defaultdict(list)
        for p in self.pieces:
            boxes[p.local].append(local_box(p))
        out = set()
        for name, bs in boxes.items():
            shape = self.local_shapes.get(name)
            if shape is None or name.startswith(LOADER_PREFIX) or name in self.zero_fill:
                continue
            if sum(b.numel for b in bs) != _numel(shape):
                continue
            # Boxes that tile the whole tensor merge into it; overlapping ones never do.
            if merge_boxes(bs) == [full_box(shape)]:
                out.add(name)
        return frozenset(out - self.loader_params)

    def problems(self) -> list[str]:
        """Why a refit with this layout would leave stale weights (empty: none)."""
        out = [f"cannot follow this loader: {u}" for u in self.unsupported]
        out += [
            f"parameter {n!r}: {k} loadable elements are written by no checkpoint tensor"
            for n, k in self.uncovered.items()
        ]
        return out


def local_box(piece: PieceSpec) -> Box:
    """Where ``piece`` lands in its local tensor, as a box of it."""
    nd = len(piece.local_shape)
    offsets = tuple(piece.offset) or (0,) * nd
    sizes = [1] * nd
    dims = piece.dims or tuple(range(len(piece.box.sizes)))
    for g, d in enumerate(dims):
        sizes[d] = piece.box.sizes[g]
    return Box(offsets, tuple(sizes))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


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


_VALUE_FREE = frozenset(
    {
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
    }
)
"""Operators whose outputs take nothing from the input's values (only its shape)."""


class _Flow:
    """Where checkpoint values go during a dry run: which storages hold
    values computed from which checkpoint tensors, which checkpoint tensors
    were changed in place, and which regions of them computations read."""

    def __init__(self, ckpt: dict[int, TensorMeta]) -> None:
        self.ckpt = ckpt
        self.derived: dict[int, set[str]] = {}
        self.keep: list[Any] = []
        """Every derived tensor, alive until the dry run ends (a freed
        storage's id could be reused by an unrelated one)."""
        self.reads: dict[str, list[Box | None]] = defaultdict(list)
        self.changed: dict[str, str] = {}
        self.loader_writes: dict[str, set[str]] = defaultdict(set)

    def sources(self, t: Any, *, read: bool = True) -> set[str]:
        """The checkpoint tensors whose values ``t`` holds (recording the
        region read when ``t`` is a view of one)."""
        import torch

        if not isinstance(t, torch.Tensor):
            return set()
        k = _key(t)
        meta = self.ckpt.get(k)
        if meta is not None:
            if read:
                vb = view_box(int(t.storage_offset()), tuple(t.shape), tuple(t.stride()), meta.shape)
                self.reads[meta.name].append(vb[0] if vb is not None else None)
            return {meta.name}
        return set(self.derived.get(k, ()))

    def derive(self, t: Any, sources: set[str]) -> None:
        import torch

        if isinstance(t, torch.Tensor) and sources and _key(t) not in self.ckpt:
            self.derived.setdefault(_key(t), set()).update(sources)
            self.keep.append(t)

    def change(self, t: Any, why: str) -> bool:
        """Record a write into a checkpoint tensor; whether ``t`` is one."""
        meta = self.ckpt.get(_key(t))
        if meta is None:
            return False
        self.sources(t)
        self.changed.setdefault(meta.name, why)
        return True


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _written(func, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments ``func`` writes into (from its schema's alias annotations)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if v is not None:
                out.append(v)
    return out


def record_loads(
    params: dict[int, tuple[str, torch.Tensor]],
    layers: dict[str, list[str]],
    tensors: Iterable[TensorMeta],
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any],
    *,
    strict: bool,
    derived: Iterable[torch.Tensor] = (),
) -> LearnedLayout:
    """Run ``load(checkpoint tensors)`` on meta stand-ins for ``tensors`` and
    learn where each box lands, and which checkpoint tensors only reach the
    parameters through the loader's computations (see the module docstring).

    ``params`` maps a storage id to ``(parameter name, tensor)`` for every
    parameter the loaders may write, ``layers`` lists parameter names by
    module. ``strict``: the parameters are live (SGLang): no write into one
    runs, and any write that is not a copy is a loader reshard cannot follow;
    otherwise (vLLM's meta parameters) other writes run, and a parameter
    written again after its copy makes its checkpoint tensors loader tensors.
    ``derived``: tensors of the model that hold state derived from its
    parameters (non-persistent buffers, such as SGLang's ``gemma_weight``, a
    norm weight plus one): no write into them runs; one that carries
    checkpoint values makes those checkpoint tensors loader tensors, one
    computed from parameters is the engine's to refresh after a refit.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    metas = list(tensors)
    ckpt: dict[int, TensorMeta] = {}
    fakes = []
    for m in metas:
        t = torch.empty(m.shape, dtype=getattr(torch, m.dtype), device="meta")
        ckpt[_key(t)] = m
        fakes.append((m.name, t))

    flow = _Flow(ckpt)
    # (A buffer aliasing a parameter is that parameter.)
    derived_keys = {k: t for t in derived if (k := _key(t)) not in params}
    copies: list[tuple] = []
    fills: list[tuple] = []
    unsupported: list[str] = []
    param_changed: dict[str, str] = {}

    def geom(t: torch.Tensor) -> tuple:
        return (_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    class Recorder(TorchDispatchMode):
        """Follows every value out of the checkpoint tensors; records writes
        into parameters instead of performing them."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            schema = getattr(func, "_schema", None)
            if derived_keys and schema is not None and schema.is_mutable:
                written = [w for w in _written(func, args, kwargs) if isinstance(w, torch.Tensor)]
                if written and all(_key(w) in derived_keys for w in written):
                    sources: set[str] = set()
                    for a in tree_flatten((args, kwargs))[0]:
                        if isinstance(a, torch.Tensor) and _key(a) not in derived_keys:
                            sources |= flow.sources(a)
                    for n in sources:
                        flow.changed.setdefault(n, "its values reach derived state (a non-persistent buffer)")
                    return written[0]
            if func is torch.ops.aten.copy_.default:
                dst, src = args[0], args[1]
                entry = params.get(_key(dst))
                if entry is not None:
                    if isinstance(src, torch.Tensor) and _key(src) in ckpt:
                        copies.append((*geom(dst), *geom(src)))
                        return dst
                    sources = flow.sources(src)
                    if sources:
                        for n in sources:
                            flow.loader_writes[n].add(entry[0])
                        return dst
                    if strict or (isinstance(src, torch.Tensor) and src.is_meta):
                        what = "a live tensor" if strict and not getattr(src, "is_meta", False) else "a tensor"
                        unsupported.append(f"{entry[0]}: written from {what} no checkpoint tensor determines")
                        return dst
                elif not flow.change(dst, "written into by copy_"):
                    flow.derive(dst, flow.sources(src))
                return func(*args, **kwargs)
            if func in (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default):
                dst = args[0]
                if _key(dst) in params:
                    fills.append((*geom(dst), args[1] if len(args) > 1 else 0))
                    return dst
                flow.change(dst, f"filled by {func}")
                return func(*args, **kwargs)
            flat, _ = tree_flatten((args, kwargs))
            inputs = [a for a in flat if isinstance(a, torch.Tensor)]
            sources = set()
            for a in inputs:
                sources |= flow.sources(a, read=False)
            if schema is not None and schema.is_mutable:
                for w in _written(func, args, kwargs):
                    entry = params.get(_key(w)) if isinstance(w, torch.Tensor) else None
                    if entry is not None:
                        if strict:
                            # Any other in-place write into a live parameter is a loader we cannot follow.
                            unsupported.append(f"{entry[0]}: written by {func} (not a copy of a checkpoint box)")
                            return w
                        param_changed.setdefault(entry[0], f"written again by {func}")
                    elif not flow.change(w, f"changed in place by {func}"):
                        flow.derive(w, sources)
            out = func(*args, **kwargs)
            if sources and func.__name__.split(".")[0] not in _VALUE_FREE:
                # Outputs in storages of their own hold computed values (views
                # share their input's storage and are followed as they are).
                before = {_key(a) for a in inputs}
                new = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and _key(o) not in before]
                if new:
                    for a in inputs:
                        flow.sources(a)
                    for o in new:
                        flow.derive(o, sources)
            return out

    with Recorder(), torch.no_grad():
        load(iter(fakes))

    by_name = {m.name: m for m in metas}
    pieces: list[PieceSpec] = []
    local_shapes: dict[str, tuple[int, ...]] = {}
    covered: dict[str, int] = defaultdict(int)
    plain: list[tuple[str, TensorMeta, Box, Box, tuple[int, ...], tuple[int, ...], str]] = []
    for dkey, doff, dsz, dst_str, skey, soff, ssz, sst in copies:
        pname, p = params[dkey]
        src_meta = ckpt[skey]
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
        local_dtype = str(p.dtype).removeprefix("torch.")
        plain.append((pname, src_meta, sbox, dbox, lshape, dims, local_dtype))

    # Loader tensors: changed in place, computed on, or copied into a
    # parameter that is written again afterwards.
    reasons = dict(flow.changed)
    for n in flow.loader_writes:
        reasons.setdefault(n, "its values reach the parameters through the loader's computations")
    for pname, meta, *_ in plain:
        if pname in param_changed:
            reasons.setdefault(meta.name, f"{pname} is {param_changed[pname]} after its copy")
    for n in flow.reads:
        reasons.setdefault(n, "the loader computes on it")
    for pname, meta, sbox, dbox, lshape, dims, local_dtype in plain:
        if meta.name in reasons:
            flow.loader_writes[meta.name].add(pname)
            flow.reads[meta.name].append(sbox)
            continue
        local_shapes[pname] = lshape
        pieces.append(PieceSpec(meta, sbox, pname, lshape, dbox.offsets, dims, local_dtype))
        covered[pname] += sbox.numel
    via: dict[str, ViaLoader] = {}
    param_of = dict(params.values())
    for n in sorted(reasons, key=list(by_name).index):
        meta = by_name[n]
        written = tuple(sorted(flow.loader_writes.get(n, ())))
        region = _bounding(flow.reads.get(n, []), meta.shape)
        via[n] = v = ViaLoader(meta, region, written, reasons[n])
        if region.is_empty():
            continue
        local_shapes[v.local] = meta.shape
        pieces.append(PieceSpec(meta, region, v.local, meta.shape, region.offsets, (), meta.dtype))
        for pname in written:
            p = param_of[pname]
            local_shapes.setdefault(pname, tuple(p.shape))
            covered[pname] = getattr(p, "weight_loader_numel", p.numel())
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
        via_loader=via,
    )


def _bounding(boxes: list[Box | None], shape: tuple[int, ...]) -> Box:
    """The smallest box holding every box read (the whole tensor when one
    read is not a box)."""
    if not boxes or any(b is None for b in boxes):
        return full_box(shape)
    lo = [min(b.offsets[d] for b in boxes if b is not None) for d in range(len(shape))]
    hi = [max(b.offsets[d] + b.sizes[d] for b in boxes if b is not None) for d in range(len(shape))]
    return Box(tuple(lo), tuple(h - low for low, h in zip(lo, hi, strict=True)))
