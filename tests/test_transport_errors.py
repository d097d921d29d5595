"""Bad input is rejected on every rank before any byte moves; a missing or dead
peer makes every live rank raise within the timeout."""

from __future__ import annotations

import itertools
import os
import pathlib
import threading

import pytest
import torch

from reshard.errors import RefitError
from reshard.plan.box import Box
from reshard.plan.layout import TensorMeta
from reshard.plan.specs import PieceSpec
from reshard.receiver import Receiver, Tensors
from reshard.sender import Sender
from reshard.transport.group import GroupConfig

from . import procs
from .support import HANG_S, Watched, group_config, noticed, read_when_written, wait_for, write_atomically

W = TensorMeta("model.w", (8, 6), "float32")


def _scenario(rank: int, address: str, case: str) -> dict:
    cfg = group_config(address, 2, 2)  # every rank must join and publish; the plan step refuses
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
                meta = TensorMeta("model.w", (8, 6), "int32")
                local = local.to(torch.int32)
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
        ("dtype", r"source rank 0 has shape [8, 6] int32, destination rank 2 needs shape [8, 6] float32 (int32 cannot"),
        ("missing", r"published by no source: 'model.v'"),
        ("uncovered", r"[4:8, 0:3] of 'model.w' (shape [8, 6]) needed by rank(s) [2] are held by no source"),
    ],
)
def test_bad_layouts_fail_on_every_rank_before_any_byte_moves(case, needle):
    server = procs.StoreServer()
    results = procs.check(procs.run(_scenario, 4, server.address, case, reuse=True))
    for r in results:
        assert r.get("step") == "plan", r
        assert needle in r["error"], r["error"]
        assert "before" not in r or r["untouched"]
    assert all(r["untouched"] for r in results if "untouched" in r)


def _refused(rank: int, address: str) -> dict:
    """Rank 2 refuses refit 1 (an engine out of room for it), then takes it."""
    cfg = group_config(address, 2, 2)
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    out: dict = {}
    if rank < 2:
        local = full[rank * 4 : rank * 4 + 4].clone()
        sender = Sender.from_pieces(
            [PieceSpec(W, Box((rank * 4, 0), (4, 6)), "w", (4, 6))], {"w": local}, config=cfg, rank=rank
        )
        try:
            sender.push(1)
        except RefitError as e:
            out.update(error=str(e), step=e.step, agreed=e.agreed)
        sender.push(1)
        sender.close()
        return out
    j = rank - 2
    dst = torch.zeros(8, 3)
    receiver = Receiver({"w": dst}, [PieceSpec(W, Box((0, j * 3), (8, 3)), "w", (8, 3))], config=cfg, rank=rank)
    try:
        refuse = "no room for adapter version 1" if rank == 2 else ""
        receiver.pull(1, into=Tensors({"w": dst}, refuse=refuse))
    except RefitError as e:
        out.update(error=str(e), step=e.step, agreed=e.agreed)
    out["untouched"] = bool((dst == 0).all())
    group = receiver.session.group
    receiver.pull(1)
    out["landed"] = bool(torch.equal(dst, full[:, j * 3 : j * 3 + 3]))
    out["same_group"] = group is not None and receiver.session.group is group
    receiver.close()
    return out


def test_a_refusing_rank_fails_every_rank_at_enter_before_any_byte_moves_and_the_group_stays():
    """A rank whose tensors refuse the refit (``LocalTensors.refusal``): every rank raises the refusing rank's
    reason at step ``enter`` (agreed), nothing lands, and the same refit
    number then runs on the same group."""
    server = procs.StoreServer()
    results = procs.check(procs.run(_refused, 4, server.address, reuse=True))
    for r in results:
        assert r["step"] == "enter" and r["agreed"], r
        assert "rank 2: no room for adapter version 1" in r["error"], r["error"]
    for r in results[2:]:
        assert r["untouched"] and r["landed"] and r["same_group"], r


def _never_joins(rank: int, address: str) -> dict:
    # What must succeed within the timeout (reaching the store, registering)
    # gets 20 s: with 3 s, a live rank on a loaded machine once failed to
    # reach the test's store in time instead of seeing rank 2 missing.
    cfg = GroupConfig(address=address, num_sources=1, num_destinations=2, timeout_s=20, host_store=False)
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
        return {"step": e.step, "error": str(e)}
    return {"step": None}


def test_a_peer_that_never_joins_fails_every_rank_within_the_timeout():
    server = procs.StoreServer()
    results = procs.check(procs.run(_never_joins, 3, server.address, ranks=[0, 1]))
    for r in results:
        assert r["step"] == "join"
        # The store never saw rank 2's hello: the join's own timeout says so.
        assert "rank(s) [2] did not join the refit group 'reshard' within 20s" in r["error"], r["error"]


# Failure-detection tests whose ranks must first join: joining, and every step
# that must succeed, get the timeout of a step that must succeed (a rank's
# process can start long after the others' on a loaded machine). A death must be
# noticed from an event (the link to the dead rank fails at once), never from
# that timeout: support.noticed reads which from the error.


def _dies_mid_transfer(rank: int, address: str) -> dict:
    # 4 MiB per tensor, 64 KiB rounds: many rounds; rank 0 dies after its first.
    cfg = group_config(address, 2, 2)
    meta = TensorMeta("big", (1024, 1024), "float32")
    ep: Sender | Receiver
    if rank < 2:
        local = torch.full((512, 1024), float(rank))
        ep = Sender.from_pieces(
            [PieceSpec(meta, Box((rank * 512, 0), (512, 1024)), "b", (512, 1024))],
            {"b": local},
            config=cfg,
            rank=rank,
            round_bytes=64 << 10,
        )
    else:
        j = rank - 2
        dst = torch.zeros(1024, 512)
        ep = Receiver(
            {"b": dst},
            [PieceSpec(meta, Box((0, j * 512), (1024, 512)), "b", (1024, 512))],
            config=cfg,
            rank=rank,
            round_bytes=64 << 10,
        )
    ep.connect()
    try:
        if isinstance(ep, Sender):

            def die(i: int) -> None:
                if rank == 0 and i >= 1:
                    os._exit(17)

            ep.push(1, after_round=die)
        else:
            ep.pull(1)
    except RefitError as e:
        return {"step": e.step, "error": str(e)}
    return {"step": None}


def test_a_peer_killed_mid_transfer_fails_every_live_rank_within_the_timeout():
    server = procs.StoreServer()
    outcomes = procs.run(_dies_mid_transfer, 4, server.address, timeout=HANG_S)
    assert outcomes[0].exitcode == 17
    for o in outcomes[1:]:
        assert o.ok, o.error
        r = o.value
        assert r["step"] == "transfer", r
        assert "rank 0" in r["error"] or "Connection closed" in r["error"] or "did not report" in r["error"]
        assert noticed(r["error"], 0), r["error"]  # from the link to rank 0, not a timeout


# -- the store's host dies ----------------------------------------------------------


def _host_store(_rank: int, address: str, ready: str) -> None:
    """A process that hosts the refit store (bound to its address) until killed."""

    from reshard.transport.group import serve_store

    serve_store(GroupConfig(address=address, num_sources=1, num_destinations=1))
    write_atomically(ready, str(os.getpid()))
    threading.Event().wait()  # serve until killed


_STARTS = itertools.count()


def _start_store(address: str, path) -> tuple:
    """A process hosting the store: ``(its Running handle, its pid)``."""
    ready = path / f"ready.{next(_STARTS)}"
    host = procs.spawn(_host_store, 0, address, str(ready))
    wait_for(lambda: ready.exists() or not host.process.is_alive(), HANG_S, "the store host to start")
    assert host.process.is_alive(), "the store host died before it served"
    return host, int(ready.read_text())


BIG = TensorMeta("big", (512, 1024), "float32")


def _big_endpoint(rank: int, cfg: GroupConfig, value: float, round_bytes: int = 64 << 10):
    """Rank 0 holds the whole tensor; engine workers 1.. keep column blocks (staged)."""
    if rank == 0:
        local = torch.full((512, 1024), value)
        ep = Sender.from_pieces(
            [PieceSpec(BIG, Box((0, 0), (512, 1024)), "b", (512, 1024))],
            {"b": local},
            config=cfg,
            rank=0,
            round_bytes=round_bytes,
        )
        return ep, local
    n = cfg.num_destinations
    cols = 1024 // n
    j = rank - 1
    dst = torch.zeros(512, cols)
    ep = Receiver(
        {"b": dst},
        [PieceSpec(BIG, Box((0, j * cols), (512, cols)), "b", (512, cols))],
        config=cfg,
        rank=rank,
        round_bytes=round_bytes,
    )
    return ep, dst


def _store_dies(rank: int, address: str, tmp: str) -> dict:
    d = pathlib.Path(tmp)
    # 20 s, not less: phase 3 must reach the restarted store and refit within it.
    cfg = GroupConfig(address=address, num_sources=1, num_destinations=2, timeout_s=20, host_store=False)
    ep, t = _big_endpoint(rank, cfg, 1.0)
    go = ep.push if rank == 0 else ep.pull
    out: dict = {}
    # 1. The store's host died before anyone connected.
    try:
        go(1)
    except RefitError as e:
        out["before"] = (e.step, str(e))
    (d / f"p1.{rank}").touch()
    # 2. It is back; rank 0 kills it after its first round.
    pid = int(read_when_written(d / "store2"))

    def kill(i: int) -> None:
        if rank == 0 and i == 0:
            os.kill(pid, 9)

    try:
        ep.push(1, after_round=kill) if rank == 0 else ep.pull(1)
    except RefitError as e:
        out["mid"] = (e.step, str(e))
    (d / f"p2.{rank}").touch()
    # 3. It is back again: the same senders and receivers refit.
    read_when_written(d / "store3")
    if rank:
        t.zero_()
    go(1)
    out["after"] = rank == 0 or bool((t == 1.0).all())
    ep.close()
    return out


def test_the_store_host_dying_before_connect_or_mid_refit_fails_every_rank_and_the_next_refit_works(tmp_path):
    address = f"127.0.0.1:{procs.free_port()}"
    host, _ = _start_store(address, tmp_path)
    host.process.kill()  # before anyone connects
    host.process.join()
    hosts = []

    def conduct() -> None:
        for phase, nxt in (("p1", "store2"), ("p2", "store3")):
            for r in range(3):
                read_when_written(tmp_path / f"{phase}.{r}")
            proc, pid = _start_store(address, tmp_path)
            hosts.append(proc)
            write_atomically(tmp_path / nxt, str(pid))

    th = threading.Thread(target=conduct, daemon=True)
    th.start()
    try:
        out = procs.check(procs.run(_store_dies, 3, address, str(tmp_path), timeout=HANG_S))
    finally:
        for h in hosts:
            h.process.kill()
    for r in out:
        # Each failure names the store as what failed (a missing peer would
        # be named instead, a timeout would say "did not join" or "within").
        step, text = r["before"]
        assert step == "join" and f"cannot reach the refit store at {address}" in text, text
        step, text = r["mid"]
        assert step == "transfer", text
        assert "is unreachable (did its host process die?)" in text, text
        assert r["after"]


# -- a leader dies while it forwards ------------------------------------------------


def _leader_of(round_bytes: int) -> int:
    """The engine worker that pulls from the trainer and forwards to the others
    (same inputs as the ranks plan with, so the same answer)."""
    from reshard.plan.index import LayoutSet
    from reshard.plan.planner import Planner
    from reshard.plan.specs import build_layout

    full = Box((0, 0), (512, 1024))
    layouts = [build_layout(r, [PieceSpec(BIG, full, "b", (512, 1024))]) for r in range(4)]
    planner = Planner(
        LayoutSet.from_layouts("source", layouts[:1]),
        LayoutSet.from_layouts("destination", layouts[1:]),
        domain_of={0: 1, 1: 0, 2: 0, 3: 0},  # labels "engines" < "trainer"
        round_bytes=round_bytes,
    )
    leaders = {r for r in (1, 2, 3) for t in planner.plan_for(r).transfers() if t.kind == "fwd" and t.src.rank == r}
    assert len(leaders) == 1, leaders
    return leaders.pop()


def _replica(rank: int, address: str, value: float, die_after: int | None) -> dict:
    """Ranks 1-3 keep the whole tensor, in one domain: a leader pulls, forwards."""
    cfg = group_config(address, 1, 3, domain="trainer" if rank == 0 else "engines", checksums=True)
    full = Box((0, 0), (512, 1024))
    if rank == 0:
        local = torch.full((512, 1024), value)
        ep = Sender.from_pieces(
            [PieceSpec(BIG, full, "b", (512, 1024))], {"b": local}, config=cfg, rank=0, round_bytes=256 << 10
        )
    else:
        local = torch.zeros(512, 1024)
        ep = Receiver(
            {"b": local}, [PieceSpec(BIG, full, "b", (512, 1024))], config=cfg, rank=rank, round_bytes=256 << 10
        )
    forwarded: list[int] = []

    def watch(plan) -> None:
        forwarded.extend(t.round for t in plan.transfers() if t.kind == "fwd" and t.src.rank == rank)

    def die(i: int) -> None:
        if die_after is not None and i >= die_after:
            os._exit(17)

    out: dict = {}
    ep.connect()
    try:
        if rank == 0:
            ep.push(1)
        else:
            ep.pull(1, into=Watched({"b": local}, begin=watch, landed=die))
        out["first"] = None
    except RefitError as e:
        out["first"] = (e.step, str(e))
    return {"ep": ep, "local": local, "forwarded": forwarded, **out}


def _first_life_of_the_leader(rank: int, address: str) -> None:
    _replica(rank, address, 0.0, die_after=1)


def _leader_dies(rank: int, address: str, leader: int) -> dict:
    if rank == leader:
        # The leader's first life, in a child process that dies after it pulled
        # two rounds and forwarded one; this process is its replacement.
        first = procs.spawn(_first_life_of_the_leader, rank, address, daemon=False).outcome(procs.GROUP_TIMEOUT_S)
        assert first.exitcode == 17, first
        # Refit 1, in the rebuilt group (its join waits for the others to notice
        # the first life's death and come back).
        r = _replica(rank, address, 0.0, die_after=None)
        ep, local = r["ep"], r["local"]
        result = {"first": "died", "second": bool((local == 1.0).all())}
    else:
        r = _replica(rank, address, 1.0, die_after=None)
        ep, local = r["ep"], r["local"]
        result = {"first": r["first"]}
        # The same sender and receivers, not restarted: refit 1 again.
        if rank == 0:
            ep.push(1)
        else:
            local.zero_()
            ep.pull(1)
        result["second"] = rank == 0 or bool((local == 1.0).all())
    # And the rebuilt group carries the next refit too.
    if rank == 0:
        local.fill_(2.0)
        ep.push(2)
    else:
        ep.pull(2)
    result["third"] = rank == 0 or bool((local == 2.0).all())
    ep.close()
    return result


def test_a_leader_killed_while_forwarding_fails_every_rank_and_the_group_is_rebuilt_for_the_next_refit():
    leader = _leader_of(256 << 10)
    server = procs.StoreServer()
    out = procs.check(procs.run(_leader_dies, 4, server.address, leader, timeout=HANG_S, daemon=False))
    for rank, r in enumerate(out):
        if rank != leader:
            step, text = r["first"]
            assert step == "transfer", text
            assert f"rank {leader}" in text, text
            assert noticed(text, leader), text  # from the link to the leader, not a timeout
        assert r["second"] and r["third"], (rank, r)


def test_a_store_call_that_gets_no_answer_is_bounded_and_the_connection_counts_as_lost():
    import threading

    from reshard.transport.store import BoundedStore, StoreCalls, StoreUnreachable

    release = threading.Event()

    class Silent:
        """A store whose answers never come (the link to its host is down)."""

        def check(self, keys):
            release.wait(60)
            return True

        def get(self, key):
            return b"v"

    calls = StoreCalls("10.0.0.1:1234", bound_s=0.2)
    store = BoundedStore(Silent(), calls)
    with pytest.raises(StoreUnreachable, match=r"10\.0\.0\.1:1234 did not answer within 0\.2 s"):
        store.check(["k"])
    # Later calls fail at once, even those that would answer.
    with pytest.raises(StoreUnreachable):
        store.get("k")
    release.set()
    ok = BoundedStore(Silent(), StoreCalls("x:1", bound_s=5))
    assert ok.get("k") == b"v"
    with pytest.raises(AttributeError):
        ok.nothing_like_this  # noqa: B018


def test_gloo_advertises_the_address_that_reaches_the_store(monkeypatch):
    from reshard.transport.joining import gloo_devices, route_source

    # A store on this host's loopback keeps torch's default device; an
    # address this host cannot route to has no source either.
    assert route_source("127.0.0.1", 1234) is None
    assert route_source("no-such-host.invalid", 1234) is None
    cfg = GroupConfig(address="127.0.0.1:29999", num_sources=1, num_destinations=1)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert len(gloo_devices(cfg)) == 1
