"""Transport over real multi-process gloo groups: random layouts move bit-exactly."""

from __future__ import annotations

import pytest
import torch

from reshard.plan.layout import TensorMeta
from reshard.receiver import Receiver
from reshard.sender import Sender

from . import procs
from .support import collect_problems, encode_problem, global_tensor, group_config, relayouts, run_problems


@pytest.mark.slow
def test_random_layouts_move_bit_exactly_over_gloo():
    found = collect_problems(40)
    assert len(found) >= 20
    blobs = [encode_problem(p) for p in found]
    world = max(len(p.ranks) for p in found)
    # A small staging budget makes planning shrink rounds and stage in pieces.
    server = procs.StoreServer()
    out = procs.check(procs.run(run_problems, world, server.port, blobs, 4096, timeout=600))
    played = set().union(*map(set, out))
    assert played == {f"p{i}" for i in range(len(found))}


def _two_by_two(rank: int, port: int, dtype: str) -> bool:
    meta = TensorMeta("w", (64, 48), dtype)
    from reshard.plan.box import Box
    from reshard.plan.specs import PieceSpec

    cfg = group_config(f"127.0.0.1:{port}", 2, 2, host_store=None)  # rank 0 hosts the store
    full = global_tensor(meta)
    if rank < 2:
        local = full[rank * 32 : (rank + 1) * 32].clone()
        s = Sender.from_pieces(
            [PieceSpec(meta, Box((rank * 32, 0), (32, 48)), "w", (32, 48))], {"w": local}, config=cfg, rank=rank
        )
        s.push(1)
        s.close()
        return True
    j = rank - 2
    dst = torch.zeros(64, 24, dtype=full.dtype)
    r = Receiver({"w": dst}, [PieceSpec(meta, Box((0, j * 24), (64, 24)), "w", (64, 24))], config=cfg, rank=rank)
    r.pull(1)
    r.close()
    return torch.equal(dst.view(torch.uint8), full[:, j * 24 : (j + 1) * 24].contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int8", "float8_e4m3fn"])
def test_dtypes_row_split_to_column_split(dtype):
    assert procs.check(procs.run(_two_by_two, 4, procs.free_port(), dtype, reuse=True)) == [True] * 4


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _both_methods(rank: int, address: str) -> list[bool]:
    """The same layouts moved by reshard and by gather-and-broadcast, twice each."""
    from reshard.plan.box import Box
    from reshard.plan.specs import PieceSpec

    metas = [TensorMeta(f"layers.{i}.w", (96, 40), "bfloat16") for i in range(3)] + [
        TensorMeta("norm.weight", (40,), "float32")
    ]
    cfg = group_config(address, 2, 3)
    results = []
    if rank < 2:
        pieces, tensors = [], {}
        for m in metas:
            if m.shape == (40,):
                tensors[m.name] = global_tensor(m).clone()
                pieces.append(PieceSpec(m, Box((0,), (40,)), m.name, (40,)))
            else:
                tensors[m.name] = global_tensor(m)[rank * 48 : (rank + 1) * 48].clone()
                pieces.append(PieceSpec(m, Box((rank * 48, 0), (48, 40)), m.name, (48, 40)))
        s = Sender.from_pieces(pieces, tensors, config=cfg, rank=rank, budget_bytes=8 << 10)
        for i, method in enumerate(["reshard", "gather_broadcast", "reshard", "gather_broadcast"]):
            s.push(i + 1, method=method)
        s.close()
        return [True]
    j = rank - 2
    pieces = []
    for m in metas:
        if m.shape == (40,):
            pieces.append(PieceSpec(m, Box((0,), (40,)), m.name, (40,)))
        else:
            pieces.append(PieceSpec(m, Box((j * 32, 0), (32, 40)), m.name, (32, 40)))

    def zeros() -> dict[str, torch.Tensor]:
        return {p.local: torch.zeros(p.local_shape, dtype=getattr(torch, p.tensor.dtype)) for p in pieces}

    r = Receiver(zeros(), pieces, config=cfg, rank=rank, budget_bytes=8 << 10)
    for i, method in enumerate(["reshard", "gather_broadcast", "reshard", "gather_broadcast"]):
        tensors = zeros()
        stats = r.pull(i + 1, method=method, into=tensors)
        ok = all(
            _same_bits(
                tensors[p.local],
                global_tensor(p.tensor)[
                    tuple(slice(o, o + n) for o, n in zip(p.box.offsets, p.box.sizes, strict=True))
                ],
            )
            for p in pieces
        )
        full = sum(m.nbytes for m in metas)
        kept = sum(p.box.numel * getattr(torch, p.tensor.dtype).itemsize for p in pieces)
        expect = kept if method == "reshard" else full
        # reshard receives exactly what the rank keeps; the baseline, the whole model.
        results.append(ok and stats.exec.bytes_received == expect)
    r.close()
    return results


def test_gather_broadcast_baseline_behind_the_same_interface():
    server = procs.StoreServer()
    out = procs.check(procs.run(_both_methods, 5, server.address, reuse=True))
    assert out[2:] == [[True] * 4] * 3


def _staging(rank: int, address: str) -> dict:
    """4 MiB tensor, rows split on the trainer, columns on the engine (non-contiguous
    on both sides), with a 256 KiB staging budget."""
    from reshard.plan.box import Box
    from reshard.plan.specs import PieceSpec

    meta = TensorMeta("w", (1024, 1024), "float32")
    cfg = group_config(address, 2, 2)
    full = global_tensor(meta)
    budget = 256 << 10
    if rank < 2:
        local = full[rank * 512 : (rank + 1) * 512].clone()
        s = Sender.from_pieces(
            [PieceSpec(meta, Box((rank * 512, 0), (512, 1024)), "w", (512, 1024))],
            {"w": local},
            config=cfg,
            rank=rank,
            budget_bytes=budget,
        )
        st = s.push(1)
        s.close()
        return {"peak": st.exec.peak_staging_bytes, "budget": budget, "ok": True}
    j = rank - 2
    dst = torch.zeros(1024, 512)
    r = Receiver(
        {"w": dst},
        [PieceSpec(meta, Box((0, j * 512), (1024, 512)), "w", (1024, 512))],
        config=cfg,
        rank=rank,
        budget_bytes=budget,
    )
    st = r.pull(1)
    r.close()
    ok = _same_bits(dst, full[:, j * 512 : (j + 1) * 512])
    return {"peak": st.exec.peak_staging_bytes, "budget": budget, "ok": ok, "slice": dst.numel() * 4}


def test_staging_stays_within_the_budget_and_never_holds_a_whole_slice():
    server = procs.StoreServer()
    out = procs.check(procs.run(_staging, 4, server.address, reuse=True))
    for o in out:
        assert o["ok"]
        assert 0 < o["peak"] <= o["budget"]
    # A receiver keeping a 2 MiB slice never stages more than the 256 KiB budget of it.
    assert all(o["peak"] < o["slice"] / 8 for o in out[2:])


def _casts(rank: int, port: int, src_dtype: str, dst_dtype: str, rows: int) -> dict:
    """The trainer holds ``src_dtype``, the engine keeps ``dst_dtype``: bytes
    move in the source dtype and are cast on arrival, like an engine's own
    ``param.copy_(loaded)``; by reshard and by the baseline."""
    from reshard.plan.box import Box
    from reshard.plan.specs import PieceSpec

    meta = TensorMeta("w", (rows, 256), src_dtype)
    cfg = group_config(f"127.0.0.1:{port}", 2, 2, host_store=None)  # rank 0 hosts the store
    full = torch.randn(rows, 256, generator=torch.Generator().manual_seed(3)).to(getattr(torch, src_dtype))
    half = rows // 2
    if rank < 2:
        local = full[rank * half : (rank + 1) * half].clone()
        s = Sender.from_pieces(
            [PieceSpec(meta, Box((rank * half, 0), (half, 256)), "w", (half, 256))], {"w": local}, config=cfg, rank=rank
        )
        s.push(1)
        s.push(2, method="gather_broadcast")
        s.close()
        return {}
    j = rank - 2
    # The engine says its tensor is dst_dtype (its own guess of the canonical one) and keeps it so.
    piece = PieceSpec(
        TensorMeta("w", (rows, 256), dst_dtype),
        Box((j * half, 0), (half, 256)),
        "w",
        (half, 256),
        local_dtype=dst_dtype,
    )
    dst = torch.zeros(half, 256, dtype=getattr(torch, dst_dtype))
    r = Receiver({"w": dst}, [piece], config=cfg, rank=rank)
    want = full[j * half : (j + 1) * half].to(getattr(torch, dst_dtype))
    out = {}
    for refit, method in ((1, "reshard"), (2, "gather_broadcast")):
        dst.zero_()
        st = r.pull(refit, method=method)
        out[method] = (_same_bits(dst, want), st.exec.casts, st.exec.bytes_received)
    r.close()
    return out


@pytest.mark.parametrize("rows", [8, 2048])
@pytest.mark.parametrize(("src", "dst"), [("bfloat16", "float32"), ("float32", "bfloat16"), ("float16", "bfloat16")])
def test_float_dtypes_cast_on_arrival_bit_exactly(src, dst, rows):
    out = procs.check(procs.run(_casts, 4, procs.free_port(), src, dst, rows, reuse=True))
    nbytes = rows // 2 * 256 * getattr(torch, src).itemsize
    for r in out[2:]:
        same, casts, received = r["reshard"]
        assert same
        assert casts == {f"{src}->{dst}": nbytes}
        assert received == nbytes
        assert r["gather_broadcast"][0]


def test_a_layout_change_on_any_rank_replans_and_plans_are_cached_by_layouts():
    server = procs.StoreServer()
    out = procs.check(procs.run(relayouts, 4, server.address, reuse=True))
    for rank, per_refit in enumerate(out):
        assert all(ok for ok, _ in per_refit), (rank, per_refit)
        # Plans made by refit 1..6: the same layouts reuse the plan (2), one
        # source's change replans everywhere (3), a rebuilt group with those
        # layouts (4) and the change undone (5) hit the cache, a change on
        # the engine side replans (6).
        assert [made for _, made in per_refit] == [1, 1, 2, 2, 2, 3], (rank, per_refit)
