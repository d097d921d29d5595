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
   replicas and leaders share them. The cut depends on boxes only, so it is
   shared by families and domains laid out alike (:mod:`reshard.plan.regions`).
3. **Decide.** Replica and leader choices rotate with the tensor's ordinal,
   the region, the part and the domain: deterministic everywhere and
   balanced over many tensors.
4. **Rounds.** Tensors in canonical (natural name) order are cut into row
   blocks and packed into rounds of at most ``round_bytes`` of tensor data;
   a transfer moves in the round of its block, a forward one round after
   its pull. Round numbers depend only on names, shapes and dtypes, so every
   pair of peers agrees on them.

What one rank's plan costs
==========================

A rank resolves only the (family, domain) pairs it takes part in: a
destination rank its own domain, a source rank every domain of the families
it holds. Which ranks of a grid are in which domain is worked out once per
mesh, which boxes sources hold once per source geometry, which boxes a
domain needs once per destination geometry and domain; families keep no
per-rank sets. Only the cells a rank needs or holds become regions.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from functools import cached_property
from operator import attrgetter

from reshard.errors import PlanError, Problem
from reshard.plan.box import Box
from reshard.plan.families import Family, Geometry, build_families
from reshard.plan.index import POS_BITS, POS_MASK, LayoutSet, Ref, gc_paused, natural_order
from reshard.plan.items import RankPlan, Round, Transfer, TransferKind
from reshard.plan.layout import Slot, TensorMeta, dtype_size, grid_box, storage_offset, zeros
from reshard.plan.regions import Decision, Endpoint, bits, decide_for, problems, region
from reshard.plan.rounds import DEFAULT_ROUND_BYTES, RoundTable
from reshard.plan.traffic import Traffic

__all__ = ["DEFAULT_SPLIT_BYTES", "Decision", "Endpoint", "Planner"]

DEFAULT_SPLIT_BYTES = 16 << 20
"""Regions larger than this are split so several replicas and leaders share them."""

_FWD = TransferKind.FWD
_COPY = TransferKind.COPY


_BY_ORDINAL = attrgetter("ordinal")


def _sort(ts: list[Transfer]) -> None:
    """Sort by :meth:`Transfer.sort_key`; by the ordinal alone (a key read
    in C, not a method call per transfer) when no two share one."""
    if len(ts) > 1:
        if len(set(map(_BY_ORDINAL, ts))) == len(ts):
            ts.sort(key=_BY_ORDINAL)
        else:
            ts.sort(key=Transfer.sort_key)


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
        self._domain: Callable[[int], int]
        if domain_of is None:
            self._domain = lambda r: r
        elif callable(domain_of):
            self._domain = domain_of
        else:
            mapping = dict(domain_of)
            self._domain = lambda r: mapping.get(r, -1 - r)
        self.split_bytes = split_bytes
        self._problems: list[Problem] = list(sources.problems) + list(dests.problems)
        self._checked: set[tuple[int, int]] = set()
        self._region_problems: dict[tuple[int, int], list[Problem]] = {}
        with gc_paused():
            # Destination tensors in checkpoint order; each takes the source's
            # dtype (the canonical one) once its families are built.
            self.order: list[TensorMeta] = natural_order(list(dests.metas.values()))
            self._families, src_sides, dst_sides, found = build_families(self.order, sources, dests)
        self._problems.extend(found)
        self._geo = Geometry(sources, dests, src_sides, dst_sides, self._domain)
        self.round_bytes = round_bytes
        self._rounds: RoundTable | None = None

    @cached_property
    def ordinal(self) -> dict[str, int]:
        """Position of each destination tensor in :attr:`order`."""
        return {m.name: i for i, m in enumerate(self.order)}

    @property
    def rounds(self) -> RoundTable:
        """The round table, built on first use: only once the inputs passed
        their checks, since its shares read every family's geometry."""
        if self._rounds is None:
            with gc_paused():
                self._rounds = RoundTable(self.order, self.round_bytes, self._shares())
        return self._rounds

    # -- inputs -----------------------------------------------------------

    def domain(self, rank: int) -> int:
        return self._domain(rank)

    def _shares(self) -> list[int]:
        """Per tensor (by ordinal): max elements one rank receives + max one rank sends from."""
        shares = [-1] * len(self.order)
        dst_top: dict[int, int] = {}
        src_top: dict[int, int] = {}
        geo = self._geo
        for fam in self._families:
            d = dst_top.get(fam.dst_side)
            if d is None:
                d = dst_top[fam.dst_side] = geo.most_per_rank(False, fam.dst_side)
            s = src_top.get(fam.src_side)
            if s is None:
                s = src_top[fam.src_side] = geo.most_per_rank(True, fam.src_side)
            most = d + s
            for member in fam.members:
                shares[member[1]] = most
        if -1 in shares:  # tensors in no family (refused: no source, or a mismatch)
            shares = [math.prod(m.shape) if x < 0 else x for x, m in zip(shares, self.order, strict=True)]
        return shares

    # -- checks -----------------------------------------------------------

    def _check(self, fam: Family, domain: int) -> None:
        """Resolve and check the family for ``domain``, recording problems."""
        got = self._geo.resolve(fam, domain)
        if got is None:
            return
        needs, _, cells = got
        if cells.uncovered or not needs.distinct:
            found = problems(cells, needs, fam.names, fam.shape)
            if found:
                self._region_problems[(fam.index, domain)] = found

    def problems(self, rank: int | None = None) -> list[Problem]:
        """Problems with the inputs; with ``rank``, only those its plan touches
        (plus every problem found while indexing the layouts)."""
        for fam in self._families:
            if fam.checked:
                continue
            if rank is None or self._geo.on_side(True, fam.src_side, rank):
                for dom in self._geo.domains(fam):
                    if (fam.index, dom) not in self._checked:
                        self._check(fam, dom)
                fam.checked = True
            elif self._geo.on_side(False, fam.dst_side, rank):
                key = (fam.index, self._domain(rank))
                if key not in self._checked:
                    self._checked.add(key)
                    self._check(fam, key[1])
        out = list(self._problems)
        for key in sorted(self._region_problems):
            out.extend(self._region_problems[key])
        return out

    def check(self, rank: int | None = None) -> None:
        problems = self.problems(rank)
        if problems:
            raise PlanError(problems)

    # -- a rank's plan ----------------------------------------------------

    def plan_for(self, rank: int) -> RankPlan:
        """The transfers ``rank`` takes part in, grouped by round and peer.

        Raises :class:`PlanError` if the inputs it touches have problems.
        """
        with gc_paused():
            return self._plan_for(rank)

    def _resolve_ref(self, fam: Family, side: str, ref: Ref) -> tuple:
        """A ref with its grid box looked up once per family: ("s", i) or
        ("g", gi, coord, box, zero offsets). The same object for the same
        place, so a slot built for it is reused while decisions name it."""
        if ref[0] == "s":
            return ref
        _, gi, coord = ref
        key = (side, gi, coord)
        got = fam.refs.get(key)
        if got is None:
            info = (self.sources if side == "src" else self.dests).grids[
                (fam.src_grids if side == "src" else fam.dst_grids)[gi]
            ]
            box = grid_box(info.grid, fam.shape, coord)
            got = fam.refs[key] = ("g", gi, coord, box, zeros(len(box.sizes)))
        return got

    def _row(self, fam: Family, rank: int, decisions: list[Decision]) -> list[tuple]:
        """``rank``'s decisions with refs resolved: (kind, src rank, reads a
        destination slot, src ref, dst rank, dst ref, where it goes (``None``:
        a local copy, ``True``: a send, ``False``: a receive), the peer)."""
        out = []
        for kind, (sr, sref), (dr, dref) in decisions:
            fwd = kind is _FWD
            s = self._resolve_ref(fam, "dst" if fwd else "src", sref)
            where = None if kind is _COPY else sr == rank
            out.append((kind, sr, fwd, s, dr, self._resolve_ref(fam, "dst", dref), where, dr if where else sr))
        return out

    def _emit(self, fam: Family, rank: int, tables: list, rounds: dict[int, Round]) -> None:
        """Instantiate the decisions in ``tables`` for every member of ``fam``."""
        # Resolve refs once per family and domain, not once per member.
        prepared: list[tuple] = []
        for part, period, per, reg, base in tables:
            rows = None if per is None else [self._row(fam, rank, decisions) for decisions in per]
            prepared.append((part, part.numel, period, rows, reg, base))
        src_grids, dst_grids = self.sources.grids, self.dests.grids
        table = self.rounds
        first_round, num_blocks, split = table.first_round, table.num_blocks, table.split
        itemsize = fam.itemsize
        src_dtype = fam.dtype
        # This loop runs once per transfer of the plan (tens of thousands):
        # slots are built inline, and a slot is reused while consecutive
        # decisions name the same place (a sender's box sent to many peers).
        # Each member's first decision sets both (the keys start at None).
        s_slot: Slot = None  # type: ignore[assignment]
        d_slot: Slot = None  # type: ignore[assignment]
        for name, ordinal, dst_dtype, s_entries, s_slots, d_entries, d_slots in fam.members:
            single = first_round[ordinal] if num_blocks[ordinal] == 1 else None
            s_key = d_key = None
            for part, numel, period, rows, reg, base in prepared:
                if rows is not None:
                    row = rows[ordinal % period]
                else:
                    row = self._row(fam, rank, decide_for(reg, ordinal + base, rank))
                for kind, sr, fwd, sref, dr, dref, where, peer in row:
                    if sref is not s_key:
                        s_key = sref
                        if sref[0] == "s":
                            s_slot = (d_slots if fwd else s_slots)[sref[1]]
                        else:
                            # GridInfo.slot, inlined: twice per transfer.
                            e = d_entries if fwd else s_entries
                            if isinstance(e, int):
                                gid, pos = e >> POS_BITS, e & POS_MASK
                            else:
                                gid, pos = e[sref[1]]
                            st = (dst_grids if fwd else src_grids)[gid].storage
                            box = sref[3]
                            dtype = dst_dtype if fwd else src_dtype
                            if st is None:
                                s_slot = Slot(sr, box, name, box.sizes, sref[4], (), dtype)
                            else:
                                s_slot = Slot(sr, box, st[0], st[1], storage_offset(st, pos), st[2], st[3] or dtype)
                    if dref is not d_key:
                        d_key = dref
                        if dref[0] == "s":
                            d_slot = d_slots[dref[1]]
                        else:
                            if isinstance(d_entries, int):
                                gid, pos = d_entries >> POS_BITS, d_entries & POS_MASK
                            else:
                                gid, pos = d_entries[dref[1]]
                            st = dst_grids[gid].storage
                            box = dref[3]
                            if st is None:
                                d_slot = Slot(dr, box, name, box.sizes, dref[4], (), dst_dtype)
                            else:
                                d_slot = Slot(dr, box, st[0], st[1], storage_offset(st, pos), st[2], st[3] or dst_dtype)
                    wire_size = dtype_size(s_slot.dtype) if fwd else itemsize
                    if single is not None:
                        parts: Iterable[tuple[int, Box, int]] = ((single + fwd, part, numel),)
                    else:
                        parts = [(rnd + fwd, sub, sub.numel) for rnd, sub in split(ordinal, part)]
                    for rnd, sub, n in parts:
                        t = Transfer(name, sub, s_slot, d_slot, kind, rnd, n * wire_size, ordinal, s_slot.dtype)
                        rp = rounds.get(rnd)
                        if rp is None:
                            rp = rounds[rnd] = Round(rnd)
                        if where is None:
                            rp.copies.append(t)
                            continue
                        by_peer = rp.sends if where else rp.recvs
                        got = by_peer.get(peer)
                        if got is None:
                            by_peer[peer] = [t]
                        else:
                            got.append(t)

    def _plan_for(self, rank: int) -> RankPlan:
        self.check(rank)
        my_domain = self._domain(rank)
        rounds: dict[int, Round] = {}
        domain_of, split_bytes, geo = self._domain, self.split_bytes, self._geo
        for fam in self._families:
            is_src = geo.on_side(True, fam.src_side, rank)
            if not is_src and not geo.on_side(False, fam.dst_side, rank):
                continue
            holders = geo.holders(fam)[0]
            hbits = holders.bits_of(rank) if is_src else 0
            n_members = len(fam.members)
            tables: list[tuple] = []
            # A rank that holds part of the family may send it to any domain;
            # one that only needs it, or holds nothing of it, plans its own.
            for dom in geo.domains(fam) if hbits else (my_domain,):
                nbits = geo.needs(fam, dom)[0].bits.get(rank, 0)
                got = geo.resolve(fam, dom) if nbits or hbits else None
                if got is None:
                    continue
                needs, _, cells = got
                walk = cells.walk
                # Per part: the decisions that involve this rank, by rotation residue.
                for ri, ci in enumerate(cells.order):
                    nmask, hmask, _ = walk[ci]
                    if not (nmask & nbits or hmask & hbits):
                        continue
                    reg = region(cells, ci, needs, holders, dom, domain_of, fam.itemsize, split_bytes)
                    period = reg.period
                    for pi, part in enumerate(reg.parts):
                        base = ri + pi + dom
                        # Decisions repeat with the period: tabulate them when
                        # members outnumber residues, else decide per member.
                        if period <= n_members:
                            per = [decide_for(reg, res + base, rank) for res in range(period)]
                            if any(per):
                                tables.append((part, period, per, reg, base))
                        else:
                            tables.append((part, 0, None, reg, base))
            if tables:
                self._emit(fam, rank, tables, rounds)
        out = [rounds[k] for k in sorted(rounds)]
        for rp in out:
            for ts in rp.sends.values():
                _sort(ts)
            for ts in rp.recvs.values():
                _sort(ts)
            _sort(rp.copies)
        return RankPlan(rank=rank, rounds=out, num_rounds=self.rounds.num_rounds + 1)

    # -- the whole plan ---------------------------------------------------

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
        pairs, transfers, local = t.pairs, t.transfers, t.local
        domain_of, split_bytes, geo = self._domain, self.split_bytes, self._geo
        # The decisions of region() and decide(), on ranks only: this visits
        # every cell of every family in every domain (millions at 2,048 ranks).
        for fam in self._families:
            itemsize = fam.itemsize
            n_members = len(fam.members)
            hists: dict[int, list[tuple[int, int]]] = {}
            for d in geo.domains(fam):
                got = geo.resolve(fam, d)
                if got is None:
                    continue
                needs, holders, cells = got
                items = needs.items
                walk, numels = cells.walk, cells.numels
                for ri, ci in enumerate(cells.order):
                    nmask, hmask, _ = walk[ci]
                    hs, hlist, doms = holders.merged(hmask, domain_of)
                    if nmask & (nmask - 1):
                        needers = sorted(items[j][0] for j in bits(nmask))
                    else:
                        needers = [items[nmask.bit_length() - 1][0]]
                    pulling = [n for n in needers if n not in hs]
                    if len(pulling) < len(needers):
                        cell_bytes = numels[ci] * itemsize * n_members
                        for n in needers:
                            if n in hs:
                                local[n] += cell_bytes
                    n_pull = len(pulling)
                    if not n_pull:
                        continue
                    if d in doms:
                        srcs = [h[0] for h in hlist if domain_of(h[0]) == d]
                        cands, inside = len(srcs), True
                    else:
                        srcs = [h[0] for h in hlist]
                        cands, inside = max(len(srcs), n_pull), False
                    n_src = len(srcs)
                    parts = cells.parts(ci, fam.itemsize, cands, split_bytes)
                    if n_src == 1 and n_pull == 1:
                        # One sender, one receiver: every part of every member.
                        key = (srcs[0], pulling[0])
                        pairs[key] += numels[ci] * itemsize * n_members
                        transfers[key] += len(parts) * n_members
                        continue
                    period = math.lcm(n_src, n_pull)
                    hist = hists.get(period)
                    if hist is None:
                        hist = hists[period] = sorted(Counter(m[1] % period for m in fam.members).items())
                    for pi, part in enumerate(parts):
                        nbytes = part.numel * itemsize
                        for residue, count in hist:
                            rot = residue + ri + pi + d
                            size = nbytes * count
                            if inside:
                                for j, n in enumerate(pulling):
                                    key = (srcs[(rot + j) % n_src], n)
                                    pairs[key] += size
                                    transfers[key] += count
                                continue
                            leader = pulling[rot % n_pull]
                            key = (srcs[rot % n_src], leader)
                            pairs[key] += size
                            transfers[key] += count
                            for n in pulling:
                                if n != leader:
                                    key = (leader, n)
                                    pairs[key] += size
                                    transfers[key] += count
        return t.finish()

    def domain_ingress(self) -> Counter:
        """Per destination domain, bytes its ranks need that no rank in it holds
        (each element counted once per domain): what must cross into it."""
        self.check()
        out: Counter = Counter()
        with gc_paused():
            for fam in self._families:
                per = fam.itemsize * len(fam.members)
                for d in self._geo.domains(fam):
                    resolved = self._geo.resolve(fam, d)
                    if resolved is None:
                        continue
                    _, holders, cells = resolved
                    got = 0
                    for (_, hmask, _), numel in zip(cells.walk, cells.numels, strict=True):
                        if d not in holders.merged(hmask, self._domain)[2]:
                            got += numel
                    if got:
                        out[d] += got * per
        return out

    # -- facts for reports --------------------------------------------------

    @property
    def num_families(self) -> int:
        return len(self._families)

    def needed_bytes(self, rank: int) -> int:
        """Bytes of destination data ``rank`` keeps (from its layout)."""
        total = 0
        for fam in self._families:
            if not self._geo.on_side(False, fam.dst_side, rank):
                continue
            per = 0
            for g in fam.dst_grids:
                info = self.dests.grids[g]
                for c in info.coord_of.get(rank, ()):
                    per += grid_box(info.grid, fam.shape, c).numel
            per += sum(s.box.numel for s in fam.dst_slots if s.rank == rank)
            total += per * fam.itemsize * len(fam.members)
        return total
