"""Brute-force oracles for plans: execute every rank's plan on numpy arrays.

Each global tensor holds unique values, so a byte that lands in the wrong
place, twice, or not at all is caught. Nothing here shares code with the
planner beyond the plan types themselves.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from reshard.plan.box import Box
from reshard.plan.index import LayoutSet
from reshard.plan.items import RankPlan
from reshard.plan.layout import Slot, TensorMeta
from reshard.plan.planner import Planner


def global_tensors(metas: dict[str, TensorMeta]) -> dict[str, np.ndarray]:
    out = {}
    base = 1
    for name in sorted(metas):
        m = metas[name]
        n = int(np.prod(m.shape, dtype=np.int64)) if m.shape else 1
        out[name] = (np.arange(n, dtype=np.int64) + base).reshape(m.shape)
        base += n
    return out


def _index(offs, sizes):
    return tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))


def read_slot(store: dict, slot: Slot, box: Box) -> np.ndarray:
    """Read global ``box`` from ``slot`` in a rank's local arrays, in global dim order."""
    offs, sizes = slot.local_box(box)
    view = store[slot.local][_index(offs, sizes)]
    kept, to_global, _ = slot.axes()
    return view.reshape([view.shape[k] for k in kept]).transpose(to_global)


def write_slot(store: dict, slot: Slot, box: Box, data: np.ndarray) -> None:
    offs, sizes = slot.local_box(box)
    _, _, to_local = slot.axes()
    store[slot.local][_index(offs, sizes)] = data.transpose(to_local).reshape(sizes)


def slots_by_rank(planner: Planner, side: str) -> dict[int, list[tuple[str, Slot]]]:
    """Every (tensor, slot) of every rank of one side, expanding grids piece by piece."""
    return layout_set_slots(planner.sources if side == "src" else planner.dests)


def layout_set_slots(ls: LayoutSet) -> dict[int, list[tuple[str, Slot]]]:
    """Every (tensor, slot) of every rank of a layout set, grids expanded."""
    out: dict[int, list[tuple[str, Slot]]] = defaultdict(list)
    for name, slots in ls.tensor_slots.items():
        for s in slots:
            out[s.rank].append((name, s))
    for name, entries in ls.tensor_grids.items():
        meta = ls.metas[name]
        for gid, pos in entries:
            info = ls.grids[gid]
            for r, c in zip(info.ranks, info.coords, strict=True):
                s = info.slot(meta, pos, r, c)
                if not s.box.is_empty():
                    out[r].append((name, s))
    return out


def execute(planner: Planner, ranks: list[int]) -> tuple[dict, dict, dict[int, RankPlan]]:
    """Run all ranks' plans round by round; return (dest arrays, write counts, plans)."""
    full = global_tensors(planner.dests.metas | planner.sources.metas)
    src_store: dict[int, dict[str, np.ndarray]] = defaultdict(dict)
    for r, items in slots_by_rank(planner, "src").items():
        for name, s in items:
            arr = src_store[r].setdefault(s.local, np.full(s.local_shape, -7, dtype=np.int64))
            write_slot(src_store[r], s, s.box, full[name][_index(s.box.offsets, s.box.sizes)])
            del arr
    dst_store: dict[int, dict[str, np.ndarray]] = defaultdict(dict)
    counts: dict[int, dict[str, np.ndarray]] = defaultdict(dict)
    for r, items in slots_by_rank(planner, "dst").items():
        for _, s in items:
            dst_store[r].setdefault(s.local, np.full(s.local_shape, -1, dtype=np.int64))
            counts[r].setdefault(s.local, np.zeros(s.local_shape, dtype=np.int64))
    plans = {r: planner.plan_for(r) for r in ranks}
    # Pairwise agreement: what r sends to p in round k is what p expects from r.
    index = {r: {x.index: x for x in rp.rounds} for r, rp in plans.items()}
    for r, rp in plans.items():
        for rnd in rp.rounds:
            for peer, ts in rnd.sends.items():
                theirs = index[peer].get(rnd.index)
                assert theirs is not None, f"rank {r} sends to {peer} in round {rnd.index}, peer has no round"
                assert theirs.recvs.get(r) == ts, f"rank {r} -> {peer} round {rnd.index} disagree"
            for peer, ts in rnd.recvs.items():
                assert index[peer][rnd.index].sends.get(r) == ts
    by_round: dict[int, list] = defaultdict(list)
    for rp in plans.values():
        for rnd in rp.rounds:
            for ts in rnd.recvs.values():
                by_round[rnd.index].extend(ts)
            by_round[rnd.index].extend(rnd.copies)
    for k in sorted(by_round):
        # Everything of round k is read before anything of round k is written,
        # as with one batch of isend/irecv.
        moves = by_round[k]
        staged = []
        for t in moves:
            store = dst_store[t.src.rank] if t.kind == "fwd" else src_store[t.src.rank]
            staged.append((t, read_slot(store, t.src, t.box).copy()))
        for t, data in staged:
            write_slot(dst_store[t.dst.rank], t.dst, t.box, data)
            offs, sizes = t.dst.local_box(t.box)
            counts[t.dst.rank][t.dst.local][_index(offs, sizes)] += 1
    return dst_store, counts, plans


def check_destinations(planner: Planner, dst_store: dict, counts: dict) -> None:
    """Every destination slot holds exactly its box of the global tensor, written once."""
    full = global_tensors(planner.dests.metas | planner.sources.metas)
    for r, items in slots_by_rank(planner, "dst").items():
        for name, s in items:
            got = read_slot(dst_store[r], s, s.box)
            want = full[name][_index(s.box.offsets, s.box.sizes)]
            np.testing.assert_array_equal(got, want, err_msg=f"rank {r} tensor {name} box {s.box}")
            offs, sizes = s.local_box(s.box)
            c = counts[r][s.local][_index(offs, sizes)]
            assert (c == 1).all(), f"rank {r} tensor {name} box {s.box}: write counts {np.unique(c)}"
