"""Layouts: which boxes of which canonical tensors a rank holds or needs.

Wire types (msgspec Structs, frozen, versioned) and the helpers that read
them. A rank's :class:`Layout` has

- ``tensors``: a table of :class:`TensorMeta` (canonical name, global shape,
  dtype) that its pieces and grids index into;
- ``pieces``: explicit :class:`Piece` records, one box each;
- ``grids``: compact :class:`Grid` rules, "these tensors are cut on this
  device mesh and replicated along its other axes", which describe the
  pieces of every rank of the mesh at once, so a rank's layout for a model
  with tens of thousands of tensors stays small.

Every rank of a grid's mesh must publish the same grid (the planner checks
this); planning then reasons on the grid by arithmetic instead of on one
piece per rank and tensor.

Local storage: a piece's box of the global tensor lands in a local tensor at
``offset``; ``dims[i]`` names the local dim that global dim ``i`` runs along
(``()``: the same dims). Local dims not named have extent 1 in the piece, so
an expert stack ``w13[e, rows, cols]`` holds ``gate_proj`` of expert ``e``
with ``offset=(e, 0, 0)`` and ``dims=(1, 2)``.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterator, Sequence
from functools import cached_property, lru_cache

import msgspec

from reshard.plan.box import Box, chunk_range

__all__ = [
    "DTYPE_SIZES",
    "FLOAT_DTYPES",
    "LAYOUT_VERSION",
    "Grid",
    "GridInfo",
    "Layout",
    "LocalTensor",
    "Mesh",
    "Piece",
    "Slot",
    "TensorMeta",
    "cast_ok",
    "clear_caches",
    "dtype_size",
    "grid_box",
    "layout_digest",
    "storage_offset",
    "table_digest",
    "zeros",
]

LAYOUT_VERSION = 1

# Element sizes by torch dtype name; the planner never imports torch.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}


FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
"""Dtypes a destination may keep a tensor in when the source holds another
one of them: the receiver casts on arrival, as an engine's own loader does
(``param.copy_(loaded_weight)``). Casts to or from integer and float8 types
(which need scales) are refused."""


def cast_ok(src: str, dst: str) -> bool:
    """Can bytes of dtype ``src`` be received into a tensor of dtype ``dst``?"""
    return src == dst or (src in FLOAT_DTYPES and dst in FLOAT_DTYPES)


def dtype_size(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}") from None


class TensorMeta(msgspec.Struct, frozen=True, array_like=True):
    """A canonical tensor: checkpoint name, global shape, dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return DTYPE_SIZES[self.dtype] * math.prod(self.shape) if self.dtype in DTYPE_SIZES else dtype_size(self.dtype)


class LocalTensor(msgspec.Struct, frozen=True, array_like=True):
    """A tensor in a rank's memory that pieces land in (or are read from).

    ``dtype``: its element type (``""``: the dtype of the canonical tensors
    stored in it). A source local always has its tensors' dtype; a
    destination local may keep another floating-point dtype, and the
    receiver casts what arrives (see :func:`cast_ok`).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = ""


class Piece(msgspec.Struct, frozen=True, array_like=True):
    """Box ``box`` of tensor ``tensors[tensor]`` stored in ``locals[local]``.

    ``offset`` is where the box's origin sits in the local tensor, in local
    coordinates; ``dims`` maps global dims to local dims (``()``: identity).
    """

    tensor: int
    box: Box
    local: int
    offset: tuple[int, ...]
    dims: tuple[int, ...] = ()


class Mesh(msgspec.Struct, frozen=True, array_like=True):
    """Ranks arranged on an n-dimensional mesh, row-major.

    Either an explicit rank list, or affine: ``start + sum(coord * stride)``
    (``strides`` default to contiguous row-major), which keeps the meshes of
    large jobs a few integers long.
    """

    shape: tuple[int, ...]
    ranks: tuple[int, ...] = ()
    start: int = 0
    strides: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def rank_at(self, coord: Sequence[int]) -> int:
        if self.ranks:
            idx = 0
            for c, s in zip(coord, self.shape, strict=True):
                idx = idx * s + c
            return self.ranks[idx]
        strides = self.strides or _row_major(self.shape)
        return self.start + sum(c * st for c, st in zip(coord, strides, strict=True))

    def all_ranks(self) -> list[int]:
        return [self.rank_at(c) for c in itertools.product(*(range(s) for s in self.shape))]


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


class Grid(msgspec.Struct, frozen=True, kw_only=True):
    """Tensors ``tensors[start:stop:step]`` cut on ``mesh``.

    ``shard[d]`` lists the mesh axes that cut global dim ``d``, outermost
    first (``()``: not cut). Several axes on one dim nest: the outer axis
    picks a chunk, the next axis cuts that chunk, and so on (DTensor's order
    for ``(Shard(0), Shard(0))``; FSDP2 over TP is the TP axis outermost).
    Mesh axes that cut no dim replicate. ``block[d]`` overrides the block
    size of a dim cut by a single axis (0: ``torch.chunk``).

    Local storage: ``local`` is ``None`` when each tensor's chunk is its own
    local tensor named like the tensor (the FSDP/TP case); otherwise all
    chunks land in that local tensor, the ``i``-th tensor of the range at
    ``offset + i * step`` with dims mapped by ``dims``.
    """

    tensors: tuple[int, int, int]
    mesh: Mesh
    shard: tuple[tuple[int, ...], ...]
    block: tuple[int, ...] = ()
    local: LocalTensor | None = None
    offset: tuple[int, ...] = ()
    step: tuple[int, ...] = ()
    dims: tuple[int, ...] = ()

    def tensor_indices(self) -> range:
        return range(*self.tensors)


class Layout(msgspec.Struct, frozen=True, kw_only=True):
    """All pieces one rank holds (a source) or needs (a destination)."""

    rank: int
    tensors: tuple[TensorMeta, ...]
    locals: tuple[LocalTensor, ...] = ()
    pieces: tuple[Piece, ...] = ()
    grids: tuple[Grid, ...] = ()
    version: int = LAYOUT_VERSION


def table_digest(tensors: Sequence[TensorMeta]) -> str:
    """A content id for a tensor table (layouts that share it share grids)."""
    return hashlib.blake2b(msgspec.msgpack.encode(tuple(tensors)), digest_size=16).hexdigest()


def layout_digest(layout: Layout, *, table: str | None = None) -> str:
    """A content id for everything a rank publishes (a plan depends on nothing
    else of it): equal digests on every rank mean a cached plan still holds.
    ``table``: the table's digest, when known."""
    table = table or table_digest(layout.tensors)
    body = (layout.rank, table, layout.locals, layout.pieces, layout.grids)
    return hashlib.blake2b(msgspec.msgpack.encode(body), digest_size=16).hexdigest()


def grid_box(grid: Grid, shape: Sequence[int], coord: Sequence[int]) -> Box:
    """The box of a tensor of ``shape`` held at mesh ``coord`` of ``grid``."""
    offs = []
    sizes = []
    for d, n in enumerate(shape):
        axes = grid.shard[d] if d < len(grid.shard) else ()
        lo, hi = 0, n
        if len(axes) == 1:
            blk = grid.block[d] if grid.block else 0
            lo, hi = chunk_range(n, grid.mesh.shape[axes[0]], coord[axes[0]], blk)
        else:
            for a in axes:
                sub_lo, sub_hi = chunk_range(hi - lo, grid.mesh.shape[a], coord[a])
                lo, hi = lo + sub_lo, lo + sub_hi
        offs.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offs), tuple(sizes))


class Slot(msgspec.Struct, frozen=True, gc=False):
    """One piece resolved to names: rank ``rank`` holds ``box`` of a tensor
    in local tensor ``local`` (shape ``local_shape``, element type ``dtype``)
    at ``offset``.

    A Struct, not a dataclass: a plan holds two per transfer (tens of
    thousands per rank), and a Struct is built ten times faster. ``gc=False``:
    it holds only numbers, strings and boxes, so it can be in no cycle and the
    cyclic collector need not track it.
    """

    rank: int
    box: Box
    local: str
    local_shape: tuple[int, ...]
    offset: tuple[int, ...]
    dims: tuple[int, ...] = ()
    dtype: str = ""

    def local_box(self, box: Box) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(offsets, sizes)`` in the local tensor of global ``box`` (inside this slot)."""
        nd = len(self.local_shape)
        dims = self.dims or tuple(range(box.ndim))
        offs = list(self.offset) if self.offset else [0] * nd
        sizes = [1] * nd
        for g, l in enumerate(dims):
            offs[l] += box.offsets[g] - self.box.offsets[g]
            sizes[l] = box.sizes[g]
        return tuple(offs), tuple(sizes)

    def axes(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """How a local view of a box relates to the box in global dim order.

        Returns ``(kept, to_global, to_local)``: ``kept`` are the local dims
        that carry global dims (in local order; the others have extent 1);
        a view squeezed to ``kept`` and permuted by ``to_global`` is in global
        order, and a global-order array permuted by ``to_local`` is in the
        order of ``kept``.
        """
        ndim = len(self.box.offsets)
        dims = self.dims or tuple(range(ndim))
        kept = tuple(sorted(dims))
        to_global = tuple(kept.index(d) for d in dims)
        to_local = tuple(dims.index(k) for k in kept)
        return kept, to_global, to_local

    def is_plain(self) -> bool:
        """Global dims map to the same local dims (no transpose, no stacking)."""
        return not self.dims or (self.dims == tuple(range(len(self.dims))) and len(self.dims) == len(self.local_shape))


@lru_cache(maxsize=64)
def zeros(n: int) -> tuple[int, ...]:
    """``(0,) * n``, shared (offsets of boxes at the origin)."""
    return (0,) * n


@lru_cache(maxsize=4096)
def _mesh_index(mesh: Mesh) -> tuple[list[tuple[int, ...]], list[int], dict[int, list[tuple[int, ...]]]]:
    """Coordinates, ranks and coordinates by rank of a mesh (shared by all grids on it)."""
    coords = list(itertools.product(*(range(s) for s in mesh.shape)))
    ranks = [mesh.rank_at(c) for c in coords]
    coord_of: dict[int, list[tuple[int, ...]]] = {}
    for r, c in zip(ranks, coords, strict=True):
        coord_of.setdefault(r, []).append(c)
    return coords, ranks, coord_of


@lru_cache(maxsize=4096)
def _mesh_rank_set(mesh: Mesh) -> frozenset[int]:
    return frozenset(_mesh_index(mesh)[1])


Group = tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, ...], ...]]
"""Ranks of a mesh that agree on the cut axes (so hold one box): (a coord, ranks, coords)."""


@lru_cache(maxsize=4096)
def _mesh_groups(mesh: Mesh, cut_axes: tuple[int, ...]) -> tuple[Group, ...]:
    """The mesh's ranks grouped by their coordinates on ``cut_axes``, sorted by
    rank within a group. Shared by every grid on the mesh that cuts those axes
    (an engine's hundreds of grids share a handful), so a grid's holders cost
    one box per group, not one step per rank."""
    coords, ranks, _ = _mesh_index(mesh)
    groups: dict[tuple[int, ...], list[tuple[int, tuple[int, ...]]]] = {}
    for r, c in zip(ranks, coords, strict=True):
        groups.setdefault(tuple(c[a] for a in cut_axes), []).append((r, c))
    out = []
    for members in groups.values():
        first = members[0][1]
        members.sort()
        out.append((first, tuple(r for r, _ in members), tuple(c for _, c in members)))
    return tuple(out)


@lru_cache(maxsize=1024)
def _axes(shard: tuple[tuple[int, ...], ...], ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(cut axes, replicated axes) of a mesh of ``ndim`` axes cut by ``shard``."""
    cut = {a for axes in shard for a in axes}
    return tuple(sorted(cut)), tuple(a for a in range(ndim) if a not in cut)


def clear_caches() -> None:
    """Forget the mesh indexes shared by grids (all planners of a process
    share them). For measuring a rank's planning as a fresh process would."""
    _mesh_index.cache_clear()
    _mesh_rank_set.cache_clear()
    _mesh_groups.cache_clear()


class GridInfo:
    """Derived facts of one grid: coordinates by rank, holder boxes by shape."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        mesh = grid.mesh
        self.coords, self.ranks, self.coord_of = _mesh_index(mesh)
        self.cut_axes, self.rep_axes = _axes(grid.shard, len(mesh.shape))

    @property
    def rank_set(self) -> frozenset[int]:
        return _mesh_rank_set(self.grid.mesh)

    @property
    def distinct_ranks(self) -> bool:
        """No rank appears at two coordinates (so each rank holds one box)."""
        return len(self.coord_of) == len(self.ranks)

    @cached_property
    def geometry(self) -> tuple:
        """Mesh and cuts: everything about the grid that planning depends on."""
        g = self.grid
        return (g.mesh, g.shard, g.block)

    def groups(self) -> tuple[Group, ...]:
        """Ranks grouped by the box they hold (see :func:`_mesh_groups`)."""
        return _mesh_groups(self.grid.mesh, self.cut_axes)

    def holders(self, shape: Sequence[int]) -> Iterator[tuple[Box, tuple[int, ...], tuple[tuple[int, ...], ...]]]:
        """Distinct boxes with the ranks (and coords) that hold each, non-empty only."""
        for first, ranks, coords in _mesh_groups(self.grid.mesh, self.cut_axes):
            box = grid_box(self.grid, shape, first)
            if not box.is_empty():
                yield box, ranks, coords

    def slot(self, meta: TensorMeta, position: int, rank: int, coord: Sequence[int], box: Box | None = None) -> Slot:
        if box is None:
            box = grid_box(self.grid, meta.shape, coord)
        st = self.storage
        if st is None:
            return Slot(rank, box, meta.name, box.sizes, zeros(len(meta.shape)), (), meta.dtype)
        return Slot(rank, box, st[0], st[1], storage_offset(st, position), st[2], st[3] or meta.dtype)

    def offset(self, position: int) -> tuple[int, ...]:
        """Local offset of the chunk of the ``position``-th tensor (shared locals only)."""
        storage = self.storage
        if storage is None:
            raise ValueError("a grid without a shared local tensor has no local offsets")
        return storage_offset(storage, position)

    @cached_property
    def storage(self) -> tuple | None:
        """Where the grid's tensors are stored, as plain values to build slots
        from fast: ``(local name, local shape, dims, local dtype, base offset,
        step, only the leading dim steps)``; ``None`` when each tensor's chunk
        is its own local tensor (see :meth:`slot`)."""
        g = self.grid
        local = g.local
        if local is None:
            return None
        nd = len(local.shape)
        step = g.step
        return (local.name, local.shape, g.dims, local.dtype, g.offset or zeros(nd), step, step[1:] == zeros(nd - 1))


def storage_offset(storage: tuple, position: int) -> tuple[int, ...]:
    """Where the ``position``-th tensor of a grid starts in its shared local
    tensor, from :attr:`GridInfo.storage`."""
    base, step = storage[4], storage[5]
    if not step or not position:
        return base
    if storage[6]:  # expert stacks: only the leading dim moves
        return (base[0] + position * step[0], *base[1:])
    return tuple(b + position * s for b, s in zip(base, step, strict=True))
