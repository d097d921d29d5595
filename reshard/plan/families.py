"""Families of tensors that plan alike, and the geometry they share.

The planner's step 1 (:func:`build_families`) and the lookups behind step 2
(:class:`Geometry`): which ranks of a mesh are in which domain, which boxes
sources hold, which boxes a domain needs, and how those cut a tensor. Each
is worked out once for everything that shares it, so one rank's plan costs
what that rank touches: a destination rank resolves its own domain, a
source rank the domains its families go to, and neither walks the ranks of
a mesh per family.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from reshard.errors import Problem
from reshard.plan.box import Box
from reshard.plan.index import POS_BITS, LayoutSet, Ref, unpack
from reshard.plan.layout import GridInfo, Slot, TensorMeta, cast_ok, dtype_size, grid_box
from reshard.plan.regions import Cells, Holders, Needs, cut

__all__ = ["Entries", "Family", "Geometry", "Side", "build_families", "entries_of"]


@dataclass(slots=True)
class Side:
    """What one side of a family's plan depends on: the shape, the grids
    (those of the first tensor seen; others are laid out alike) and the
    explicit pieces' ranks and boxes. Families of one shape laid out alike
    on one side share it."""

    shape: tuple[int, ...]
    grids: tuple[int, ...]
    slots: tuple[Slot, ...]


Entries = Sequence[tuple[int, int]] | int
"""Where a tensor sits in one side's grids: its (grid id, position) list,
aligned with the family's grids, or for a tensor in one grid the packed int
of :class:`~reshard.plan.index.TensorGrids` (read with :func:`entries_of`)."""

Member = tuple[str, int, str, Entries, tuple[Slot, ...], Entries, tuple[Slot, ...]]
"""A family's tensor: (name, ordinal, destination dtype, then per side (source,
destination) its grid entries and explicit slots, aligned with the family's
grids and slots). One tuple per tensor: this is built for every tensor."""


def entries_of(entries: Entries) -> Sequence[tuple[int, int]]:
    """A member's grid entries as a (grid id, position) list."""
    return [unpack(entries)] if isinstance(entries, int) else entries


@dataclass(slots=True)
class Family:
    """Tensors of one shape and dtype, held and needed alike."""

    index: int
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    # Geometry (shared by members): the first member's grids and slots, and
    # the ids of its source and destination sides (shared with other families).
    src_grids: tuple[int, ...]
    src_slots: tuple[Slot, ...]
    dst_grids: tuple[int, ...]
    dst_slots: tuple[Slot, ...]
    src_side: int
    dst_side: int
    members: list[Member] = field(default_factory=list)
    refs: dict[tuple, tuple] = field(default_factory=dict)
    """Grid refs with their box, by (side, grid position, coord): equal for every member."""
    checked: bool = False
    """Every destination domain resolved and checked."""

    @property
    def names(self) -> list[str]:
        return [m[0] for m in self.members]

    @property
    def ordinals(self) -> list[int]:
        return [m[1] for m in self.members]


def build_families(
    order: list[TensorMeta], src: LayoutSet, dst: LayoutSet
) -> tuple[list[Family], list[Side], list[Side], list[Problem]]:
    """Group the destination tensors in ``order`` into families; each entry
    of ``order`` becomes the source's meta (the canonical dtype is the
    source's: that is what moves). Returns the families, the source and
    destination sides, and the tensors no source has or has otherwise."""
    src_metas = src.metas
    families: dict[tuple, Family] = {}
    src_ids: dict[tuple, int] = {}
    dst_ids: dict[tuple, int] = {}
    src_sides: list[Side] = []
    dst_sides: list[Side] = []
    problems: list[Problem] = []
    missing: list[str] = []
    s_one, s_slots_of, s_geo_ids = src.tensor_grids.one.get, src.tensor_slots.get, src.geometry_ids()
    d_one, d_slots_of, d_geo_ids = dst.tensor_grids.one.get, dst.tensor_slots.get, dst.geometry_ids()
    s_no_slots, d_no_slots = not src.tensor_slots, not dst.tensor_slots
    for ordinal, meta in enumerate(order):
        name = meta.name
        smeta = src_metas.get(name)
        if smeta is None:
            missing.append(name)
            continue
        if smeta is not meta and (
            smeta.shape != meta.shape or (smeta.dtype != meta.dtype and not cast_ok(smeta.dtype, meta.dtype))
        ):
            why = "" if smeta.shape != meta.shape else f" ({smeta.dtype} cannot be cast to {meta.dtype} on arrival)"
            problems.append(
                Problem(
                    kind="mismatch",
                    tensor=name,
                    ranks=(src.declared_by(name), dst.declared_by(name)),
                    message=(
                        f"tensor {name!r}: source rank {src.declared_by(name)} has shape {list(smeta.shape)} "
                        f"{smeta.dtype}, destination rank {dst.declared_by(name)} needs shape "
                        f"{list(meta.shape)} {meta.dtype}{why}"
                    ),
                )
            )
            continue
        order[ordinal] = smeta
        # describe() inlined for the common case (one grid a side, no
        # explicit pieces): this loop runs once per tensor, and such a
        # tensor's storage stays the packed (grid id, position) int.
        s_entries: Entries | None = s_one(name)
        s_slots: tuple[Slot, ...] = ()
        s_geo: object
        if isinstance(s_entries, int) and (s_no_slots or not s_slots_of(name)):
            s_geo = s_geo_ids[s_entries >> POS_BITS]
        else:
            s_geo, (s_entries, s_slots) = src.describe(name)
        d_entries: Entries | None = d_one(name)
        d_slots: tuple[Slot, ...] = ()
        d_geo: object
        if isinstance(d_entries, int) and (d_no_slots or not d_slots_of(name)):
            d_geo = d_geo_ids[d_entries >> POS_BITS]
        else:
            d_geo, (d_entries, d_slots) = dst.describe(name)
        shape = smeta.shape
        key = (shape, smeta.dtype, s_geo, d_geo)
        fam = families.get(key)
        if fam is None:
            s_grids = tuple(g for g, _ in entries_of(s_entries))
            d_grids = tuple(g for g, _ in entries_of(d_entries))
            sid = src_ids.setdefault((shape, s_geo), len(src_ids))
            if sid == len(src_sides):
                src_sides.append(Side(shape, s_grids, s_slots))
            did = dst_ids.setdefault((shape, d_geo), len(dst_ids))
            if did == len(dst_sides):
                dst_sides.append(Side(shape, d_grids, d_slots))
            fam = families[key] = Family(
                index=len(families),
                shape=shape,
                dtype=smeta.dtype,
                itemsize=dtype_size(smeta.dtype),
                src_grids=s_grids,
                src_slots=s_slots,
                dst_grids=d_grids,
                dst_slots=d_slots,
                src_side=sid,
                dst_side=did,
            )
        fam.members.append((name, ordinal, meta.dtype, s_entries, s_slots, d_entries, d_slots))
    if missing:  # in natural order, as ``order`` is
        problems.append(
            Problem(
                kind="unknown-tensor",
                tensor=missing[0],
                ranks=tuple(sorted({dst.declared_by(n) for n in missing[:50]})),
                message=(
                    f"{len(missing)} tensor(s) needed by destination ranks are published by no source: "
                    + ", ".join(repr(n) for n in missing[:8])
                    + (" ..." if len(missing) > 8 else "")
                    + f" (first needed by rank {dst.declared_by(missing[0])})"
                ),
            )
        )
    return list(families.values()), src_sides, dst_sides, problems


class Geometry:
    """What families resolve against, each worked out once for all that share it.

    ``resolve(fam, domain)`` gives the boxes the domain's ranks need
    (:class:`Needs`, once per destination side and domain), the boxes
    sources hold (:class:`Holders`, once per source side) and the cut of the
    one by the other (:class:`Cells`, once per pair of box lists). Ranks of
    a mesh are sorted into domains once per mesh.
    """

    def __init__(
        self,
        sources: LayoutSet,
        dests: LayoutSet,
        src_sides: list[Side],
        dst_sides: list[Side],
        domain_of: Callable[[int], int],
    ) -> None:
        self.sources = sources
        self.dests = dests
        self.src_sides = src_sides
        self.dst_sides = dst_sides
        self.domain_of = domain_of
        self._holders: dict[int, tuple[Holders, int]] = {}
        self._needs: dict[tuple[int, int], tuple[Needs, int]] = {}
        self._side_domains: dict[int, tuple[int, ...]] = {}
        self._mesh_domains: dict[object, dict[int, list[tuple[int, tuple[int, ...]]]]] = {}
        self._box_ids: dict[tuple[Box, ...], int] = {}
        self._cells: dict[tuple[int, int], Cells] = {}
        self._on: dict[tuple[bool, int, int], bool] = {}

    def resolve(self, fam: Family, domain: int) -> tuple[Needs, Holders, Cells] | None:
        """The family in ``domain``; ``None`` when no rank there needs any of it."""
        needs, nkey = self.needs(fam, domain)
        if not needs.items:
            return None
        holders, hkey = self.holders(fam)
        cells = self._cells.get((nkey, hkey))
        if cells is None:
            cells = self._cells[(nkey, hkey)] = cut(needs.boxes, holders.boxes)
        return needs, holders, cells

    def _box_id(self, boxes: tuple[Box, ...]) -> int:
        return self._box_ids.setdefault(boxes, len(self._box_ids))

    def by_domain(self, info: GridInfo) -> dict[int, list[tuple[int, tuple[int, ...]]]]:
        """Ranks (with coords) of a grid's mesh by domain, once per mesh."""
        mesh = info.grid.mesh
        got = self._mesh_domains.get(mesh)
        if got is None:
            got = self._mesh_domains[mesh] = {}
            dom = self.domain_of
            for r, c in zip(info.ranks, info.coords, strict=True):
                got.setdefault(dom(r), []).append((r, c))
        return got

    def domains(self, fam: Family) -> tuple[int, ...]:
        """Every domain with a rank that needs the family's tensors."""
        got = self._side_domains.get(fam.dst_side)
        if got is None:
            side = self.dst_sides[fam.dst_side]
            doms: set[int] = set()
            for g in side.grids:
                doms.update(self.by_domain(self.dests.grids[g]))
            doms.update(self.domain_of(s.rank) for s in side.slots)
            got = self._side_domains[fam.dst_side] = tuple(sorted(doms))
        return got

    def on_side(self, source: bool, side_id: int, rank: int) -> bool:
        """Is ``rank`` on a grid or slot of this side (holding or needing, maybe nothing)?"""
        key = (source, side_id, rank)
        got = self._on.get(key)
        if got is None:
            side = (self.src_sides if source else self.dst_sides)[side_id]
            grids = (self.sources if source else self.dests).grids
            got = any(rank in grids[g].coord_of for g in side.grids) or any(s.rank == rank for s in side.slots)
            self._on[key] = got
        return got

    def holders(self, fam: Family) -> tuple[Holders, int]:
        """Who holds which box of the family's tensors, once per source side."""
        got = self._holders.get(fam.src_side)
        if got is None:
            side = self.src_sides[fam.src_side]
            by_box: dict[Box, list[tuple[int, Ref]]] = {}
            for gi, g in enumerate(side.grids):
                for box, ranks, coords in self.sources.grids[g].holders(side.shape):
                    by_box.setdefault(box, []).extend((r, ("g", gi, c)) for r, c in zip(ranks, coords, strict=True))
            for si, s in enumerate(side.slots):
                if not s.box.is_empty():
                    by_box.setdefault(s.box, []).append((s.rank, ("s", si)))
            holders = Holders([(b, sorted(m, key=lambda x: x[0])) for b, m in by_box.items()])
            got = self._holders[fam.src_side] = (holders, self._box_id(holders.boxes))
        return got

    def needs(self, fam: Family, domain: int) -> tuple[Needs, int]:
        """What ``domain``'s ranks need of the family's tensors, once per destination side."""
        key = (fam.dst_side, domain)
        got = self._needs.get(key)
        if got is None:
            side = self.dst_sides[fam.dst_side]
            shape = side.shape
            items: list[tuple[int, Box, Ref]] = []
            for gi, g in enumerate(side.grids):
                info = self.dests.grids[g]
                grid = info.grid
                for r, c in self.by_domain(info).get(domain, ()):
                    box = grid_box(grid, shape, c)
                    if not box.is_empty():
                        items.append((r, box, ("g", gi, c)))
            for si, s in enumerate(side.slots):
                if self.domain_of(s.rank) == domain and not s.box.is_empty():
                    items.append((s.rank, s.box, ("s", si)))
            needs = Needs(items)
            got = self._needs[key] = (needs, self._box_id(needs.boxes))
        return got

    def most_per_rank(self, source: bool, side_id: int) -> int:
        """The most elements of one tensor any one rank holds (or needs) on a side."""
        geo = (self.src_sides if source else self.dst_sides)[side_id]
        side = self.sources if source else self.dests
        if not geo.slots and len(geo.grids) == 1:
            info = side.grids[geo.grids[0]]
            if info.distinct_ranks:
                # One box per rank: the largest box, one per group of ranks.
                return max((box.numel for box, _, _ in info.holders(geo.shape)), default=0)
        per_rank: Counter = Counter()
        for g in geo.grids:
            for box, ranks, _ in side.grids[g].holders(geo.shape):
                for r in ranks:
                    per_rank[r] += box.numel
        for sl in geo.slots:
            per_rank[sl.rank] += sl.box.numel
        return max(per_rank.values(), default=0)
