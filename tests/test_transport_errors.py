"""Bad input is rejected on every rank before any byte moves; a missing or dead
peer makes every live rank raise within the timeout."""

from __future__ import annotations

import os
import time

import pytest
import torch

from reshard.errors import RefitError
from reshard.layouts import PieceSpec
from reshard.plan.box import Box
from reshard.plan.layout import TensorMeta
from reshard.receiver import Receiver
from reshard.sender import Sender
from reshard.transport.group import GroupConfig

from . import procs

W = TensorMeta("model.w", (8, 6), "float32")


def _scenario(rank: int, address: str, case: str) -> dict:
    cfg = GroupConfig(address=address, num_sources=2, num_destinations=2, timeout_s=30, host_store=False)
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    out: dict = {"rank": rank}
    try:
        if rank < 2:
            rows = (rank * 4, 4)
            if case == "uncovered":
                rows = (rank * 2, 2)  # rows 4..7 are held by nobody
            local = full[rows[0] : rows[0] + rows[1]].clone()
            meta = W
            if case == "dtype":
                meta = TensorMeta("model.w", (8, 6), "bfloat16")
                local = local.to(torch.bfloat16)
            box = Box((rows[0], 0), (rows[1], 6))
            Sender.from_pieces(
                [PieceSpec(meta, box, "w", tuple(local.shape))], {"w": local}, config=cfg, rank=rank
            ).push(1)
        else:
            j = rank - 2
            meta = W
            if case == "shape":
                meta = TensorMeta("model.w", (8, 5), "float32")
            if case == "missing":
                meta = TensorMeta("model.v", (8, 6), "float32")
            cols = meta.shape[1] // 2
            dst = torch.zeros(8, cols)
            out["dst"] = dst
            Receiver(
                {"w": dst}, [PieceSpec(meta, Box((0, j * cols), (8, cols)), "w", (8, cols))], config=cfg, rank=rank
            ).pull(1)
    except RefitError as e:
        out.update(error=str(e), step=e.step)
    if "dst" in out:
        out["untouched"] = bool((out.pop("dst") == 0).all())
    return out


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("shape", r"'model.w': source rank 0 has shape [8, 6] float32, destination rank 2 needs shape [8, 5]"),
        ("dtype", r"source rank 0 has shape [8, 6] bfloat16, destination rank 2 needs shape [8, 6] float32"),
        ("missing", r"published by no source: 'model.v'"),
        ("uncovered", r"[4:8, 0:3] of 'model.w' (shape [8, 6]) needed by rank(s) [2] are held by no source"),
    ],
)
def test_bad_layouts_fail_on_every_rank_before_any_byte_moves(case, needle):
    server = procs.StoreServer()
    results = procs.check(procs.run(_scenario, 4, server.address, case))
    for r in results:
        assert r.get("step") == "plan", r
        assert needle in r["error"], r["error"]
        assert "before" not in r or r["untouched"]
    assert all(r["untouched"] for r in results if "untouched" in r)


def _never_joins(rank: int, address: str) -> dict:
    cfg = GroupConfig(address=address, num_sources=1, num_destinations=2, timeout_s=3, host_store=False)
    t0 = time.monotonic()
    t = torch.zeros(4)
    try:
        if rank == 0:
            Sender.from_pieces(
                [PieceSpec(TensorMeta("x", (4,), "float32"), Box((0,), (4,)), "x", (4,))], {"x": t}, config=cfg, rank=0
            ).push(1)
        else:
            Receiver(
                {"x": t},
                [PieceSpec(TensorMeta("x", (4,), "float32"), Box((0,), (4,)), "x", (4,))],
                config=cfg,
                rank=rank,
            ).pull(1)
    except RefitError as e:
        return {"step": e.step, "error": str(e), "seconds": time.monotonic() - t0}
    return {"step": None}


def test_a_peer_that_never_joins_fails_every_rank_within_the_timeout():
    server = procs.StoreServer()
    results = procs.check(procs.run(_never_joins, 3, server.address, ranks=[0, 1]))
    for r in results:
        assert r["step"] == "join"
        assert "rank(s) [2] did not join the refit group" in r["error"]
        assert r["seconds"] < 3 + 5


def _dies_mid_transfer(rank: int, address: str) -> dict:
    # 4 MiB per tensor, 64 KiB rounds: many rounds; rank 0 dies after its first.
    cfg = GroupConfig(address=address, num_sources=2, num_destinations=2, timeout_s=20, host_store=False)
    meta = TensorMeta("big", (1024, 1024), "float32")
    t0 = time.monotonic()
    try:
        if rank < 2:
            local = torch.full((512, 1024), float(rank))
            s = Sender.from_pieces(
                [PieceSpec(meta, Box((rank * 512, 0), (512, 1024)), "b", (512, 1024))],
                {"b": local},
                config=cfg,
                rank=rank,
                round_bytes=64 << 10,
            )

            def die(i: int) -> None:
                if rank == 0 and i >= 1:
                    os._exit(17)

            s.push(1, after_round=die)
        else:
            j = rank - 2
            dst = torch.zeros(1024, 512)
            Receiver(
                {"b": dst},
                [PieceSpec(meta, Box((0, j * 512), (1024, 512)), "b", (1024, 512))],
                config=cfg,
                rank=rank,
                round_bytes=64 << 10,
            ).pull(1)
    except RefitError as e:
        return {"step": e.step, "error": str(e), "seconds": time.monotonic() - t0}
    return {"step": None, "seconds": time.monotonic() - t0}


def test_a_peer_killed_mid_transfer_fails_every_live_rank_within_the_timeout():
    server = procs.StoreServer()
    outcomes = procs.run(_dies_mid_transfer, 4, server.address, timeout=120)
    assert outcomes[0].exitcode == 17
    for o in outcomes[1:]:
        assert o.ok, o.error
        r = o.value
        assert r["step"] == "transfer", r
        assert r["seconds"] < 20, r  # the dead rank is noticed long before the 20 s timeout
        assert "rank 0" in r["error"] or "Connection closed" in r["error"] or "did not report" in r["error"]
