"""Regions: how the boxes a domain needs and the boxes sources hold cut a
tensor, and who moves each part (the planner's steps 2 and 3).

The cut depends on boxes alone, not on ranks: :class:`Cells` is computed once
per pair (boxes one domain's ranks need, boxes the sources hold) and shared
by every family and domain laid out alike. DeepSeek-V3 on 2,048 ranks has
2,244 families and 128 destination domains; the expert families of other EP
ranks and the domains of other engine replicas differ only in their ranks,
so 39 cuts serve all of them, and a rank's work grows with the
families and domains it touches, not with how many ranks each spans.
:func:`region` then puts ranks on one cell: who needs it, who holds it,
inside or outside the domain.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from reshard.errors import Problem
from reshard.plan.box import Box, chunk_range, merge_boxes
from reshard.plan.index import Ref
from reshard.plan.items import TransferKind

__all__ = [
    "Cells",
    "Decision",
    "Endpoint",
    "Holders",
    "Needs",
    "Region",
    "cut",
    "decide",
    "decide_for",
    "region",
    "split",
]


class Endpoint(NamedTuple):
    """One side of a decision: a rank and where it holds (or needs) the region."""

    rank: int
    ref: Ref


class Decision(NamedTuple):
    """Who moves one part of a region to whom, and how."""

    kind: TransferKind
    src: Endpoint
    dst: Endpoint


def bits(mask: int) -> list[int]:
    """Indices of the set bits of ``mask``, lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class Needs:
    """The non-empty boxes one domain's ranks need of the tensors of one
    destination geometry: ``items[j] = (rank, box, ref)``."""

    __slots__ = ("bits", "boxes", "distinct", "endpoints", "items")

    def __init__(self, items: list[tuple[int, Box, Ref]]) -> None:
        self.items = items
        self.boxes = tuple(b for _, b, _ in items)
        self.endpoints = [Endpoint(r, ref) for r, _, ref in items]
        self.bits: dict[int, int] = {}
        for j, (r, _, _) in enumerate(items):
            self.bits[r] = self.bits.get(r, 0) | 1 << j
        # Two needs of one rank in one cell are an overlap; with no rank
        # twice in the list, no cell can have one.
        self.distinct = len(self.bits) == len(items)


class Holders:
    """The boxes sources hold of the tensors of one source geometry: per
    distinct box (``boxes[j]``), its holders by rank (first ref each)."""

    __slots__ = ("_bits", "_merged", "boxes", "refs")

    def __init__(self, items: list[tuple[Box, list[tuple[int, Ref]]]]) -> None:
        self.boxes = tuple(b for b, _ in items)
        self.refs: list[dict[int, Ref]] = []
        for _, members in items:
            hs: dict[int, Ref] = {}
            for r, ref in members:
                hs.setdefault(r, ref)
            self.refs.append(hs)
        self._merged: dict[int, tuple[dict[int, Ref], list[Endpoint], dict[int, int]]] = {}
        self._bits: dict[int, int] = {}

    def merged(
        self, hmask: int, domain_of: Callable[[int], int]
    ) -> tuple[dict[int, Ref], list[Endpoint], dict[int, int]]:
        """Holders of every box in ``hmask``: ``(ref by rank, endpoints by
        rank, how many in each domain)``. Shared: callers must not change them."""
        got = self._merged.get(hmask)
        if got is None:
            js = bits(hmask)
            if len(js) == 1:
                hs = self.refs[js[0]]
            else:
                hs = {}
                for j in js:
                    for r, ref in self.refs[j].items():
                        hs.setdefault(r, ref)
            ends = [Endpoint(r, ref) for r, ref in sorted(hs.items())]
            doms: dict[int, int] = {}
            for r in hs:
                d = domain_of(r)
                doms[d] = doms.get(d, 0) + 1
            got = self._merged[hmask] = (hs, ends, doms)
        return got

    def bits_of(self, rank: int) -> int:
        """The boxes ``rank`` holds, as a mask."""
        got = self._bits.get(rank)
        if got is None:
            got = self._bits[rank] = sum(1 << j for j, hs in enumerate(self.refs) if rank in hs)
        return got


class Cells:
    """How needed and held boxes cut a tensor: per cell, the needs and the
    holder boxes that cover it (bit masks) and its boxes, merged.

    ``walk`` lists cells in the order the cut finds them (problems are
    reported in that order); ``order`` lists them in region order, by their
    first box's offsets (cells are disjoint, so no two share one).
    """

    __slots__ = ("_parts", "numels", "order", "uncovered", "walk")

    def __init__(self, walk: list[tuple[int, int, list[Box]]]) -> None:
        self.walk = walk
        self.numels = [sum(b.numel for b in boxes) for _, _, boxes in walk]
        self.order = sorted(range(len(walk)), key=lambda i: walk[i][2][0].offsets)
        self.uncovered = any(not h for _, h, _ in walk)
        self._parts: dict[tuple[int, int, int], list[Box]] = {}

    def parts(self, i: int, itemsize: int, cands: int, split_bytes: int) -> list[Box]:
        """Cell ``i``'s boxes, those over ``split_bytes`` split ``cands`` ways."""
        key = (i, itemsize, cands)
        got = self._parts.get(key)
        if got is None:
            got = []
            for b in self.walk[i][2]:
                got.extend(split(b, itemsize, cands, split_bytes))
            self._parts[key] = got
        return got


def cut(needs: Sequence[Box], held: Sequence[Box]) -> Cells:
    """Cut the span of ``needs`` at every edge of a needed or held box."""
    if not needs:
        return Cells([])
    nd = needs[0].ndim
    # Cut points per dim, and per interval the bitmask of needs / holders covering it.
    intervals: list[list[tuple[int, int]]] = []
    need_masks: list[list[int]] = []
    hold_masks: list[list[int]] = []
    for d in range(nd):
        lo = min(b.offsets[d] for b in needs)
        hi = max(b.offsets[d] + b.sizes[d] for b in needs)
        cuts = {lo, hi}
        for b in needs:
            cuts.add(b.offsets[d])
            cuts.add(b.offsets[d] + b.sizes[d])
        for b in held:
            for x in (b.offsets[d], b.offsets[d] + b.sizes[d]):
                if lo < x < hi:
                    cuts.add(x)
        cl = sorted(cuts)
        iv = list(itertools.pairwise(cl))
        nm = [0] * len(iv)
        hm = [0] * len(iv)
        for j, b in enumerate(needs):
            for i in range(bisect_left(cl, b.offsets[d]), bisect_left(cl, b.offsets[d] + b.sizes[d])):
                nm[i] |= 1 << j
        for j, b in enumerate(held):
            a = bisect_left(cl, max(b.offsets[d], lo))
            z = bisect_left(cl, min(b.offsets[d] + b.sizes[d], hi))
            for i in range(a, z):
                hm[i] |= 1 << j
        intervals.append(iv)
        need_masks.append(nm)
        hold_masks.append(hm)
    cells: dict[tuple[int, int], list[Box]] = {}

    def walk(d: int, offs: tuple, sizes: tuple, nmask: int, hmask: int) -> None:
        if d == nd:
            cells.setdefault((nmask, hmask), []).append(Box(offs, sizes))
            return
        for (a, z), n_m, h_m in zip(intervals[d], need_masks[d], hold_masks[d], strict=True):
            m = nmask & n_m
            if m:
                walk(d + 1, (*offs, a), (*sizes, z - a), m, hmask & h_m)

    walk(0, (), (), (1 << len(needs)) - 1, (1 << len(held)) - 1)
    return Cells([(n, h, merge_boxes(boxes)) for (n, h), boxes in cells.items()])


def split(box: Box, itemsize: int, cands: int, split_bytes: int) -> list[Box]:
    """``box`` in up to ``cands`` parts when it is over ``split_bytes``."""
    nbytes = box.numel * itemsize
    if cands <= 1 or nbytes <= split_bytes or box.ndim == 0:
        return [box]
    p = min(cands, -(-nbytes // split_bytes))
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


def problems(cells: Cells, needs: Needs, names: Sequence[str], shape: tuple[int, ...]) -> list[Problem]:
    """Overlapping and uncovered cells, in the order the cut found them."""
    out: list[Problem] = []
    name = names[0]
    more = f" (and {len(names) - 1} more tensors laid out alike)" if len(names) > 1 else ""
    for nmask, hmask, merged in cells.walk:
        seen: dict[int, int] = {}
        for j in bits(nmask):
            r = needs.items[j][0]
            seen[r] = seen.get(r, 0) + 1
        dup = sorted(r for r, n in seen.items() if n > 1)
        if dup:
            out.append(
                Problem(
                    kind="overlap",
                    tensor=name,
                    ranks=tuple(dup),
                    message=f"destination rank(s) {dup} need box {merged[0]} of {name!r}{more} "
                    "through two pieces (overlapping destination pieces)",
                )
            )
            continue
        if not hmask:
            out.append(
                Problem(
                    kind="uncovered",
                    tensor=name,
                    ranks=tuple(sorted(seen)),
                    message=f"box(es) {', '.join(str(b) for b in merged[:4])} of {name!r}{more} "
                    f"(shape {list(shape)}) needed by rank(s) {sorted(seen)} are held by no source",
                )
            )
    return out


@dataclass(slots=True)
class Region:
    """One cell with ranks on it, for one domain."""

    parts: list[Box]
    needers: list[Endpoint]
    """By rank."""
    holders_in: list[Endpoint]
    """Holders inside the domain, by rank."""
    holders_out: list[Endpoint]
    """Holders outside it, by rank (only used when none is inside)."""
    copies: list[tuple[Endpoint, Endpoint]]
    """(holder, needer) pairs on one rank: local copies."""
    pulling: list[Endpoint]
    """Needers that hold nothing of the region themselves."""

    @property
    def period(self) -> int:
        """Decisions repeat with the rotation modulo this."""
        return math.lcm(max(1, len(self.holders_in) or len(self.holders_out)), max(1, len(self.pulling)))


def region(
    cells: Cells,
    i: int,
    needs: Needs,
    holders: Holders,
    domain: int,
    domain_of: Callable[[int], int],
    itemsize: int,
    split_bytes: int,
) -> Region:
    """Cell ``i`` for ``domain``: its needers, holders in and out of the
    domain, local copies, and parts (split so that candidates share them)."""
    nmask, hmask, _ = cells.walk[i]
    eps = needs.endpoints
    if nmask & (nmask - 1):
        ordered = sorted((eps[j] for j in bits(nmask)), key=lambda x: x[0])
    else:
        ordered = [eps[nmask.bit_length() - 1]]
    hs, hlist, doms = holders.merged(hmask, domain_of)
    if domain in doms:
        h_in = [h for h in hlist if domain_of(h[0]) == domain]
        h_out = [h for h in hlist if domain_of(h[0]) != domain]
    else:
        h_in, h_out = [], hlist
    copies = [(Endpoint(n[0], hs[n[0]]), n) for n in ordered if n[0] in hs]
    pulling = [n for n in ordered if n[0] not in hs] if copies else ordered
    cands = max(len(h_in) or len(h_out), len(pulling) if not h_in else 1)
    return Region(
        parts=cells.parts(i, itemsize, cands, split_bytes),
        needers=ordered,
        holders_in=h_in,
        holders_out=h_out,
        copies=copies,
        pulling=pulling,
    )


def decide(reg: Region, rot: int) -> list[Decision]:
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


def decide_for(reg: Region, rot: int, rank: int) -> list[Decision]:
    """The decisions of :func:`decide` that involve ``rank``, in its order,
    without building the others: a holder among hundreds of replicas is
    picked at one rotation in hundreds."""
    out = [Decision(TransferKind.COPY, h, n) for h, n in reg.copies if n[0] == rank]
    pulling = reg.pulling
    if not pulling:
        return out
    if reg.holders_in:
        h_in = reg.holders_in
        m = len(h_in)
        for j, n in enumerate(pulling):
            h = h_in[(rot + j) % m]
            if h[0] == rank or n[0] == rank:
                out.append(Decision(TransferKind.PULL, h, n))
        return out
    leader = pulling[rot % len(pulling)]
    h = reg.holders_out[rot % len(reg.holders_out)]
    if h[0] == rank or leader[0] == rank:
        out.append(Decision(TransferKind.PULL, h, leader))
    lead = leader[0] == rank
    for n in pulling:
        if n is not leader and (lead or n[0] == rank):
            out.append(Decision(TransferKind.FWD, leader, n))
    return out
