"""Shared-memory links between ranks on one host (``GroupConfig(shared_memory=True)``).

Real processes: random layouts move bit-exactly with every pair of ranks on
one host label sharing memory and the others on gloo (one refit mixes both),
refits repeat on the same channels (and on bigger ones when a plan needs
them), a reader killed mid-refit fails every rank on that event (not at a
timeout) and the next refit works, and nothing is left in ``/dev/shm``.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from reshard.errors import RefitError
from reshard.plan.box import Box
from reshard.plan.layout import TensorMeta
from reshard.plan.specs import PieceSpec
from reshard.receiver import Receiver
from reshard.sender import Sender
from reshard.transport.shm import SHM_DIR

from . import procs
from .support import (
    HANG_S,
    Watched,
    collect_problems,
    encode_problem,
    group_config,
    noticed,
    relayouts,
    run_problems,
)

_CREATOR = re.compile(r"reshard-[0-9a-f]+-e\d+-\d+\.(\d+)-|torch_(\d+)_")
"""The creator's pid in a channel's name (``channel_name``) or in a file
torch made when a trainer's storage moved into shared memory."""


def _leftovers() -> list[str]:
    """The shared-memory files this test process or its ranks made (another
    job on the machine, a second `make test` say, has its own; a benchmark's
    folder, ``reshard-engine-bench-*``, names no creator and is no channel)."""
    ours = procs.STARTED | {os.getpid()}
    out = []
    for f in os.listdir(SHM_DIR):
        m = _CREATOR.match(f)
        if m is not None and int(m.group(1) or m.group(2)) in ours:
            out.append(f)
    return sorted(out)


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    before = set(_leftovers())
    yield
    assert set(_leftovers()) - before == set(), "shared-memory files left in /dev/shm"


@pytest.mark.parametrize("mode", ["channels", "export"])
def test_random_layouts_move_bit_exactly_over_shared_memory_and_gloo_mixed(mode):
    """Half the problems test_transport plays over gloo each way: through the
    channels (two copies), and read straight from the trainers' exported
    tensors (one copy); ranks on the other host label still use gloo."""
    found = collect_problems(40)[:20] if mode == "channels" else collect_problems(40)[20:]
    blobs = [encode_problem(p) for p in found]
    world = max(len(p.ranks) for p in found)
    server = procs.StoreServer()
    shm = True if mode == "channels" else "export"
    out = procs.check(procs.run(run_problems, world, server.port, blobs, 4096, shm, timeout=600))
    direct = {"direct"} if mode == "export" else set()
    assert set().union(*map(set, out)) == {f"p{i}" for i in range(len(found))} | direct


def test_repeated_refits_and_layout_changes_over_shared_memory():
    server = procs.StoreServer()
    out = procs.check(procs.run(relayouts, 4, server.address, True, reuse=True))
    for rank, per_refit in enumerate(out):
        assert all(ok for ok, _ in per_refit), (rank, per_refit)


W = TensorMeta("w", (256, 96), "float32")


def _full(version: int) -> torch.Tensor:
    return torch.randn(W.shape, generator=torch.Generator().manual_seed(version))


def _mixed(
    rank: int, address: str, hosts: list[str], refits: list[int], kill: bool = False, export: bool = False
) -> dict:
    """2 trainer ranks hold row halves, 2 engine ranks keep column halves;
    ``hosts[r]`` is rank r's host label (equal labels share memory). Small
    rounds, so a refit takes several. ``kill``: this rank dies after the
    first round of its first refit. ``export``: the trainers export their
    tensors and update them in place between refits."""
    cfg = group_config(address, 2, 2, export_sources=export, shared_memory=True, shm_host=hosts[rank])
    out: dict = {"rank": rank, "refits": []}
    if rank < 2:
        local = _full(1)[rank * 128 : (rank + 1) * 128].clone()
        s = Sender.from_pieces(
            [PieceSpec(W, Box((rank * 128, 0), (128, 96)), "w", (128, 96))],
            {"w": local},
            config=cfg,
            rank=rank,
            round_bytes=16 << 10,
        )
        for n in refits:
            local.copy_(_full(n)[rank * 128 : (rank + 1) * 128])
            try:
                st = s.push(n)
                out["refits"].append({"ok": True, "links": dict(st.exec.send_by_link), "direct": st.exec.direct_bytes})
            except RefitError as e:
                out["refits"].append({"ok": False, "error": str(e)})
        s.close()
        return out
    j = rank - 2
    dst = torch.zeros(256, 48)
    r = Receiver(
        {"w": dst},
        [PieceSpec(W, Box((0, j * 48), (256, 48)), "w", (256, 48))],
        config=cfg,
        rank=rank,
        round_bytes=16 << 10,
    )
    for n in refits:
        try:
            st = r.pull(n, into=Watched({"w": dst}, landed=lambda i: os._exit(9)) if kill else None)
        except RefitError as e:
            out["refits"].append({"ok": False, "error": str(e)})
            continue
        exact = torch.equal(dst, _full(n)[:, j * 48 : (j + 1) * 48])
        out["refits"].append({"ok": exact, "links": dict(st.exec.recv_by_link), "direct": st.exec.direct_bytes})
    r.close()
    return out


@pytest.mark.parametrize("export", [False, True], ids=["channels", "export"])
def test_a_mixed_group_uses_shared_memory_on_one_host_and_gloo_across(export):
    """Ranks 0 and 2 on host a, ranks 1 and 3 on host b: each engine rank gets
    its bytes from one trainer over shared memory and from the other over
    gloo. With ``export`` the shared-memory half is read straight from the
    trainer's tensor, which the trainer rewrites in place between refits."""
    server = procs.StoreServer()
    out = procs.check(procs.run(_mixed, 4, server.address, ["a", "b", "a", "b"], [1, 2, 3], False, export, reuse=True))
    half = 128 * 48 * 4
    for o in out:
        assert [r["ok"] for r in o["refits"]] == [True, True, True], o
        assert set(o["refits"][-1]["links"]) == {"shm", "gloo"}, o
        # Exported: the shared-memory part is all read straight from the
        # trainer (each trainer sends each engine rank a quarter of the tensor).
        assert [r["direct"] for r in o["refits"]] == [half if export else 0] * 3, o
    # Each engine rank keeps 256 x 48 float32, half from each trainer.
    for o in out[2:]:
        assert o["refits"][-1]["links"] == {"shm": half, "gloo": half}, o


@pytest.mark.parametrize("export", [False, True], ids=["channels", "export"])
def test_a_reader_killed_mid_refit_fails_every_rank_fast_and_the_next_refit_works(export):
    """Engine rank 3 dies after its first round of refit 1; the trainers (its
    shared-memory senders) and rank 2 raise on an event that shows it gone
    (its shared-memory link, or the group rebuilt by its replacement), not
    at the group timeout; a new process takes rank 3 and refit 2 succeeds on
    every rank."""
    server = procs.StoreServer()
    hosts = ["a"] * 4
    running = [procs.spawn(_mixed, r, server.address, hosts, [1, 2], False, export) for r in range(3)]
    dead = procs.spawn(_mixed, 3, server.address, hosts, [1], True, export).outcome(HANG_S)
    assert dead.exitcode == 9, (dead.exitcode, dead.error)
    # A restarted engine worker takes rank 3 for refit 2.
    again = procs.spawn(_mixed, 3, server.address, hosts, [2], False, export)
    results = procs.check([running[r].outcome(HANG_S) for r in range(3)] + [again.outcome(HANG_S)])
    for o in results[:3]:
        first, second = o["refits"]
        assert not first["ok"], first
        assert "rank 3" in first["error"], first["error"]
        assert noticed(first["error"], 3), first["error"]
        assert second["ok"], second
    assert [r["ok"] for r in results[3]["refits"]] == [True], results[3]


def _sizes_change_back(rank: int, address: str) -> list[bool]:
    """One group, three refits of several rounds: the engine ranks keep column
    halves, then row halves (each from one trainer rank), then column halves
    again; each pair's channel grows or shrinks with its busiest round and
    starts counting anew each time."""
    cfg = group_config(address, 2, 2, shared_memory=True)
    if rank < 2:
        local = _full(1)[rank * 128 : (rank + 1) * 128].clone()
        s = Sender.from_pieces(
            [PieceSpec(W, Box((rank * 128, 0), (128, 96)), "w", (128, 96))],
            {"w": local},
            config=cfg,
            rank=rank,
            round_bytes=8 << 10,
        )
        for n in (1, 2, 3):
            local.copy_(_full(n)[rank * 128 : (rank + 1) * 128])
            s.push(n)
        s.close()
        return [True]
    j = rank - 2
    boxes = {1: Box((0, j * 48), (256, 48)), 2: Box((j * 128, 0), (128, 96)), 3: Box((0, j * 48), (256, 48))}
    r = None
    ok = []
    for n, box in boxes.items():
        dst = torch.zeros(box.sizes)
        piece = PieceSpec(W, box, "w", box.sizes)
        if r is None:
            r = Receiver({"w": dst}, [piece], config=cfg, rank=rank, round_bytes=8 << 10)
        else:
            from reshard.plan.specs import build_layout

            r.set_layout(build_layout(rank, [piece]), {"w": dst})
        r.pull(n)
        want = _full(n)[tuple(slice(o, o + k) for o, k in zip(box.offsets, box.sizes, strict=True))]
        ok.append(torch.equal(dst, want))
    assert r is not None
    r.close()
    return ok


def test_channels_follow_the_plan_when_its_rounds_grow_and_shrink_back():
    server = procs.StoreServer()
    out = procs.check(procs.run(_sizes_change_back, 4, server.address, reuse=True, timeout=120))
    assert out[2:] == [[True, True, True]] * 2, out


def _flat_buffer(rank: int, address: str) -> dict:
    """One trainer rank whose two tensors are views into one flat buffer (as
    Megatron's contiguous parameter buffers are), exported; one engine rank
    keeps both whole. The buffer moves into shared memory once, both views
    follow it, and the trainer's in-place update reaches the engine."""
    cfg = group_config(address, 1, 1, shared_memory=True, export_sources=True)
    a, b = TensorMeta("a", (64, 32), "float32"), TensorMeta("b", (16, 8), "float32")
    pieces = [PieceSpec(a, Box((0, 0), a.shape), "a", a.shape), PieceSpec(b, Box((0, 0), b.shape), "b", b.shape)]
    if rank == 0:
        flat = torch.zeros(8 + 64 * 32 + 16 * 8)
        views = {"a": flat[8 : 8 + 64 * 32].view(64, 32), "b": flat[8 + 64 * 32 :].view(16, 8)}
        s = Sender.from_pieces(pieces, views, config=cfg, rank=0)
        out = []
        for n in (1, 2):
            flat.copy_(torch.randn(flat.shape, generator=torch.Generator().manual_seed(n)))
            st = s.push(n)
            out.append(st.exec.direct_bytes)
        shared = flat.untyped_storage().is_shared() and views["a"].untyped_storage().data_ptr() == flat.data_ptr()
        s.close()
        return {"direct": out, "shared": shared}
    dst = {"a": torch.zeros(a.shape), "b": torch.zeros(b.shape)}
    r = Receiver(dst, pieces, config=cfg, rank=1)
    ok = []
    for n in (1, 2):
        st = r.pull(n)
        flat = torch.randn(8 + 64 * 32 + 16 * 8, generator=torch.Generator().manual_seed(n))
        ok.append(
            torch.equal(dst["a"], flat[8 : 8 + 64 * 32].view(64, 32))
            and torch.equal(dst["b"], flat[8 + 64 * 32 :].view(16, 8))
            and st.exec.direct_bytes == (64 * 32 + 16 * 8) * 4
        )
    r.close()
    return {"ok": ok}


def test_views_of_one_flat_buffer_are_exported_together_and_read_directly():
    server = procs.StoreServer()
    trainer, engine = procs.check(procs.run(_flat_buffer, 2, server.address, reuse=True, timeout=120))
    assert trainer == {"direct": [(64 * 32 + 16 * 8) * 4] * 2, "shared": True}
    assert engine == {"ok": [True, True]}
