"""Property tests of the planner against a brute-force executor."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import PlanError
from reshard.plan.box import Box, merge_boxes
from reshard.plan.index import LayoutSet
from reshard.plan.planner import Planner

from .oracle import check_destinations, execute, slots_by_rank
from .strategies import problems

SETTINGS = settings(max_examples=300, deadline=None)


def _planner(p, *, domains: bool, round_bytes: int, split_bytes: int = 1 << 30) -> Planner:
    src = LayoutSet.from_layouts("source", p.src)
    dst = LayoutSet.from_layouts("destination", p.dst)
    return Planner(
        src, dst, domain_of=p.domain_of if domains else None, round_bytes=round_bytes, split_bytes=split_bytes
    )


@SETTINGS
@given(problems(), st.booleans(), st.sampled_from([1, 7, 64, 1 << 20]), st.sampled_from([1, 16, 1 << 30]))
def test_plan_reproduces_every_destination_exactly_once(p, domains, round_bytes, split_bytes):
    planner = _planner(p, domains=domains, round_bytes=round_bytes, split_bytes=split_bytes)
    assert planner.problems() == []
    dst_store, counts, plans = execute(planner, p.ranks)
    check_destinations(planner, dst_store, counts)
    # The aggregate cost view makes the same decisions as the per-rank plans.
    traffic = planner.traffic()
    recv = Counter()
    for rp in plans.values():
        for rnd in rp.rounds:
            for ts in rnd.recvs.values():
                for t in ts:
                    recv[t.dst.rank] += t.nbytes
    for r in p.ranks:
        assert traffic.recv_bytes(r) == recv[r]


@SETTINGS
@given(problems(), st.sampled_from([1, 64, 1 << 20]), st.sampled_from([1, 16, 1 << 30]))
def test_a_rank_planning_alone_gets_the_plan_of_a_planner_that_resolved_everything(p, round_bytes, split_bytes):
    """A rank resolves only the families and domains it takes part in, and
    shares cuts between families laid out alike: what it plans must not
    depend on what the planner resolved before (each rank has its own)."""
    shared = _planner(p, domains=True, round_bytes=round_bytes, split_bytes=split_bytes)
    shared.traffic()
    for r in p.ranks:
        alone = Planner(
            LayoutSet.from_layouts("source", p.src, check_ranks=(r,)),
            LayoutSet.from_layouts("destination", p.dst, check_ranks=(r,)),
            domain_of=p.domain_of,
            round_bytes=round_bytes,
            split_bytes=split_bytes,
        )
        assert alone.plan_for(r) == shared.plan_for(r)


def _needed_not_held(planner: Planner, domain_of: dict[int, int]) -> int:
    """Lower bound on network bytes: per domain, elements needed there and held by no rank there."""
    need: dict[tuple[int, str], list[Box]] = {}
    for r, items in slots_by_rank(planner, "dst").items():
        for name, s in items:
            need.setdefault((domain_of[r], name), []).append(s.box)
    held: dict[tuple[int, str], list[Box]] = {}
    for r, items in slots_by_rank(planner, "src").items():
        for name, s in items:
            held.setdefault((domain_of[r], name), []).append(s.box)
    total = 0
    for (dom, name), boxes in need.items():
        meta = planner.dests.metas[name]
        elems = _elements(boxes) - _elements(held.get((dom, name), []))
        total += len(elems) * meta.nbytes // max(1, _numel(meta.shape))
    return total


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _elements(boxes):
    import itertools

    out = set()
    for b in boxes:
        out.update(itertools.product(*(range(o, o + s) for o, s in zip(b.offsets, b.sizes, strict=True))))
    return out


@SETTINGS
@given(problems(), st.sampled_from([1, 64, 1 << 20]))
def test_network_bytes_equal_the_lower_bound(p, round_bytes):
    planner = _planner(p, domains=True, round_bytes=round_bytes)
    assert planner.traffic().network_bytes == _needed_not_held(planner, p.domain_of)


@settings(max_examples=200, deadline=None)
@given(problems(allow_drop=True))
def test_uncovered_bytes_are_rejected_before_planning(p):
    planner = _planner(p, domains=True, round_bytes=64)
    needed: dict[str, list[tuple[int, Box]]] = {}
    for r, items in slots_by_rank(planner, "dst").items():
        for name, s in items:
            needed.setdefault(name, []).append((r, s.box))
    held: dict[str, list[Box]] = {}
    for _, items in slots_by_rank(planner, "src").items():
        for name, s in items:
            held.setdefault(name, []).append(s.box)
    starved = {
        r for name, needs in needed.items() for r, box in needs if _elements([box]) - _elements(held.get(name, []))
    }
    reported = {pr.tensor for pr in planner.problems() if pr.kind in ("uncovered", "unknown-tensor")}
    if not starved:
        assert not planner.problems()
        return
    assert reported
    with pytest.raises(PlanError, match=r"held by no source|published by no source"):
        planner.check()
    # Every rank that lacks bytes refuses to plan, before anything moves.
    for r in starved:
        with pytest.raises(PlanError):
            planner.plan_for(r)


def test_merge_boxes_is_exact():
    boxes = [Box((0, 0), (1, 2)), Box((1, 0), (1, 2)), Box((0, 2), (2, 1))]
    merged = merge_boxes(boxes)
    assert _elements(merged) == _elements(boxes)
    assert merged == [Box((0, 0), (2, 3))]
