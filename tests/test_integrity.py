"""Integrity of a refit: checksums catch bytes corrupted in flight, refit
numbers strictly increase, and a failed refit is followed by one that works."""

from __future__ import annotations

import pytest
import torch

from reshard.errors import RefitError
from reshard.plan.box import Box
from reshard.plan.layout import TensorMeta
from reshard.plan.specs import PieceSpec
from reshard.receiver import Receiver
from reshard.sender import Sender
from reshard.transport import execute
from reshard.transport.execute import checksum
from reshard.transport.group import GroupConfig

from . import procs
from .support import group_config

W = TensorMeta("model.layers.0.mlp.w", (64, 48), "float32")


def _weights(step: int) -> torch.Tensor:
    return torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48) + 1000 * step


def _flip_to_rank_2(rank: int, peer: int, tag: int, buf: torch.Tensor) -> torch.Tensor:
    if peer != 2:
        return buf
    bad = buf.clone()
    bad[bad.numel() // 2] ^= 0x40
    return bad


def _endpoint(rank: int, cfg: GroupConfig):
    """Trainer ranks 0-1 hold row halves; engine workers 2-3 keep column halves."""
    if rank < 2:
        local = _weights(1)[rank * 32 : (rank + 1) * 32].clone()
        s = Sender.from_pieces(
            [PieceSpec(W, Box((rank * 32, 0), (32, 48)), "w", (32, 48))], {"w": local}, config=cfg, rank=rank
        )
        return s, local
    j = rank - 2
    dst = torch.zeros(64, 24)
    r = Receiver({"w": dst}, [PieceSpec(W, Box((0, j * 24), (64, 24)), "w", (64, 24))], config=cfg, rank=rank)
    return r, dst


def _run(ep, rank: int, n: int):
    return ep.push(n) if rank < 2 else ep.pull(n)


def _corrupted(rank: int, address: str) -> dict:
    out: dict = {}
    execute.tamper = _flip_to_rank_2  # only rank 0 and 1 send; the hook runs on senders
    # Without checksums the corruption lands silently.
    ep, t = _endpoint(
        rank,
        group_config(address, 2, 2, job="plain"),
    )
    _run(ep, rank, 1)
    ep.close()
    if rank >= 2:
        out["plain_intact"] = bool(torch.equal(t, _weights(1)[:, (rank - 2) * 24 : (rank - 1) * 24]))
    # With checksums every rank raises, naming the message.
    cfg = group_config(address, 2, 2, job="sums", checksums=True)
    ep, t = _endpoint(rank, cfg)
    try:
        _run(ep, rank, 1)
        out["error"] = None
    except RefitError as e:
        out.update(error=str(e), step=e.step)
    # The same sessions refit again once the wire is clean (the group is
    # rebuilt), still checking every message: each rank counts the checksums
    # it takes (senders of what they send, receivers of what arrived).
    execute.tamper = None
    taken: list[int] = []

    def counted(buf: torch.Tensor, backend: str) -> torch.Tensor:
        taken.append(buf.numel())
        return checksum(buf, backend)

    execute.checksum = counted
    if rank >= 2:
        t.zero_()
    _run(ep, rank, 1)
    out["retry_ok"] = rank < 2 or bool(torch.equal(t, _weights(1)[:, (rank - 2) * 24 : (rank - 1) * 24]))
    out["checksums_taken"] = len(taken)
    ep.close()
    return out


def test_checksums_catch_bytes_corrupted_in_flight_on_every_rank_and_the_next_refit_works():
    server = procs.StoreServer()
    res = procs.check(procs.run(_corrupted, 4, server.address))
    # Control: without checksums the flipped bit reaches rank 2's weights unnoticed.
    assert res[2]["plain_intact"] is False
    assert res[3]["plain_intact"] is True
    for r in res:
        assert r["step"] == "transfer", r
        assert "checksum mismatch" in r["error"], r["error"]
        assert "to rank 2" in r["error"] and "'model.layers.0.mlp.w'[" in r["error"], r["error"]
        assert r["retry_ok"], r
        assert r["checksums_taken"] > 0, r


def _versions(rank: int, address: str) -> list:
    """Rank 0 trains; ranks 1-2 keep everything. Returns what each attempt did."""
    cfg = group_config(address, 1, 2)
    meta = TensorMeta("w", (8, 4), "float32")
    log: list = []
    if rank == 0:
        src = _weights(0)[:8, :4].clone()

        def sender() -> Sender:
            return Sender.from_pieces(
                [PieceSpec(meta, Box((0, 0), (8, 4)), "w", (8, 4))], {"w": src}, config=cfg, rank=0
            )

        ep = sender()
    else:
        dst = torch.zeros(8, 4)
        ep = Receiver({"w": dst}, [PieceSpec(meta, Box((0, 0), (8, 4)), "w", (8, 4))], config=cfg, rank=rank)

    def attempt(n: int, value: float) -> None:
        if rank == 0:
            src.fill_(value)
        try:
            ep.push(n) if rank == 0 else ep.pull(n)
            log.append(("ok", n, None if rank == 0 else float(dst[0, 0])))
        except RefitError as e:
            log.append((e.step, n, str(e), None if rank == 0 else float(dst[0, 0])))

    attempt(1, 1.0)  # ok
    attempt(1, 9.0)  # replayed
    attempt(3 if rank == 0 else 2, 9.0)  # ranks disagree
    if rank == 0:
        ep.close()
        ep = sender()  # a restarted trainer whose counter starts over
    attempt(1, 9.0)  # stale for the receivers, whatever the trainer remembers
    attempt(2, 2.0)  # ok
    ep.close()
    return log


def test_stale_replayed_and_mismatched_refit_numbers_are_rejected_on_every_rank_before_any_byte_moves():
    server = procs.StoreServer()
    logs = procs.check(procs.run(_versions, 3, server.address, reuse=True))
    for rank, log in enumerate(logs):
        ok1, replay, split, stale, ok2 = log
        assert ok1[0] == "ok" and ok2[0] == "ok"
        assert (
            replay[0] == "version"
            and "refit 1 is stale or replayed: refit 1 already succeeded on rank(s) 0-2" in replay[2]
        )
        assert (
            split[0] == "version"
            and "ranks disagree on the refit number: refit 2 on rank(s) 1-2; refit 3 on rank(s) 0" in split[2]
        )
        assert stale[0] == "version" and "already succeeded on rank(s) 1-2" in stale[2], stale
        if rank:
            assert ok1[2] == 1.0 and ok2[2] == 2.0
            # Nothing moved in the rejected refits.
            assert replay[3] == split[3] == stale[3] == 1.0


def _disagree(rank: int, address: str) -> str:
    cfg = GroupConfig(
        address=address, num_sources=1, num_destinations=1, timeout_s=procs.GROUP_TIMEOUT_S, checksums=rank == 0
    )
    _, t = None, torch.zeros(4)
    piece = [PieceSpec(TensorMeta("x", (4,), "float32"), Box((0,), (4,)), "x", (4,))]
    try:
        if rank == 0:
            Sender.from_pieces(piece, {"x": t}, config=cfg, rank=0).push(1)
        else:
            Receiver({"x": t}, piece, config=cfg, rank=1).pull(1)
    except RefitError as e:
        return f"{e.step}: {e}"
    return "no error"


def test_ranks_that_disagree_on_checksums_are_refused_at_join():
    out = procs.check(procs.run(_disagree, 2, f"127.0.0.1:{procs.free_port()}", reuse=True))
    for text in out:
        assert text.startswith("join:"), text
        assert "ranks disagree on GroupConfig.checksums: on on rank(s) 0; off on rank(s) 1" in text


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("n", [1, 3, 4, 1023, 4096 + 7])
def test_checksum_catches_a_flipped_bit_and_a_swap(backend, n):
    g = torch.Generator().manual_seed(n)
    raw = torch.randint(0, 256, (n + 1,), dtype=torch.uint8, generator=g)
    buf = raw[1:]  # misaligned on purpose
    base = checksum(buf, backend)
    assert torch.equal(base, checksum(buf.clone(), backend))
    flipped = buf.clone()
    flipped[n // 2] ^= 1
    assert not torch.equal(base, checksum(flipped, backend))
    if n >= 8:
        swapped = buf.clone()
        words = swapped[: n - n % 4].view(torch.int32)
        if words[0] != words[1]:
            words[[0, 1]] = words[[1, 0]].clone()
            assert not torch.equal(base, checksum(swapped, backend))
