"""What one rank reads and writes on the store per refit grows with its
peers, not with the world: the agreements of one refit, run by a real
TCPStore and one client per rank (``benchmarks/control_plane.py``), at two
world sizes with the same number of peers per rank."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "control_plane", Path(__file__).resolve().parents[1] / "benchmarks" / "control_plane.py"
)
assert _SPEC is not None and _SPEC.loader is not None
control_plane = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("control_plane", control_plane)  # its dataclasses look their module up
_SPEC.loader.exec_module(control_plane)


@pytest.fixture(scope="module")
def worlds():
    return {w: control_plane.measure(w, 3, legacy=False) for w in (8, 40)}


def test_a_rank_reads_only_its_peers_statuses(worlds):
    for world, row in worlds.items():
        for rank, c in row["ranks"].items():
            seq = 1
            mine = f"status/{seq}/"
            plan_reads = sorted(k for k in c["read"] if k.startswith(f"{mine}plan/"))
            assert plan_reads == sorted(f"{mine}plan/{r}" for r in {int(rank), *c["peers"]}), (world, rank)
            for step in ("enter", "links", "transfer"):
                assert [k for k in c["read"] if k.startswith(f"{mine}{step}/")] == [f"{mine}{step}/{rank}"]


def test_round_trips_do_not_grow_with_the_world(worlds):
    small, large = worlds[8]["ranks"], worlds[40]["ranks"]
    for s, big in zip(small.values(), large.values(), strict=True):
        assert big["by_op"] == s["by_op"]
        # Only rank numbers in keys and statuses gain a digit.
        assert big["bytes_received"] <= s["bytes_received"] + 64
        assert big["bytes_sent"] <= s["bytes_sent"] + 64
