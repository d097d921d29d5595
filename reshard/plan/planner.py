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

import itertools
import math
from bisect import bisect_left
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from reshard.errors import PlanError, Problem
from reshard.plan.box import Box, chunk_range, merge_boxes
from reshard.plan.index import LayoutSet, Ref, gc_paused, natural_key
from reshard.plan.items import RankPlan, Round, Transfer, TransferKind
from reshard.plan.layout import GridInfo, Slot, TensorMeta, cast_ok, dtype_size, grid_box, zeros
from reshard.plan.rounds import DEFAULT_ROUND_BYTES, RoundTable
from reshard.plan.traffic import Traffic

__all__ = ["DEFAULT_SPLIT_BYTES", "Decision", "Endpoint", "Planner"]

DEFAULT_SPLIT_BYTES = 16 << 20
"""Regions larger than this are split so several replicas and leaders share them."""


class Endpoint(NamedTuple):
    """One side of a decision: a rank and where it holds (or needs) the region."""

    rank: int
    ref: Ref


class Decision(NamedTuple):
    """Who moves one part of a region to whom, and how."""

    kind: TransferKind
    src: Endpoint
    dst: Endpoint


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
        return Slot(rank, box, name, box.sizes, zeros(len(box.sizes)), (), dtype)
    return Slot(rank, box, local.name, local.shape, info.offset(pos), grid.dims, local.dtype or dtype)


@dataclass(slots=True)
class _Region:
    parts: list[Box]
    needers: list[Endpoint]
    holders: list[Endpoint]
    holders_in: list[Endpoint]
    holders_out: list[Endpoint]
    ranks: frozenset[int]
    copies: list[tuple[Endpoint, Endpoint]] = field(default_factory=list)
    """(holder, needer) pairs on one rank: local copies."""
    pulling: list[Endpoint] = field(default_factory=list)
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
        if round_bytes <= 0:
            raise ValueError(f"round_bytes must be positive, got {round_bytes}")
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
        self.round_bytes = round_bytes
        self._rounds: RoundTable | None = None

    @property
    def rounds(self) -> RoundTable:
        """The round table, built on first use: only once the inputs passed
        their checks, since its shares walk every grid's ranks."""
        if self._rounds is None:
            with gc_paused():
                self._rounds = RoundTable(self.order, self.round_bytes, self._shares())
        return self._rounds

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
            needers = [Endpoint(needs[j][0], needs[j][2]) for j in range(len(needs)) if nmask >> j & 1]
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
            hlist = [Endpoint(r, ref) for r, ref in sorted(hs.items())]
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
                    copies=[(Endpoint(n.rank, hs[n.rank]), n) for n in ordered if n.rank in hs],
                    pulling=[n for n in ordered if n.rank not in hs],
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
    def _decide(reg: _Region, rot: int) -> list[Decision]:
        """The decisions for one part of a region at rotation ``rot``."""
        out = [Decision(TransferKind.COPY, h, n) for h, n in reg.copies]
        pulling = reg.pulling
        if not pulling:
            return out
        if reg.holders_in:
            m = len(reg.holders_in)
            for j, n in enumerate(pulling):
                out.append(Decision(TransferKind.PULL, reg.holders_in[(rot + j) % m], n))
            return out
        leader = pulling[rot % len(pulling)]
        out.append(Decision(TransferKind.PULL, reg.holders_out[rot % len(reg.holders_out)], leader))
        for n in pulling:
            if n is not leader:
                out.append(Decision(TransferKind.FWD, leader, n))
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
                    s_side = "dst" if kind is TransferKind.FWD else "src"
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
        single_round = self.rounds.single
        split = self.rounds.split
        itemsize = fam.itemsize
        src_metas, dst_metas = self.sources.metas, self.dests.metas
        for m, ordinal in enumerate(fam.ordinals):
            name = fam.names[m]
            src_store = fam.src_store[m]
            dst_store = fam.dst_store[m]
            src_dtype = src_metas[name].dtype
            dst_dtype = dst_metas[name].dtype
            single = single_round(ordinal)
            for part, period, rows, reg, base in prepared:
                if rows is None:
                    row = []
                    for kind, (sr, sref), (dr, dref) in self._decide(reg, ordinal + base):
                        if rank in (sr, dr):
                            s_side = "dst" if kind is TransferKind.FWD else "src"
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
                        if kind is TransferKind.FWD:
                            rnd += 1
                        t = Transfer(name, sub, s_slot, d_slot, kind, rnd, sub.numel * wire_size, ordinal, s_slot.dtype)
                        rp = rounds.get(rnd)
                        if rp is None:
                            rp = rounds[rnd] = Round(rnd)
                        if kind is TransferKind.COPY:
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
                                if kind is TransferKind.COPY:
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
