"""The planner: who sends which box of which tensor to whom, in which round.

Pure Python over layouts: no process group, no engine, no torch. Every rank
runs the same code on the same layouts and reaches the same global
decisions (which replica sends, which rank leads in a domain, which round a
byte moves in), so no coordinator is needed and any two peers agree on what
passes between them.

How a plan is made
==================

1. **Families.** Destination tensors are grouped by (shape, dtype, the grids
   and explicit pieces that hold them on the source side, and those that
   need them on the destination side). The 256 experts of a MoE layer, or
   the 80 ``o_proj`` of a dense model, form one family each: the geometry
   is worked out once per family, not once per tensor.
2. **Resolve** (per family and destination domain). The boxes needed by the
   domain's ranks and the boxes held by sources cut the tensor into cells;
   cells needed and held by the same ranks form a region. A region that a
   source inside the domain holds is pulled from there (over NVLink, or
   copied locally when the needer holds it itself); otherwise one **leader**
   among the needers pulls it across the network once and **forwards** it to
   the other needers in the next round. Large regions are split so several
   replicas and leaders share them.
3. **Decide.** Replica and leader choices rotate with the tensor's ordinal,
   the region, the part and the domain: deterministic everywhere and
   balanced over many tensors.
4. **Rounds.** Tensors in canonical (natural name) order are cut into row
   blocks and packed into rounds of at most ``round_bytes`` of tensor data;
   a transfer moves in the round of its block, a forward one round after
   its pull. Round numbers depend only on names, shapes and dtypes, so every
   pair of peers agrees on them.
"""

from __future__ import annotations

import gc
import itertools
import math
import re
from bisect import bisect_left
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from msgspec.structs import replace

from reshard.errors import PlanError, Problem
from reshard.plan.box import Box, chunk_range, merge_boxes
from reshard.plan.layout import (
    Grid,
    GridInfo,
    Layout,
    Slot,
    TensorMeta,
    _zeros,
    cast_ok,
    dtype_size,
    grid_box,
    table_digest,
)

__all__ = [
    "DEFAULT_ROUND_BYTES",
    "DEFAULT_SPLIT_BYTES",
    "LayoutSet",
    "Planner",
    "RankPlan",
    "Round",
    "RoundTable",
    "Traffic",
    "Transfer",
    "natural_key",
]

DEFAULT_ROUND_BYTES = 128 << 20
DEFAULT_SPLIT_BYTES = 16 << 20

_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple:
    """``layers.2`` sorts before ``layers.10``: checkpoint order, layer by layer."""
    return tuple(int(t) if t.isdigit() else t for t in _DIGITS.split(name))


@contextmanager
def gc_paused():
    """Pause the cyclic garbage collector while planning.

    Planning allocates many small, acyclic objects; with tens of thousands of
    tensors alive, generation-2 collections triggered by those allocations
    cost more than the planning itself (measured: 2.5x on DeepSeek-V3).
    Nothing made here is cyclic, so reference counting frees it all.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


_EMPTY: list = []

# A reference to where a piece lives, resolved to a Slot per tensor:
# ("g", grid index, coord) for a grid, ("s", Slot) for an explicit piece.
Ref = tuple


class LayoutSet:
    """One side's layouts (all sources, or all destinations), indexed by tensor.

    Grids published by several ranks are kept once; each must be published
    by exactly the ranks of its mesh.
    """

    def __init__(self, role: str, *, check_ranks: Iterable[int] | None = None) -> None:
        self.role = role
        self.check_ranks: frozenset[int] | None = None if check_ranks is None else frozenset(check_ranks)
        self.metas: dict[str, TensorMeta] = {}
        self.declared_by: dict[str, int] = {}
        self.grids: list[GridInfo] = []
        self.grid_names: list[list[str]] = []
        self._grid_ids: dict[tuple[str, Grid], int] = {}
        self._grid_content: dict[tuple, int] = {}
        self._publishers: list[set[int] | None] = []
        self.tensor_grids: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.tensor_slots: dict[str, list[Slot]] = defaultdict(list)
        self.ranks: set[int] = set()
        self.problems: list[Problem] = []
        self._digests: dict[int, str] = {}
        self._geometry_ids: dict[tuple, int] = {}
        self._geo_of_grid: list[int] = []

    # -- building ---------------------------------------------------------

    @classmethod
    def from_layouts(
        cls, role: str, layouts: Iterable[Layout], *, check_ranks: Iterable[int] | None = None
    ) -> LayoutSet:
        """Index layouts; ``check_ranks`` limits the per-rank storage checks to
        those ranks (a rank checks the pieces it reads or writes itself; the
        status exchange shares what each rank found)."""
        s = cls(role, check_ranks=check_ranks)
        with gc_paused():
            for lay in layouts:
                s.add_layout(lay)
            s.finish()
        return s

    def _declare(self, meta: TensorMeta, rank: int) -> bool:
        old = self.metas.get(meta.name)
        if old is meta:
            return True
        if old is None:
            self.metas[meta.name] = meta
            self.declared_by[meta.name] = rank
            return True
        if old != meta:
            self.problems.append(
                Problem(
                    kind="mismatch",
                    tensor=meta.name,
                    ranks=(self.declared_by[meta.name], rank),
                    message=(
                        f"{self.role} ranks disagree on tensor {meta.name!r}: rank "
                        f"{self.declared_by[meta.name]} says shape {list(old.shape)} {old.dtype}, "
                        f"rank {rank} says shape {list(meta.shape)} {meta.dtype}"
                    ),
                )
            )
            return False
        return True

    def add_layout(self, layout: Layout) -> None:
        rank = layout.rank
        self.ranks.add(rank)
        key = id(layout.tensors)
        digest = self._digests.get(key)
        if digest is None:
            digest = self._digests[key] = table_digest(layout.tensors)
        for meta in layout.tensors:
            self._declare(meta, rank)
        for grid in layout.grids:
            self._add_grid(digest, layout.tensors, grid, publisher=rank)
        for i, p in enumerate(layout.pieces):
            self._add_piece(layout, i, p)

    def add_grid(self, tensors: Sequence[TensorMeta], grid: Grid) -> None:
        """Add a grid that speaks for all its ranks (no per-rank publication)."""
        first = grid.mesh.rank_at((0,) * len(grid.mesh.shape))
        for meta in tensors[slice(*grid.tensors)]:
            self._declare(meta, first)
        self._add_grid(None, tensors, grid, publisher=None)

    def _add_grid(self, digest: str | None, tensors: Sequence[TensorMeta], grid: Grid, publisher: int | None) -> None:
        key = (digest or f"direct:{len(self.grids)}", grid)
        gid = self._grid_ids.get(key)
        if gid is None and digest is not None:
            # Ranks whose tables differ (each holds other experts, say) still
            # publish the same grid: match it by the tensors it names.
            rng = grid.tensor_indices()
            content = (tuple(tensors[rng.start : rng.stop : rng.step]), replace(grid, tensors=(0, 0, 1)))
            gid = self._grid_content.get(content)
            if gid is None:
                self._grid_content[content] = len(self.grids)
            else:
                self._grid_ids[key] = gid
        if gid is None:
            gid = len(self.grids)
            self._grid_ids[key] = gid
            info = GridInfo(grid)
            self.grids.append(info)
            self._publishers.append(set() if publisher is not None else None)
            names = []
            rng = grid.tensor_indices()
            if rng.start < 0 or rng.stop > len(tensors) or rng.step <= 0:
                self.problems.append(
                    Problem(
                        kind="layout",
                        message=f"{self.role} grid refers to tensors {grid.tensors} of a table of {len(tensors)}",
                        ranks=(publisher,) if publisher is not None else (),
                    )
                )
                rng = range(0)
            for pos, ti in enumerate(rng):
                meta = tensors[ti]
                names.append(meta.name)
                if self.metas.get(meta.name) == meta:  # else a disagreement _declare reported
                    self.tensor_grids[meta.name].append((gid, pos))
            self.grid_names.append(names)
            self.ranks.update(info.ranks)
            self._check_grid(info, [tensors[i] for i in rng])
        pubs = self._publishers[gid]
        if pubs is not None and publisher is not None:
            pubs.add(publisher)

    def _check_grid(self, info: GridInfo, metas: list[TensorMeta]) -> None:
        g = info.grid
        nd_mesh = len(g.mesh.shape)
        for meta in metas[:1] + metas[-1:]:
            ndim = len(meta.shape)
            bad_axes = [a for axes in g.shard for a in axes if not 0 <= a < nd_mesh]
            if len(g.shard) != ndim or bad_axes:
                self.problems.append(
                    Problem(
                        kind="layout",
                        tensor=meta.name,
                        message=(
                            f"{self.role} grid for {meta.name!r} (shape {list(meta.shape)}) has shard spec "
                            f"{g.shard} on a mesh of shape {list(g.mesh.shape)}"
                        ),
                    )
                )
                return
            if g.local is None:
                continue
            pos = metas.index(meta)
            for r, c in zip(info.ranks, info.coords, strict=True):
                if self.check_ranks is not None and r not in self.check_ranks:
                    continue
                slot = info.slot(meta, pos, r, c)
                self._check_slot(meta, slot, None)

    def _add_piece(self, layout: Layout, index: int, p) -> None:
        rank = layout.rank
        if not 0 <= p.tensor < len(layout.tensors) or not 0 <= p.local < len(layout.locals):
            self.problems.append(
                Problem(
                    kind="layout",
                    ranks=(rank,),
                    message=f"{self.role} rank {rank} piece {index} refers to tensor {p.tensor} / local {p.local} "
                    f"outside its tables ({len(layout.tensors)} tensors, {len(layout.locals)} locals)",
                )
            )
            return
        meta = layout.tensors[p.tensor]
        if self.metas.get(meta.name) != meta:
            return  # this rank disagrees on the tensor (reported by _declare): its boxes do not fit
        loc = layout.locals[p.local]
        slot = Slot(
            rank, p.box, loc.name, loc.shape, p.offset or (0,) * len(loc.shape), p.dims, loc.dtype or meta.dtype
        )
        if self._check_slot(meta, slot, rank):
            self.tensor_slots[meta.name].append(slot)

    def _check_slot(self, meta: TensorMeta, slot: Slot, rank: int | None) -> bool:
        ranks = (slot.rank,)
        if not slot.box.within(meta.shape):
            self.problems.append(
                Problem(
                    kind="out-of-range",
                    tensor=meta.name,
                    ranks=ranks,
                    message=f"{self.role} rank {slot.rank}: box {slot.box} is outside tensor {meta.name!r} "
                    f"of shape {list(meta.shape)}",
                )
            )
            return False
        dims = slot.dims or tuple(range(len(meta.shape)))
        nd = len(slot.local_shape)
        if len(dims) != len(meta.shape) or len(set(dims)) != len(dims) or any(not 0 <= d < nd for d in dims):
            self.problems.append(
                Problem(
                    kind="layout",
                    tensor=meta.name,
                    ranks=ranks,
                    message=f"{self.role} rank {slot.rank}: dims {slot.dims} of {meta.name!r} do not map "
                    f"{len(meta.shape)} global dims into local {slot.local!r} of shape {list(slot.local_shape)}",
                )
            )
            return False
        offs, sizes = slot.local_box(slot.box)
        if len(slot.offset) != nd or not all(
            o >= 0 and o + s <= n for o, s, n in zip(offs, sizes, slot.local_shape, strict=True)
        ):
            self.problems.append(
                Problem(
                    kind="out-of-range",
                    tensor=meta.name,
                    ranks=ranks,
                    message=f"{self.role} rank {slot.rank}: box {slot.box} of {meta.name!r} lands at "
                    f"{list(offs)} size {list(sizes)}, outside local {slot.local!r} of shape {list(slot.local_shape)}",
                )
            )
            return False
        return True

    def finish(self) -> None:
        for gid, pubs in enumerate(self._publishers):
            if pubs is None:
                continue
            expected = self.grids[gid].rank_set
            if pubs != expected:
                names = self.grid_names[gid]
                self.problems.append(
                    Problem(
                        kind="grid",
                        tensor=names[0] if names else "",
                        ranks=tuple(sorted(pubs ^ expected)),
                        message=(
                            f"{self.role} grid for {len(names)} tensor(s) starting {names[:1]} lists ranks "
                            f"{sorted(expected)} but was published by ranks {sorted(pubs)}"
                        ),
                    )
                )
        self._check_local_overlaps()

    def _check_local_overlaps(self) -> None:
        """Two pieces of one rank that write the same local elements."""
        if self.role != "destination":
            return
        by_local: dict[tuple[int, str], list[tuple[tuple[int, ...], tuple[int, ...], str]]] = defaultdict(list)
        shapes: dict[tuple[int, str], tuple[int, ...]] = {}

        def add(slot: Slot, box: Box, name: str) -> None:
            key = (slot.rank, slot.local)
            old = shapes.setdefault(key, slot.local_shape)
            if old != slot.local_shape:
                self.problems.append(
                    Problem(
                        kind="layout",
                        tensor=name,
                        ranks=(slot.rank,),
                        message=f"destination rank {slot.rank}: local tensor {slot.local!r} has shape "
                        f"{list(old)} for one piece and {list(slot.local_shape)} for {name!r}",
                    )
                )
            offs, sizes = slot.local_box(box)
            by_local[key].append((offs, sizes, name))

        mine = self.check_ranks
        for name, slots in self.tensor_slots.items():
            for s in slots:
                if mine is None or s.rank in mine:
                    add(s, s.box, name)
        # Grids that put many tensors into one local tensor (expert stacks): the
        # region each rank's chunks span, and adjacent tensors must not collide.
        for gid, info in enumerate(self.grids):
            names = self.grid_names[gid]
            if info.grid.local is None or not names:
                continue
            first, last = self.metas[names[0]], self.metas[names[-1]]
            for r, c in zip(info.ranks, info.coords, strict=True):
                if mine is not None and r not in mine:
                    continue
                a = info.slot(first, 0, r, c)
                z = info.slot(last, len(names) - 1, r, c)
                if a.box.is_empty():
                    continue
                if len(names) > 1:
                    b = info.slot(self.metas[names[1]], 1, r, c)
                    oa, sa = a.local_box(a.box)
                    ob, sb = b.local_box(b.box)
                    if Box(oa, sa).intersect(Box(ob, sb)) is not None:
                        self.problems.append(
                            Problem(
                                kind="overlap",
                                tensor=names[0],
                                ranks=(r,),
                                message=f"destination rank {r}: {names[0]!r} and {names[1]!r} both write local "
                                f"{a.local!r} at {Box(oa, sa)} and {Box(ob, sb)} (grid step too small)",
                            )
                        )
                oa, sa = a.local_box(a.box)
                oz, sz = z.local_box(z.box)
                lo = tuple(min(x, y) for x, y in zip(oa, oz, strict=True))
                hi = tuple(max(x + u, y + v) for x, u, y, v in zip(oa, sa, oz, sz, strict=True))
                key = (r, a.local)
                old = shapes.setdefault(key, a.local_shape)
                if old != a.local_shape:
                    add(a, a.box, names[0])  # reports the shape clash
                by_local[key].append((lo, tuple(h - l for h, l in zip(hi, lo, strict=True)), names[0]))
        for (rank, local), boxes in by_local.items():
            if len(boxes) < 2:
                continue
            boxes.sort()
            for i, (oa, sa, na) in enumerate(boxes):
                cur = Box(oa, sa)
                for ob, sb, nb in boxes[i + 1 :]:
                    if oa and ob[0] >= oa[0] + sa[0]:
                        break
                    if cur.intersect(Box(ob, sb)) is not None:
                        self.problems.append(
                            Problem(
                                kind="overlap",
                                tensor=na,
                                ranks=(rank,),
                                message=f"destination rank {rank}: pieces of {na!r} and {nb!r} both write "
                                f"local {local!r} at {Box(oa, sa)} and {Box(ob, sb)}",
                            )
                        )

    # -- reading ----------------------------------------------------------

    def geometry(self, name: str) -> tuple:
        """What planning depends on: the meshes and cuts of the tensor's grids
        and the ranks and boxes of its explicit pieces, not where they are
        stored locally. Tensors with equal geometry share one resolve."""
        geo = self.geometry_id
        grids = tuple(geo(g) for g, _ in self.tensor_grids.get(name, ()))
        slots = self.tensor_slots.get(name)
        return grids, tuple((s.rank, s.box) for s in slots) if slots else ()

    def geometry_id(self, gid: int) -> int:
        """A small integer naming grid ``gid``'s geometry (mesh and cuts)."""
        ids = self._geo_of_grid
        while len(ids) <= gid:
            geo = self.grids[len(ids)].geometry
            ids.append(self._geometry_ids.setdefault(geo, len(self._geometry_ids)))
        return ids[gid]

    def describe(self, name: str) -> tuple[object, tuple[list[tuple[int, int]], tuple[Slot, ...]]]:
        """``(geometry key, storage)`` of one tensor in one pass (the planner's hot path).

        Storage is the tensor's own ``(grid id, position)`` list and explicit
        slots; the geometry key is hashable and equal for tensors that plan alike.
        """
        entries = self.tensor_grids.get(name, _EMPTY)
        geo = self._geo_of_grid
        if len(geo) < len(self.grids):
            self.geometry_id(len(self.grids) - 1)
        slots = self.tensor_slots.get(name)
        if not slots:
            if len(entries) == 1:
                return geo[entries[0][0]], (entries, ())
            return tuple(geo[g] for g, _ in entries), (entries, ())
        st = tuple(slots)
        return (tuple(geo[g] for g, _ in entries), tuple((x.rank, x.box) for x in st)), (entries, st)


def _make_slot(store: tuple, grids: list[GridInfo], ref: tuple, rank: int, name: str, dtype: str) -> Slot:
    """The slot behind ``ref``; ``dtype``: the tensor's dtype on that side."""
    if ref[0] == "s":
        return store[1][ref[1]]
    _, gi, _coord, box = ref
    gid, pos = store[0][gi]
    info = grids[gid]
    grid = info.grid
    local = grid.local
    if local is None:
        return Slot(rank, box, name, box.sizes, _zeros(len(box.sizes)), (), dtype)
    return Slot(rank, box, local.name, local.shape, info.offset(pos), grid.dims, local.dtype or dtype)


@dataclass(frozen=True, slots=True)
class Transfer:
    """Move ``box`` of ``tensor`` from ``src`` (a slot on the sending rank)
    to ``dst`` (a slot on the receiving rank) in round ``round``.

    ``kind``: ``pull`` reads a source (trainer) slot; ``fwd`` reads a
    destination slot the sender received earlier in this refit (a leader
    forwarding inside its domain); ``copy`` stays on one rank.

    ``dtype``: the element type on the wire, the source slot's (the
    canonical dtype for a pull, the leader's for a forward); ``nbytes``
    counts those. A destination slot of another dtype casts on arrival.
    """

    tensor: str
    box: Box
    src: Slot
    dst: Slot
    kind: str
    round: int
    nbytes: int
    ordinal: int
    dtype: str = ""

    def sort_key(self) -> tuple:
        return (self.ordinal, self.box.offsets, self.box.sizes, self.dst.local, self.kind)

    def __str__(self) -> str:
        cast = f" {self.dtype}->{self.dst.dtype}" if self.dst.dtype and self.dst.dtype != self.dtype else ""
        return (
            f"{self.tensor}{self.box} {self.src.rank}->{self.dst.rank} {self.kind} r{self.round} {self.nbytes}B{cast}"
        )


@dataclass(slots=True)
class Round:
    index: int
    sends: dict[int, list[Transfer]] = field(default_factory=dict)
    recvs: dict[int, list[Transfer]] = field(default_factory=dict)
    copies: list[Transfer] = field(default_factory=list)


@dataclass(slots=True)
class RankPlan:
    """Everything one rank does in a refit, round by round."""

    rank: int
    rounds: list[Round]
    num_rounds: int

    def transfers(self) -> list[Transfer]:
        out: list[Transfer] = []
        for r in self.rounds:
            for ts in r.sends.values():
                out.extend(ts)
            for ts in r.recvs.values():
                out.extend(ts)
            out.extend(r.copies)
        return out

    @property
    def send_bytes(self) -> int:
        return sum(t.nbytes for r in self.rounds for ts in r.sends.values() for t in ts)

    @property
    def recv_bytes(self) -> int:
        return sum(t.nbytes for r in self.rounds for ts in r.recvs.values() for t in ts)


class RoundTable:
    """Round of every row block of every tensor; identical on every rank.

    A row block weighs its bytes times the tensor's *share*: the largest
    number of its elements any one rank receives plus the largest number any
    one rank sends from, over its element count (1 when a rank holds or needs
    the whole tensor). A round holds at most ``round_bytes`` of weight, so no
    rank stages more than that per round for its own pieces, while tensors
    cut into many pieces share rounds instead of taking one each.
    """

    def __init__(self, metas: Sequence[TensorMeta], round_bytes: int, shares: Sequence[int] | None = None) -> None:
        if round_bytes <= 0:
            raise ValueError(f"round_bytes must be positive, got {round_bytes}")
        self.round_bytes = round_bytes
        self.rows_per_block: list[int] = []
        self.block_rounds: list[list[int]] = []
        rnd, fill = 0, 0
        for i, meta in enumerate(metas):
            rows = meta.shape[0] if meta.shape else 1
            numel = math.prod(meta.shape)
            share = numel if shares is None else min(max(shares[i], 1), numel)
            row_bytes = meta.nbytes // rows if rows else 0
            # Integer arithmetic only: every rank must cut identically.
            row_weight = -(-row_bytes * share // numel) if numel else 0
            rpb = max(1, round_bytes // row_weight) if row_weight else max(rows, 1)
            nblocks = max(1, -(-rows // rpb))
            rounds = []
            for b in range(nblocks):
                ub = min(rpb, rows - b * rpb) * row_weight
                if fill and fill + ub > round_bytes:
                    rnd += 1
                    fill = 0
                fill += ub
                rounds.append(rnd)
            self.rows_per_block.append(rpb)
            self.block_rounds.append(rounds)
        self.num_rounds = rnd + 1 if metas else 0

    def split(self, ordinal: int, box: Box) -> list[tuple[int, Box]]:
        """``box`` cut at row-block boundaries, with the round of each part."""
        rounds = self.block_rounds[ordinal]
        if box.ndim == 0 or len(rounds) == 1:
            return [(rounds[0], box)]
        rpb = self.rows_per_block[ordinal]
        lo, hi = box.offsets[0], box.offsets[0] + box.sizes[0]
        out = []
        for b in range(lo // rpb, (hi - 1) // rpb + 1):
            a, z = max(lo, b * rpb), min(hi, (b + 1) * rpb)
            out.append((rounds[b], Box((a, *box.offsets[1:]), (z - a, *box.sizes[1:]))))
        return out


@dataclass(slots=True)
class _Region:
    parts: list[Box]
    needers: list[tuple[int, Ref]]
    holders: list[tuple[int, Ref]]
    holders_in: list[tuple[int, Ref]]
    holders_out: list[tuple[int, Ref]]
    ranks: frozenset[int]
    copies: list[tuple[tuple[int, Ref], tuple[int, Ref]]] = field(default_factory=list)
    """(holder, needer) pairs on one rank: local copies."""
    pulling: list[tuple[int, Ref]] = field(default_factory=list)
    """Needers that hold nothing of the region themselves."""

    @property
    def period(self) -> int:
        """Decisions repeat with the rotation modulo this."""
        return math.lcm(max(1, len(self.holders_in) or len(self.holders_out)), max(1, len(self.pulling)))


@dataclass(slots=True)
class _Family:
    index: int
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    # Geometry (shared by members): the first member's grids and slots.
    src_grids: tuple[int, ...]
    src_slots: tuple[Slot, ...]
    dst_grids: tuple[int, ...]
    dst_slots: tuple[Slot, ...]
    names: list[str] = field(default_factory=list)
    ordinals: list[int] = field(default_factory=list)
    # Storage per member: ((grid id, position) list, explicit slots), aligned with the geometry.
    src_store: list[tuple[list[tuple[int, int]], tuple[Slot, ...]]] = field(default_factory=list)
    dst_store: list[tuple[list[tuple[int, int]], tuple[Slot, ...]]] = field(default_factory=list)
    boxes: dict[tuple, Box] = field(default_factory=dict)
    """Grid boxes by (side, grid position, coord): equal for every member."""
    src_ranks: frozenset[int] = frozenset()
    dst_ranks: frozenset[int] = frozenset()
    dst_domains: tuple[int, ...] = ()


@dataclass(slots=True)
class Traffic:
    """Bytes between every pair of ranks for a whole plan (the cost model's input).

    ``pairs[(src, dst)]`` counts bytes sent from ``src`` to ``dst`` (pulls and
    forwards), ``transfers`` the transfers behind them, ``local[r]`` bytes a
    rank copies within itself. Per-rank views split bytes into ``net``
    (between domains) and ``nvl`` (between ranks of one domain).
    """

    domain_of: Callable[[int], int]
    pairs: Counter = field(default_factory=Counter)
    transfers: Counter = field(default_factory=Counter)
    local: Counter = field(default_factory=Counter)
    num_rounds: int = 0
    net_in: Counter = field(default_factory=Counter)
    net_out: Counter = field(default_factory=Counter)
    nvl_in: Counter = field(default_factory=Counter)
    nvl_out: Counter = field(default_factory=Counter)

    def finish(self) -> Traffic:
        for c in (self.net_in, self.net_out, self.nvl_in, self.nvl_out):
            c.clear()
        for (s, d), b in self.pairs.items():
            if self.domain_of(s) == self.domain_of(d):
                self.nvl_out[s] += b
                self.nvl_in[d] += b
            else:
                self.net_out[s] += b
                self.net_in[d] += b
        return self

    @property
    def network_bytes(self) -> int:
        return sum(self.net_in.values())

    @property
    def nvlink_bytes(self) -> int:
        return sum(self.nvl_in.values())

    def recv_bytes(self, rank: int) -> int:
        return self.net_in[rank] + self.nvl_in[rank]

    def send_bytes(self, rank: int) -> int:
        return self.net_out[rank] + self.nvl_out[rank]

    @property
    def max_rank_recv_bytes(self) -> int:
        ranks = set(self.net_in) | set(self.nvl_in)
        return max((self.recv_bytes(r) for r in ranks), default=0)

    @property
    def max_rank_send_bytes(self) -> int:
        ranks = set(self.net_out) | set(self.nvl_out)
        return max((self.send_bytes(r) for r in ranks), default=0)


class Planner:
    """Plans refits from source layouts to destination layouts.

    Call order: construct (indexes layouts, cheap), then :meth:`problems` or
    :meth:`check` (raises :class:`PlanError`), then :meth:`plan_for` on each
    rank, or :meth:`traffic` for the cost of the whole plan. Every method is
    deterministic: all ranks that hold the same layouts get the same answers.

    ``domain_of`` maps a rank to its domain (ranks joined by a fast fabric);
    by default every rank is its own domain, so nothing is forwarded.
    """

    def __init__(
        self,
        sources: LayoutSet,
        dests: LayoutSet,
        *,
        domain_of: Mapping[int, int] | Callable[[int], int] | None = None,
        round_bytes: int = DEFAULT_ROUND_BYTES,
        split_bytes: int = DEFAULT_SPLIT_BYTES,
    ) -> None:
        if split_bytes <= 0:
            raise ValueError(f"split_bytes must be positive, got {split_bytes}")
        self.sources = sources
        self.dests = dests
        if domain_of is None:
            self._domain = lambda r: r
        elif callable(domain_of):
            self._domain = domain_of
        else:
            mapping = dict(domain_of)
            self._domain = lambda r: mapping.get(r, -1 - r)
        self.split_bytes = split_bytes
        self._problems: list[Problem] = list(sources.problems) + list(dests.problems)
        self._regions: dict[tuple[int, int], list[_Region]] = {}
        self._region_problems: dict[tuple[int, int], list[Problem]] = {}
        self._grid_domains: dict[int, dict[int, list[tuple[int, tuple[int, ...]]]]] = {}
        with gc_paused():
            # Destination tensors in checkpoint order; each takes the source's
            # dtype (the canonical one) once its families are built.
            self.order: list[TensorMeta] = sorted(dests.metas.values(), key=lambda m: natural_key(m.name))
            self.ordinal = {m.name: i for i, m in enumerate(self.order)}
            self._families = self._build_families()
            self.rounds = RoundTable(self.order, round_bytes, self._shares())

    # -- inputs -----------------------------------------------------------

    def domain(self, rank: int) -> int:
        return self._domain(rank)

    def _build_families(self) -> list[_Family]:
        src, dst = self.sources, self.dests
        families: dict[tuple, _Family] = {}
        missing: dict[str, list[str]] = {}
        for meta in self.order:
            name = meta.name
            smeta = src.metas.get(name)
            if smeta is None:
                missing.setdefault(name, [])
                continue
            if smeta is not meta and (smeta.shape != meta.shape or not cast_ok(smeta.dtype, meta.dtype)):
                why = "" if smeta.shape != meta.shape else f" ({smeta.dtype} cannot be cast to {meta.dtype} on arrival)"
                self._problems.append(
                    Problem(
                        kind="mismatch",
                        tensor=name,
                        ranks=(src.declared_by[name], dst.declared_by[name]),
                        message=(
                            f"tensor {name!r}: source rank {src.declared_by[name]} has shape {list(smeta.shape)} "
                            f"{smeta.dtype}, destination rank {dst.declared_by[name]} needs shape "
                            f"{list(meta.shape)} {meta.dtype}{why}"
                        ),
                    )
                )
                continue
            # The canonical dtype is the source's: that is what moves.
            meta = self.order[self.ordinal[name]] = smeta
            s_geo, s_store = src.describe(name)
            d_geo, d_store = dst.describe(name)
            key = (meta.shape, meta.dtype, s_geo, d_geo)
            fam = families.get(key)
            if fam is None:
                fam = families[key] = _Family(
                    index=len(families),
                    shape=meta.shape,
                    dtype=meta.dtype,
                    itemsize=dtype_size(meta.dtype),
                    src_grids=tuple(g for g, _ in s_store[0]),
                    src_slots=s_store[1],
                    dst_grids=tuple(g for g, _ in d_store[0]),
                    dst_slots=d_store[1],
                )
            fam.names.append(name)
            fam.ordinals.append(self.ordinal[name])
            fam.src_store.append(s_store)
            fam.dst_store.append(d_store)
        if missing:
            names = sorted(missing, key=natural_key)
            self._problems.append(
                Problem(
                    kind="unknown-tensor",
                    tensor=names[0],
                    ranks=tuple(sorted({dst.declared_by[n] for n in names[:50]})),
                    message=(
                        f"{len(names)} tensor(s) needed by destination ranks are published by no source: "
                        + ", ".join(repr(n) for n in names[:8])
                        + (" ..." if len(names) > 8 else "")
                        + f" (first needed by rank {dst.declared_by[names[0]]})"
                    ),
                )
            )
        out = list(families.values())
        for fam in out:
            sranks: set[int] = {s.rank for s in fam.src_slots}
            for g in fam.src_grids:
                sranks.update(src.grids[g].rank_set)
            dranks: set[int] = {s.rank for s in fam.dst_slots}
            for g in fam.dst_grids:
                dranks.update(dst.grids[g].rank_set)
            fam.src_ranks = frozenset(sranks)
            fam.dst_ranks = frozenset(dranks)
            fam.dst_domains = tuple(sorted({self._domain(r) for r in dranks}))
        return out

    def _shares(self) -> list[int]:
        """Per tensor (by ordinal): max elements one rank receives + max one rank sends from."""
        shares = [math.prod(m.shape) for m in self.order]
        memo: dict[tuple, int] = {}
        for fam in self._families:
            most = 0
            for side, grids, slots in (
                (self.dests, fam.dst_grids, fam.dst_slots),
                (self.sources, fam.src_grids, fam.src_slots),
            ):
                key = (id(side), tuple(side.geometry_id(g) for g in grids), fam.shape) if not slots else None
                if key is not None and key in memo:
                    most += memo[key]
                    continue
                per_rank: Counter = Counter()
                for g in grids:
                    info = side.grids[g]
                    for box, ranks, _ in info.holders(fam.shape):
                        for r in ranks:
                            per_rank[r] += box.numel
                for sl in slots:
                    per_rank[sl.rank] += sl.box.numel
                top = max(per_rank.values(), default=0)
                if key is not None:
                    memo[key] = top
                most += top
            for o in fam.ordinals:
                shares[o] = most
        return shares

    def _grid_by_domain(self, gid: int) -> dict[int, list[tuple[int, tuple[int, ...]]]]:
        got = self._grid_domains.get(gid)
        if got is None:
            info = self.dests.grids[gid]
            got = defaultdict(list)
            for r, c in zip(info.ranks, info.coords, strict=True):
                got[self._domain(r)].append((r, c))
            self._grid_domains[gid] = got
        return got

    # -- resolve ----------------------------------------------------------

    def _family_regions(self, fam: _Family, domain: int) -> list[_Region]:
        key = (fam.index, domain)
        regions = self._regions.get(key)
        if regions is not None:
            return regions
        shape = fam.shape
        needs: list[tuple[int, Box, Ref]] = []
        for gi, g in enumerate(fam.dst_grids):
            grid = self.dests.grids[g].grid
            for r, c in self._grid_by_domain(g).get(domain, ()):
                box = grid_box(grid, shape, c)
                if not box.is_empty():
                    needs.append((r, box, ("g", gi, c)))
        for si, s in enumerate(fam.dst_slots):
            if self._domain(s.rank) == domain and not s.box.is_empty():
                needs.append((s.rank, s.box, ("s", si)))
        holders: list[tuple[Box, list[tuple[int, Ref]]]] = []
        by_box: dict[Box, list[tuple[int, Ref]]] = {}
        for gi, g in enumerate(fam.src_grids):
            for box, ranks, coords in self.sources.grids[g].holders(shape):
                by_box.setdefault(box, []).extend((r, ("g", gi, c)) for r, c in zip(ranks, coords, strict=True))
        for si, s in enumerate(fam.src_slots):
            if not s.box.is_empty():
                by_box.setdefault(s.box, []).append((s.rank, ("s", si)))
        holders = [(b, sorted(m, key=lambda x: x[0])) for b, m in by_box.items()]
        regions, problems = self._resolve(fam, domain, needs, holders)
        self._regions[key] = regions
        self._region_problems[key] = problems
        return regions

    def _resolve(
        self,
        fam: _Family,
        domain: int,
        needs: list[tuple[int, Box, Ref]],
        holders: list[tuple[Box, list[tuple[int, Ref]]]],
    ) -> tuple[list[_Region], list[Problem]]:
        problems: list[Problem] = []
        if not needs:
            return [], problems
        shape = fam.shape
        nd = len(shape)
        # Cut points per dim, and per interval the bitmask of needs / holders covering it.
        intervals: list[list[tuple[int, int]]] = []
        need_masks: list[list[int]] = []
        hold_masks: list[list[int]] = []
        for d in range(nd):
            lo = min(b.offsets[d] for _, b, _ in needs)
            hi = max(b.offsets[d] + b.sizes[d] for _, b, _ in needs)
            cuts = {lo, hi}
            for _, b, _ in needs:
                cuts.add(b.offsets[d])
                cuts.add(b.offsets[d] + b.sizes[d])
            for b, _ in holders:
                for x in (b.offsets[d], b.offsets[d] + b.sizes[d]):
                    if lo < x < hi:
                        cuts.add(x)
            cl = sorted(cuts)
            iv = list(itertools.pairwise(cl))
            nm = [0] * len(iv)
            hm = [0] * len(iv)
            for j, (_, b, _) in enumerate(needs):
                for i in range(bisect_left(cl, b.offsets[d]), bisect_left(cl, b.offsets[d] + b.sizes[d])):
                    nm[i] |= 1 << j
            for j, (b, _) in enumerate(holders):
                a = bisect_left(cl, max(b.offsets[d], lo))
                z = bisect_left(cl, min(b.offsets[d] + b.sizes[d], hi))
                for i in range(a, z):
                    hm[i] |= 1 << j
            intervals.append(iv)
            need_masks.append(nm)
            hold_masks.append(hm)
        all_needs = (1 << len(needs)) - 1
        all_holders = (1 << len(holders)) - 1
        cells: dict[tuple[int, int], list[Box]] = {}

        def walk(d: int, offs: tuple, sizes: tuple, nmask: int, hmask: int) -> None:
            if d == nd:
                cells.setdefault((nmask, hmask), []).append(Box(offs, sizes))
                return
            for (a, z), n_m, h_m in zip(intervals[d], need_masks[d], hold_masks[d], strict=True):
                m = nmask & n_m
                if m:
                    walk(d + 1, (*offs, a), (*sizes, z - a), m, hmask & h_m)

        walk(0, (), (), all_needs, all_holders)
        regions: list[_Region] = []
        for (nmask, hmask), boxes in cells.items():
            needers = [(needs[j][0], needs[j][2]) for j in range(len(needs)) if nmask >> j & 1]
            name = fam.names[0]
            more = f" (and {len(fam.names) - 1} more tensors laid out alike)" if len(fam.names) > 1 else ""
            seen: dict[int, int] = {}
            for r, _ in needers:
                seen[r] = seen.get(r, 0) + 1
            dup = sorted(r for r, n in seen.items() if n > 1)
            if dup:
                problems.append(
                    Problem(
                        kind="overlap",
                        tensor=name,
                        ranks=tuple(dup),
                        message=f"destination rank(s) {dup} need box {merge_boxes(boxes)[0]} of {name!r}{more} "
                        "through two pieces (overlapping destination pieces)",
                    )
                )
                continue
            if not hmask:
                problems.append(
                    Problem(
                        kind="uncovered",
                        tensor=name,
                        ranks=tuple(sorted(seen)),
                        message=f"box(es) {', '.join(str(b) for b in merge_boxes(boxes)[:4])} of {name!r}{more} "
                        f"(shape {list(shape)}) needed by rank(s) {sorted(seen)} are held by no source",
                    )
                )
                continue
            hs: dict[int, Ref] = {}
            for j in range(len(holders)):
                if hmask >> j & 1:
                    for r, ref in holders[j][1]:
                        hs.setdefault(r, ref)
            hlist = sorted(hs.items())
            h_in = [h for h in hlist if self._domain(h[0]) == domain]
            h_out = [h for h in hlist if self._domain(h[0]) != domain]
            parts: list[Box] = []
            n_pull = sum(1 for r, _ in needers if r not in hs)
            cands = max(len(h_in) or len(h_out), n_pull if not h_in else 1)
            for b in merge_boxes(boxes):
                parts.extend(self._split(b, fam.itemsize, cands))
            ordered = sorted(needers, key=lambda x: x[0])
            regions.append(
                _Region(
                    parts=parts,
                    needers=ordered,
                    holders=hlist,
                    holders_in=h_in,
                    holders_out=h_out,
                    ranks=frozenset(seen) | frozenset(hs),
                    copies=[((n[0], hs[n[0]]), n) for n in ordered if n[0] in hs],
                    pulling=[n for n in ordered if n[0] not in hs],
                )
            )
        regions.sort(key=lambda reg: (reg.parts[0].offsets, reg.needers[0][0]))
        return regions, problems

    def _split(self, box: Box, itemsize: int, cands: int) -> list[Box]:
        nbytes = box.numel * itemsize
        if cands <= 1 or nbytes <= self.split_bytes or box.ndim == 0:
            return [box]
        p = min(cands, -(-nbytes // self.split_bytes))
        d = 0 if box.sizes[0] >= p else max(range(box.ndim), key=lambda i: box.sizes[i])
        p = min(p, box.sizes[d])
        out = []
        for i in range(p):
            a, z = chunk_range(box.sizes[d], p, i)
            if z > a:
                offs = list(box.offsets)
                sizes = list(box.sizes)
                offs[d] += a
                sizes[d] = z - a
                out.append(Box(tuple(offs), tuple(sizes)))
        return out

    @staticmethod
    def _decide(reg: _Region, rot: int) -> list[tuple[str, tuple[int, Ref], tuple[int, Ref]]]:
        """(kind, (src rank, ref), (dst rank, ref)) for one part at rotation ``rot``."""
        out = [("copy", h, n) for h, n in reg.copies]
        pulling = reg.pulling
        if not pulling:
            return out
        if reg.holders_in:
            m = len(reg.holders_in)
            for j, n in enumerate(pulling):
                out.append(("pull", reg.holders_in[(rot + j) % m], n))
            return out
        leader = pulling[rot % len(pulling)]
        out.append(("pull", reg.holders_out[rot % len(reg.holders_out)], leader))
        for n in pulling:
            if n is not leader:
                out.append(("fwd", leader, n))
        return out

    # -- outputs ----------------------------------------------------------

    def problems(self, rank: int | None = None) -> list[Problem]:
        """Problems with the inputs; with ``rank``, only those its plan touches
        (plus every problem found while indexing the layouts)."""
        for fam in self._families:
            if rank is None:
                domains: Iterable[int] = fam.dst_domains
            elif rank in fam.src_ranks:
                domains = fam.dst_domains
            elif rank in fam.dst_ranks:
                domains = (self._domain(rank),)
            else:
                continue
            for dom in domains:
                self._family_regions(fam, dom)
        out = list(self._problems)
        for key in sorted(self._region_problems):
            out.extend(self._region_problems[key])
        return out

    def check(self, rank: int | None = None) -> None:
        problems = self.problems(rank)
        if problems:
            raise PlanError(problems)

    def plan_for(self, rank: int) -> RankPlan:
        """The transfers ``rank`` takes part in, grouped by round and peer.

        Raises :class:`PlanError` if the inputs it touches have problems.
        """
        with gc_paused():
            return self._plan_for(rank)

    def _resolve_ref(self, fam: _Family, side: str, ref: Ref) -> tuple:
        """A ref with its grid box looked up once per family: ("s", i) or ("g", gi, coord, box)."""
        if ref[0] == "s":
            return ref
        _, gi, coord = ref
        key = (side, gi, coord)
        box = fam.boxes.get(key)
        if box is None:
            info = (self.sources if side == "src" else self.dests).grids[
                (fam.src_grids if side == "src" else fam.dst_grids)[gi]
            ]
            box = fam.boxes[key] = grid_box(info.grid, fam.shape, coord)
        return ("g", gi, coord, box)

    def _emit(self, fam: _Family, rank: int, tables: list, rounds: dict[int, Round]) -> None:
        """Instantiate the decisions in ``tables`` for every member of ``fam``."""
        # Resolve refs once per family and domain, not once per member.
        prepared: list[tuple] = []
        for part, period, per, reg, base in tables:
            if per is None:
                prepared.append((part, period, None, reg, base))
                continue
            rows: list[list[tuple]] | None = []
            for decisions in per:
                row = []
                for kind, (sr, sref), (dr, dref) in decisions:
                    s_side = "dst" if kind == "fwd" else "src"
                    row.append(
                        (
                            kind,
                            sr,
                            s_side == "dst",
                            self._resolve_ref(fam, s_side, sref),
                            dr,
                            self._resolve_ref(fam, "dst", dref),
                        )
                    )
                rows.append(row)  # type: ignore[union-attr]
            prepared.append((part, period, rows, reg, base))
        src_grids, dst_grids = self.sources.grids, self.dests.grids
        block_rounds = self.rounds.block_rounds
        split = self.rounds.split
        itemsize = fam.itemsize
        src_metas, dst_metas = self.sources.metas, self.dests.metas
        for m, ordinal in enumerate(fam.ordinals):
            name = fam.names[m]
            src_store = fam.src_store[m]
            dst_store = fam.dst_store[m]
            src_dtype = src_metas[name].dtype
            dst_dtype = dst_metas[name].dtype
            single = block_rounds[ordinal][0] if len(block_rounds[ordinal]) == 1 else None
            for part, period, rows, reg, base in prepared:
                if rows is None:
                    row = []
                    for kind, (sr, sref), (dr, dref) in self._decide(reg, ordinal + base):
                        if rank in (sr, dr):
                            s_side = "dst" if kind == "fwd" else "src"
                            row.append(
                                (
                                    kind,
                                    sr,
                                    s_side == "dst",
                                    self._resolve_ref(fam, s_side, sref),
                                    dr,
                                    self._resolve_ref(fam, "dst", dref),
                                )
                            )
                else:
                    row = rows[ordinal % period]
                for kind, sr, s_from_dst, sref, dr, dref in row:
                    if s_from_dst:
                        s_slot = _make_slot(dst_store, dst_grids, sref, sr, name, dst_dtype)
                        wire_size = dtype_size(s_slot.dtype)
                    else:
                        s_slot = _make_slot(src_store, src_grids, sref, sr, name, src_dtype)
                        wire_size = itemsize
                    d_slot = _make_slot(dst_store, dst_grids, dref, dr, name, dst_dtype)
                    parts = [(single, part)] if single is not None else split(ordinal, part)
                    for rnd, sub in parts:
                        if kind == "fwd":
                            rnd += 1
                        t = Transfer(name, sub, s_slot, d_slot, kind, rnd, sub.numel * wire_size, ordinal, s_slot.dtype)
                        rp = rounds.get(rnd)
                        if rp is None:
                            rp = rounds[rnd] = Round(rnd)
                        if kind == "copy":
                            rp.copies.append(t)
                        elif sr == rank:
                            rp.sends.setdefault(dr, []).append(t)
                        else:
                            rp.recvs.setdefault(sr, []).append(t)

    def _plan_for(self, rank: int) -> RankPlan:
        self.check(rank)
        my_domain = self._domain(rank)
        rounds: dict[int, Round] = {}
        for fam in self._families:
            is_src = rank in fam.src_ranks
            if not is_src and rank not in fam.dst_ranks:
                continue
            n_members = len(fam.ordinals)
            for dom in fam.dst_domains if is_src else (my_domain,):
                # Per part: the decisions that involve this rank, by rotation residue.
                tables: list[tuple] = []
                for ri, reg in enumerate(self._family_regions(fam, dom)):
                    if rank not in reg.ranks:
                        continue
                    period = reg.period
                    for pi, part in enumerate(reg.parts):
                        base = ri + pi + dom
                        if period <= max(64, n_members):
                            per = [
                                [x for x in self._decide(reg, res + base) if x[1][0] == rank or x[2][0] == rank]
                                for res in range(period)
                            ]
                            if any(per):
                                tables.append((part, period, per, reg, base))
                        else:
                            tables.append((part, 0, None, reg, base))
                if not tables:
                    continue
                self._emit(fam, rank, tables, rounds)
        out = [rounds[k] for k in sorted(rounds)]
        for rp in out:
            for ts in rp.sends.values():
                ts.sort(key=Transfer.sort_key)
            for ts in rp.recvs.values():
                ts.sort(key=Transfer.sort_key)
            rp.copies.sort(key=Transfer.sort_key)
        return RankPlan(rank=rank, rounds=out, num_rounds=self.rounds.num_rounds + 1)

    def traffic(self) -> Traffic:
        """Bytes per rank and link class of the whole plan, without building it.

        Uses the same decisions as :meth:`plan_for` (tested against the sum of
        every rank's plan), counting tensors of a family by their ordinal
        modulo the rotation period instead of one by one.
        """
        with gc_paused():
            return self._traffic()

    def _traffic(self) -> Traffic:
        self.check()
        t = Traffic(domain_of=self._domain, num_rounds=self.rounds.num_rounds + 1)
        for fam in self._families:
            for d in fam.dst_domains:
                for ri, reg in enumerate(self._family_regions(fam, d)):
                    period = reg.period
                    hist = Counter(o % period for o in fam.ordinals)
                    for pi, part in enumerate(reg.parts):
                        nbytes = part.numel * fam.itemsize
                        for residue, count in hist.items():
                            rot = residue + ri + pi + d
                            for kind, (sr, _), (dr, _) in self._decide(reg, rot):
                                if kind == "copy":
                                    t.local[dr] += nbytes * count
                                else:
                                    t.pairs[(sr, dr)] += nbytes * count
                                    t.transfers[(sr, dr)] += count
        return t.finish()

    def domain_ingress(self) -> Counter:
        """Per destination domain, bytes its ranks need that no rank in it holds
        (each element counted once per domain): what must cross into it."""
        self.check()
        out: Counter = Counter()
        for fam in self._families:
            n = len(fam.names)
            for d in fam.dst_domains:
                for reg in self._family_regions(fam, d):
                    if not reg.holders_in:
                        out[d] += sum(p.numel for p in reg.parts) * fam.itemsize * n
        return out

    # -- facts for reports --------------------------------------------------

    @property
    def num_families(self) -> int:
        return len(self._families)

    def needed_bytes(self, rank: int) -> int:
        """Bytes of destination data ``rank`` keeps (from its layout)."""
        total = 0
        for fam in self._families:
            if rank not in fam.dst_ranks:
                continue
            per = 0
            for g in fam.dst_grids:
                info = self.dests.grids[g]
                for c in info.coord_of.get(rank, ()):
                    per += grid_box(info.grid, fam.shape, c).numel
            per += sum(s.box.numel for s in fam.dst_slots if s.rank == rank)
            total += per * fam.itemsize * len(fam.names)
        return total
