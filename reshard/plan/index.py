"""Indexing one side's layouts (all sources, or all destinations) by tensor.

:class:`LayoutSet` checks what each rank published (boxes inside their
tensors, local storage that fits, grids published by exactly the ranks of
their mesh, destination pieces that do not write the same local elements)
and answers, per tensor, which grids and explicit slots hold it and a key
that is equal for tensors that plan alike.
"""

from __future__ import annotations

import gc
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from msgspec.structs import replace

from reshard.errors import Problem
from reshard.plan.box import Box
from reshard.plan.layout import Grid, GridInfo, Layout, Slot, TensorMeta, table_digest

__all__ = ["POS_BITS", "POS_MASK", "LayoutSet", "TensorGrids", "gc_paused", "natural_key", "natural_order", "unpack"]

_DIGITS = re.compile(r"(\d+)")
_PAD = 20


def natural_key(name: str) -> tuple:
    """``layers.2`` sorts before ``layers.10``: checkpoint order, layer by layer."""
    return tuple(int(t) if t.isdigit() else t for t in _DIGITS.split(name))


def natural_order(metas: list[TensorMeta]) -> list[TensorMeta]:
    """``metas`` sorted by :func:`natural_key` of their names (stably).

    The same order, faster on DeepSeek-V3's 45k names (the tuple keys took
    a fifth of a rank's plan): each name becomes one string in which every
    run of digits is a NUL and the run zero-padded to a fixed width, so
    plain string comparison is natural order (a NUL sorts below any other
    character, as a shorter part does in the tuple key). No run of digits
    crosses a dot, and names repeat their dotted parts (``layers``, ``61``,
    ``experts``, ``weight``: a few hundred distinct parts in 45k names), so
    each distinct part is padded once and the names are put back together
    from the padded parts. Names for which that does not hold (not ASCII,
    with a NUL or newline, or a run of digits wider than the pad) take
    :func:`natural_key`.
    """
    names = [m.name for m in metas]
    text = "\n".join(names)
    if not text.isascii() or "\x00" in text or text.count("\n") != len(names) - 1:
        return sorted(metas, key=lambda m: natural_key(m.name))
    parts = text.split(".")
    padded = {}
    for part in set(parts):
        runs = _DIGITS.split(part)  # text, digits, text, ..., text
        if len(runs) > 1:
            if any(len(run) > _PAD for run in runs[1::2]):
                return sorted(metas, key=lambda m: natural_key(m.name))
            runs[1::2] = ["\x00" + run.zfill(_PAD) for run in runs[1::2]]
            padded[part] = "".join(runs)
        else:
            padded[part] = part
    keys = ".".join(map(padded.__getitem__, parts)).split("\n")
    order = sorted(range(len(metas)), key=keys.__getitem__)
    return [metas[i] for i in order]


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

POS_BITS = 40
"""A packed grid entry is ``grid id << POS_BITS | position`` (see :class:`TensorGrids`)."""
POS_MASK = (1 << POS_BITS) - 1


class TensorGrids:
    """Per tensor name, the ``(grid id, position)`` of each grid that holds it.

    A tensor indexed with its grid's whole run (each tensor in one grid, as
    rules and engines publish them) is one int in :attr:`one`, ``grid id <<
    40 | position``, not a list of tuples: a list and a tuple per tensor of
    both sides were a quarter of one rank's planning memory at 45k tensors.
    Every other tensor has a list in :attr:`many`. A tensor is in one of
    the two, never both.
    """

    __slots__ = ("many", "one")

    def __init__(self) -> None:
        self.one: dict[str, int] = {}
        self.many: dict[str, list[tuple[int, int]]] = {}

    def add_run(self, names: list[str], gid: int) -> None:
        """The tensors of grid ``gid`` at positions 0, 1, ...: names new to this index."""
        base = gid << POS_BITS
        self.one.update(zip(names, range(base, base + len(names))))

    def append(self, name: str, gid: int, pos: int) -> None:
        got = self.many.get(name)
        if got is None:
            packed = self.one.pop(name, None)
            got = self.many[name] = [] if packed is None else [unpack(packed)]
        got.append((gid, pos))

    def get(self, name: str, default: Sequence[tuple[int, int]] = ()) -> Sequence[tuple[int, int]]:
        packed = self.one.get(name)
        if packed is not None:
            return [unpack(packed)]
        return self.many.get(name, default)

    def items(self) -> Iterator[tuple[str, list[tuple[int, int]]]]:
        for name, packed in self.one.items():
            yield name, [unpack(packed)]
        yield from self.many.items()


def unpack(packed: int) -> tuple[int, int]:
    """``(grid id, position)`` of a :attr:`TensorGrids.one` entry."""
    return packed >> POS_BITS, packed & POS_MASK


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
        self._declared_by: dict[str, int] = {}
        self._grid_first: list[int | None] = []
        self.grids: list[GridInfo] = []
        self.grid_names: list[list[str]] = []
        self._grid_ids: dict[tuple[str, Grid], int] = {}
        self._grid_content: dict[tuple, int] = {}
        self._publishers: list[set[int] | None] = []
        self.tensor_grids = TensorGrids()
        self.tensor_slots: dict[str, list[Slot]] = defaultdict(list)
        self.ranks: set[int] = set()
        self.problems: list[Problem] = []
        self._digests: dict[int, str] = {}
        self._geometry_ids: dict[tuple, int] = {}
        self._geo_of_grid: list[int] = []
        self._meshes: set = set()
        self._declared: dict[int, Sequence[TensorMeta]] = {}

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

    def declared_by(self, name: str) -> int:
        """The rank that declared tensor ``name`` first (named in problems)."""
        got = self._declared_by.get(name)
        if got is None:  # declared in bulk with the first grid that holds it
            entries = self.tensor_grids.get(name)
            first = self._grid_first[entries[0][0]] if entries else None
            if first is None:
                raise KeyError(name)
            got = first
        return got

    def _declare(self, meta: TensorMeta, rank: int) -> bool:
        old = self.metas.get(meta.name)
        if old is meta:
            return True
        if old is None:
            self.metas[meta.name] = meta
            self._declared_by[meta.name] = rank
            return True
        if old != meta:
            self.problems.append(
                Problem(
                    kind="mismatch",
                    tensor=meta.name,
                    ranks=(self.declared_by(meta.name), rank),
                    message=(
                        f"{self.role} ranks disagree on tensor {meta.name!r}: rank "
                        f"{self.declared_by(meta.name)} says shape {list(old.shape)} {old.dtype}, "
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
        tensors = layout.tensors
        if self._declared.get(id(tensors)) is not tensors:
            for meta in tensors:
                self._declare(meta, rank)
            # Every rank of a side shares one table: once each of its metas is
            # the declared one, declaring it again for another rank does nothing.
            metas = self.metas
            if all(metas[m.name] is m for m in tensors):
                self._declared[id(tensors)] = tensors
        for grid in layout.grids:
            self._add_grid(digest, layout.tensors, grid, publisher=rank)
        for i, p in enumerate(layout.pieces):
            self._add_piece(layout, i, p)

    def add_grid(self, tensors: Sequence[TensorMeta], grid: Grid) -> None:
        """Add a grid that speaks for all its ranks (no per-rank publication)."""
        first = grid.mesh.rank_at((0,) * len(grid.mesh.shape))
        rng = grid.tensor_indices()
        if rng.start < 0 or rng.stop > len(tensors) or rng.step <= 0:
            for meta in tensors[slice(*grid.tensors)]:
                self._declare(meta, first)
            self._add_grid(None, tensors, grid, publisher=None)
            return
        gid, info = self._new_grid(None, grid, None)  # a direct grid is never looked up again
        metas, declared_by, tensor_grids = self.metas, self._declared_by, self.tensor_grids
        members = list(tensors[rng.start : rng.stop : rng.step])
        names = [m.name for m in members]
        if metas.keys().isdisjoint(names) and len(set(names)) == len(names):
            # Names new to this side (each tensor in one grid, as rules and
            # engines publish them): declare and index them in bulk, the
            # declaring rank kept once for the grid. This runs once per
            # tensor and side for every rank's plan.
            metas.update(zip(names, members))
            self._grid_first[gid] = first
            tensor_grids.add_run(names, gid)
            self._grid_indexed(gid, info, names, members)
            return
        names = []
        for pos, ti in enumerate(rng):
            meta = tensors[ti]
            name = meta.name
            names.append(name)
            old = metas.get(name)
            if old is None:
                metas[name] = old = meta
                declared_by[name] = first
            elif old is not meta and not self._declare(meta, first):
                continue
            if old is meta or old == meta:
                tensor_grids.append(name, gid, pos)
        self._grid_indexed(gid, info, names, list(tensors[rng.start : rng.stop : rng.step]))

    def _new_grid(self, key: tuple | None, grid: Grid, publisher: int | None) -> tuple[int, GridInfo]:
        gid = len(self.grids)
        if key is not None:
            self._grid_ids[key] = gid
        info = GridInfo(grid)
        self.grids.append(info)
        self._grid_first.append(None)
        self._publishers.append(set() if publisher is not None else None)
        return gid, info

    def _grid_indexed(self, gid: int, info: GridInfo, names: list[str], metas: list[TensorMeta]) -> None:
        self.grid_names.append(names)
        mesh = info.grid.mesh
        if mesh not in self._meshes:  # an engine's hundreds of grids share one mesh
            self._meshes.add(mesh)
            self.ranks.update(info.ranks)
        self._check_grid(info, metas)

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
            gid, info = self._new_grid(key, grid, publisher)
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
            metas, tensor_grids = self.metas, self.tensor_grids
            for pos, ti in enumerate(rng):
                meta = tensors[ti]
                name = meta.name
                names.append(name)
                old = metas.get(name)
                if old is meta or old == meta:  # else a disagreement _declare reported
                    tensor_grids.append(name, gid, pos)
            self._grid_indexed(gid, info, names, list(tensors[rng.start : rng.stop : rng.step]))
        pubs = self._publishers[gid]
        if pubs is not None and publisher is not None:
            pubs.add(publisher)

    def _check_grid(self, info: GridInfo, metas: list[TensorMeta]) -> None:
        g = info.grid
        nd_mesh = len(g.mesh.shape)
        for meta in metas[:1] + metas[1:][-1:]:  # the first and the last (once when they are one)
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
            if self.check_ranks is None and all(
                self._slot_problem(meta, info.slot(meta, pos, ranks[0], first)) is None
                for first, ranks, _ in info.groups()
            ):
                continue  # ranks of a group hold one box alike: all pass when one does
            for r, c in self._checked(info):
                self._check_slot(meta, info.slot(meta, pos, r, c), None)

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
        problem = self._slot_problem(meta, slot)
        if problem is not None:
            self.problems.append(problem)
        return problem is None

    def _slot_problem(self, meta: TensorMeta, slot: Slot) -> Problem | None:
        """What is wrong with where ``slot`` puts its box (nothing of it depends on the rank but the message)."""
        ranks = (slot.rank,)
        if not slot.box.within(meta.shape):
            return Problem(
                kind="out-of-range",
                tensor=meta.name,
                ranks=ranks,
                message=f"{self.role} rank {slot.rank}: box {slot.box} is outside tensor {meta.name!r} "
                f"of shape {list(meta.shape)}",
            )
        dims = slot.dims or tuple(range(len(meta.shape)))
        nd = len(slot.local_shape)
        if len(dims) != len(meta.shape) or len(set(dims)) != len(dims) or any(not 0 <= d < nd for d in dims):
            return Problem(
                kind="layout",
                tensor=meta.name,
                ranks=ranks,
                message=f"{self.role} rank {slot.rank}: dims {slot.dims} of {meta.name!r} do not map "
                f"{len(meta.shape)} global dims into local {slot.local!r} of shape {list(slot.local_shape)}",
            )
        offs, sizes = slot.local_box(slot.box)
        if len(slot.offset) != nd or not all(
            o >= 0 and o + s <= n for o, s, n in zip(offs, sizes, slot.local_shape, strict=True)
        ):
            return Problem(
                kind="out-of-range",
                tensor=meta.name,
                ranks=ranks,
                message=f"{self.role} rank {slot.rank}: box {slot.box} of {meta.name!r} lands at "
                f"{list(offs)} size {list(sizes)}, outside local {slot.local!r} of shape {list(slot.local_shape)}",
            )
        return None

    def _checked(self, info: GridInfo) -> Iterable[tuple[int, tuple[int, ...]]]:
        """``(rank, coord)`` of the grid's ranks whose storage this set checks,
        in mesh order: found through the ranks to check, not by walking a
        mesh of thousands for one rank."""
        mine = self.check_ranks
        if mine is None:
            return zip(info.ranks, info.coords, strict=True)
        found = sorted((c, r) for r in mine for c in info.coord_of.get(r, ()))
        return [(r, c) for c, r in found]

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
            for r, c in self._checked(info):
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

    def geometry_ids(self) -> list[int]:
        """:meth:`geometry_id` of every grid, by grid id (do not change it)."""
        if self.grids:
            self.geometry_id(len(self.grids) - 1)
        return self._geo_of_grid

    def describe(self, name: str) -> tuple[object, tuple[Sequence[tuple[int, int]], tuple[Slot, ...]]]:
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
