"""Hypothesis strategies: random global tensors and random source and
destination layouts (uneven, multi-dim, replicated, fused, interleaved,
stacked, transposed, grids and explicit pieces), as per-rank Layouts."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hypothesis import strategies as st

from reshard.plan.box import Box
from reshard.plan.layout import Grid, Layout, LocalTensor, Mesh, Piece, TensorMeta

DTYPES = ["float32", "bfloat16", "int8", "float16", "float8_e4m3fn"]


@dataclass
class Problem:
    table: tuple[TensorMeta, ...]
    src: list[Layout]
    dst: list[Layout]
    domain_of: dict[int, int]
    dropped: list[tuple[str, Box]] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted({lay.rank for lay in self.src} | {lay.rank for lay in self.dst})


@dataclass
class _Side:
    ranks: list[int]
    pieces: dict[int, list[tuple[int, Box]]] = field(default_factory=dict)
    grids: list[Grid] = field(default_factory=list)


def _partition(draw, shape: tuple[int, ...]) -> list[Box]:
    """A random grid partition of the whole tensor (uneven cuts, empty dims allowed)."""
    per_dim = []
    for n in shape:
        k = draw(st.integers(0, min(3, max(n - 1, 0))))
        cuts = sorted(draw(st.sets(st.integers(1, max(n - 1, 1)), min_size=k, max_size=k))) if n > 1 else []
        edges = [0, *cuts, n]
        per_dim.append([(a, b - a) for a, b in itertools.pairwise(edges) if b > a] or [(0, n)])
    return [Box(tuple(o for o, _ in combo), tuple(s for _, s in combo)) for combo in itertools.product(*per_dim)]


def _mesh_for(draw, ranks: list[int]) -> Mesh:
    n = len(ranks)
    shapes = [(n,)]
    for a in range(2, n):
        if n % a == 0:
            shapes.append((a, n // a))
    shape = draw(st.sampled_from(shapes))
    order = draw(st.permutations(ranks))
    if list(order) == list(range(order[0], order[0] + n)) and draw(st.booleans()):
        return Mesh(shape=shape, start=order[0])
    return Mesh(shape=shape, ranks=tuple(order))


def _shard_spec(draw, ndim: int, mesh_ndim: int) -> tuple[tuple[int, ...], ...]:
    axes = list(range(mesh_ndim))
    spec: list[list[int]] = [[] for _ in range(ndim)]
    if ndim:
        for a in axes:
            if draw(st.booleans()):
                spec[draw(st.integers(0, ndim - 1))].append(a)
    for s in spec:
        if len(s) > 1 and draw(st.booleans()):
            s.reverse()
    return tuple(tuple(s) for s in spec)


@st.composite
def problems(draw, *, allow_drop: bool = False, max_ranks: int = 4) -> Problem:
    table: list[TensorMeta] = []
    groups: list[tuple[int, int]] = []  # (start, count) of same-shape tensors
    for g in range(draw(st.integers(1, 3))):
        ndim = draw(st.integers(0, 4))
        shape = tuple(draw(st.integers(1, 7 if ndim <= 2 else 4)) for _ in range(ndim))
        dtype = draw(st.sampled_from(DTYPES))
        k = draw(st.integers(1, 3))
        groups.append((len(table), k))
        table.extend(TensorMeta(f"model.g{g}.t{i}.weight", shape, dtype) for i in range(k))
    n_src = draw(st.integers(1, max_ranks))
    n_dst = draw(st.integers(1, max_ranks))
    src = _Side(list(range(n_src)))
    dst = _Side(list(range(n_src, n_src + n_dst)))
    dropped: list[tuple[str, Box]] = []
    stacked_grid_groups: set[int] = set()
    for gi, (start, k) in enumerate(groups):
        shape = table[start].shape
        for side in (src, dst):
            mode = draw(st.sampled_from(["grid", "pieces"]))
            if mode == "grid":
                mesh_ranks = draw(st.lists(st.sampled_from(side.ranks), min_size=1, unique=True))
                mesh = _mesh_for(draw, sorted(mesh_ranks))
                spec = _shard_spec(draw, len(shape), len(mesh.shape))
                block: tuple[int, ...] = ()
                if len(shape) and draw(st.booleans()):
                    block = tuple(
                        (-(-n // mesh.shape[s[0]]) + draw(st.integers(0, 2))) if len(s) == 1 else 0
                        for n, s in zip(shape, spec, strict=True)
                    )
                local = None
                offset: tuple[int, ...] = ()
                step: tuple[int, ...] = ()
                dims: tuple[int, ...] = ()
                if side is dst and k > 1 and draw(st.booleans()):
                    # Expert-stack style: all tensors of the group stacked in one local
                    # tensor (as large as the whole tensor, so any chunk fits at the origin).
                    local = LocalTensor(f"gridstack{gi}", (k, *shape))
                    offset = (0,) * (len(shape) + 1)
                    step = (1,) + (0,) * len(shape)
                    dims = tuple(range(1, len(shape) + 1))
                    stacked_grid_groups.add(gi)
                grid = Grid(
                    tensors=(start, start + k, 1),
                    mesh=mesh,
                    shard=spec,
                    block=block,
                    local=local,
                    offset=offset,
                    step=step,
                    dims=dims,
                )
                side.grids.append(grid)
            else:
                for ti in range(start, start + k):
                    boxes = _partition(draw, shape)
                    for b in boxes:
                        if side is src:
                            owners = draw(st.lists(st.sampled_from(side.ranks), min_size=1, max_size=2, unique=True))
                            if allow_drop and draw(st.integers(0, 9)) == 0:
                                dropped.append((table[ti].name, b))
                                continue
                        else:
                            owners = draw(st.lists(st.sampled_from(side.ranks), min_size=0, max_size=2, unique=True))
                        for r in owners:
                            side.pieces.setdefault(r, []).append((ti, b))
    tab = tuple(table)
    src_layouts = [_layout(draw, tab, r, src, pack=False) for r in src.ranks]
    dst_layouts = [_layout(draw, tab, r, dst, pack=True) for r in dst.ranks]
    all_ranks = src.ranks + dst.ranks
    n_dom = draw(st.integers(1, 3))
    domain_of = {r: draw(st.integers(0, n_dom - 1)) for r in all_ranks}
    return Problem(tab, src_layouts, dst_layouts, domain_of, dropped)


def _layout(draw, table: tuple[TensorMeta, ...], rank: int, side: _Side, *, pack: bool) -> Layout:
    grids = tuple(g for g in side.grids if rank in g.mesh.all_ranks())
    items = side.pieces.get(rank, [])
    locals_: list[LocalTensor] = []
    pieces: list[Piece] = []

    def own(ti: int, b: Box) -> None:
        locals_.append(LocalTensor(f"{table[ti].name}#{len(locals_)}", b.sizes))
        pieces.append(Piece(ti, b, len(locals_) - 1, (0,) * b.ndim))

    remaining = list(items)
    while remaining:
        ti, b = remaining.pop(0)
        mode = draw(st.sampled_from(["own", "concat", "stack", "transpose"])) if pack else "own"
        if mode == "transpose" and b.ndim == 2:
            locals_.append(LocalTensor(f"T{len(locals_)}", (b.sizes[1], b.sizes[0])))
            pieces.append(Piece(ti, b, len(locals_) - 1, (0, 0), (1, 0)))
        elif mode == "concat" and b.ndim >= 1:
            mates = [
                (t2, b2)
                for t2, b2 in remaining
                if b2.ndim == b.ndim and b2.sizes[1:] == b.sizes[1:] and table[t2].dtype == table[ti].dtype
            ][:2]
            for m in mates:
                remaining.remove(m)
            group = [(ti, b), *mates]
            parts = draw(st.integers(1, 2))
            # Interleave: each box cut into row groups, laid out group-major.
            rows_total = sum(x.sizes[0] for _, x in group)
            locals_.append(LocalTensor(f"fused{len(locals_)}", (rows_total, *b.sizes[1:])))
            li = len(locals_) - 1
            row = 0
            for p in range(parts):
                for t2, b2 in group:
                    lo = b2.sizes[0] * p // parts
                    hi = b2.sizes[0] * (p + 1) // parts
                    if hi <= lo:
                        continue
                    sub = Box((b2.offsets[0] + lo, *b2.offsets[1:]), (hi - lo, *b2.sizes[1:]))
                    pieces.append(Piece(t2, sub, li, (row,) + (0,) * (b.ndim - 1)))
                    row += hi - lo
        elif mode == "stack":
            # One local holds one dtype (a layout with several is refused).
            mates = [(t2, b2) for t2, b2 in remaining if b2.sizes == b.sizes and table[t2].dtype == table[ti].dtype][:2]
            for m in mates:
                remaining.remove(m)
            group = [(ti, b), *mates]
            locals_.append(LocalTensor(f"stack{len(locals_)}", (len(group), *b.sizes)))
            li = len(locals_) - 1
            for i, (t2, b2) in enumerate(group):
                pieces.append(Piece(t2, b2, li, (i,) + (0,) * b.ndim, tuple(range(1, b.ndim + 1))))
        else:
            own(ti, b)
    return Layout(rank=rank, tensors=table, locals=tuple(locals_), pieces=tuple(pieces), grids=grids)
