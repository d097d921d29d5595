"""Inputs that shape a plan, checked before any byte moves: local tensors
against their metadata, per-rank knobs agreed at join, the role split.

Each case runs 2 trainer ranks and 2 engine ranks in real processes over
gloo. A bad input makes every rank raise a :class:`RefitError` naming the
tensor, the dtypes or values and the ranks, agreed by every rank (each
reported its verdict: none waited out a timeout); destination tensors keep
their old bytes; no process dies by a signal; and the next refit on the
same group succeeds.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, given, seed, settings
from hypothesis import strategies as st

from reshard.errors import RefitError
from reshard.plan.box import Box
from reshard.plan.layout import TensorMeta
from reshard.plan.specs import PieceSpec
from reshard.receiver import Receiver
from reshard.sender import Sender

from . import procs
from .support import HANG_S, group_config

SIZES = {"small": (8, 6), "large": (1024, 512)}
"""``small``: packed, staged messages; ``large``: 1 MiB halves, received
and sent in place (zero copy)."""


def _full(shape: tuple[int, int]) -> torch.Tensor:
    return torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) * 0.5 + 1


def _fault_scenario(rank: int, address: str, case: str, side: str, size: str) -> dict:
    """Refit 1 with one bad rank (trainer rank 0 or engine rank 2), then the
    same refit again with the fault gone, on the same Sender / Receiver."""
    shape = SIZES[size]
    meta = TensorMeta("model.w", shape, "float32")
    cfg = group_config(address, 2, 2)
    full = _full(shape)
    half = shape[0] // 2
    out: dict = {"rank": rank}
    bad_rank = 0 if side == "trainer" else 2
    if rank < 2:
        # Replicas: each trainer rank holds the whole tensor (a plain dict source).
        tensors = {"model.w": full.clone()}
        sender = Sender(tensors, config=cfg, rank=rank)
        if rank == bad_rank and case == "dtype":
            tensors["model.w"] = full.to(torch.bfloat16)  # the trainer cast its model after attaching
        if rank == bad_rank and case == "noncontig":
            tensors["model.w"] = full.t().contiguous().t()
        try:
            sender.push(1)
            out["first"] = "ok"
        except RefitError as e:
            out.update(first=str(e), step=e.step, agreed=e.agreed)
        tensors["model.w"] = full.clone()
        sender.push(1)
        sender.close()
        return out
    j = rank - 2
    dst = torch.zeros(half, shape[1])
    recv = Receiver(
        {"w": dst},
        [PieceSpec(meta, Box((j * half, 0), (half, shape[1])), "w", (half, shape[1]))],
        config=cfg,
        rank=rank,
    )
    override = None
    if rank == bad_rank and case == "dtype":
        override = {"w": torch.zeros(half, shape[1], dtype=torch.bfloat16)}
    if rank == bad_rank and case == "noncontig":
        override = {"w": torch.zeros(shape[1], half).t()}
    if rank == bad_rank and case == "shape":
        override = {"w": torch.zeros(half + 1, shape[1])}
    try:
        recv.pull(1, into=override)
        out["first"] = "ok"
    except RefitError as e:
        out.update(first=str(e), step=e.step, agreed=e.agreed)
    out["untouched"] = bool((dst == 0).all()) and (override is None or bool((override["w"] == 0).all()))
    recv.pull(1)
    out["exact"] = torch.equal(dst, full[j * half : (j + 1) * half])
    recv.close()
    return out


@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize(
    ("case", "side", "needle"),
    [
        # A sender built from a module or dict re-reads it at every push: the
        # cast rank now publishes bfloat16 and disagrees with the other one.
        ("dtype", "trainer", "source ranks disagree on tensor 'model.w': rank 0 says shape"),
        ("dtype", "engine", "destination rank 2: local tensor 'w' is bfloat16, its layout says float32"),
        ("noncontig", "trainer", "source rank 0: local tensor 'model.w' of shape"),
        ("noncontig", "engine", "destination rank 2: local tensor 'w' of shape"),
        ("shape", "engine", "destination rank 2: local tensor 'w' has shape [513, 512], its layout says [512, 512]"),
    ],
)
def test_a_bad_local_tensor_fails_every_rank_at_plan_and_the_next_refit_works(case, side, needle, size):
    if case == "shape" and size == "small":
        needle = needle.replace("[513, 512]", "[5, 6]").replace("[512, 512]", "[4, 6]")
    server = procs.StoreServer()
    outcomes = procs.run(_fault_scenario, 4, server.address, case, side, size, timeout=HANG_S, reuse=True)
    assert [o.exitcode for o in outcomes] == [0, 0, 0, 0], [(o.exitcode, o.error) for o in outcomes]
    results = procs.check(outcomes)
    for r in results:
        assert r.get("step") == "plan", r
        assert needle in r["first"], r["first"]
        if case == "noncontig":
            assert "is not contiguous in memory" in r["first"]
        if case == "dtype" and side == "trainer":
            assert "bfloat16, rank 1 says shape" in r["first"] and r["first"].endswith("float32"), r["first"]
        assert "model.w" in r["first"]
        assert r["agreed"], r  # every rank reported its verdict at the plan step: none timed out
    for r in results[2:]:
        assert r["untouched"], r
        assert r["exact"], r


def _knobs_scenario(rank: int, address: str, cases: list[dict]) -> list[str]:
    """Play every case; engines and trainers ask for their own budgets and rounds."""
    done = []
    for i, c in enumerate(cases):
        shape = tuple(c["shape"])
        meta = TensorMeta("model.w", shape, "float32")
        cfg = group_config(address, 2, 2, job=f"k{i}")
        full = _full(shape)
        knobs = {"budget_bytes": c["budget"][rank], "round_bytes": c["rounds"][rank]}
        try:
            if rank < 2:
                rows = (rank * shape[0] // 2, shape[0] // 2)
                local = full[rows[0] : rows[0] + rows[1]].clone()
                box = Box((rows[0], 0), (rows[1], shape[1]))
                s = Sender.from_pieces(
                    [PieceSpec(meta, box, "w", box.sizes)], {"w": local}, config=cfg, rank=rank, **knobs
                )
                s.push(1)
                s.close()
                done.append("ok")
                continue
            j = rank - 2
            cols = shape[1] // 2
            dst = torch.zeros(shape[0], cols)
            r = Receiver(
                {"w": dst},
                [PieceSpec(meta, Box((0, j * cols), (shape[0], cols)), "w", (shape[0], cols))],
                config=cfg,
                rank=rank,
                **knobs,
            )
            stats = r.pull(1)
            r.close()
            assert torch.equal(dst, full[:, j * cols : (j + 1) * cols]), f"case {i}: rank {rank} differs"
            assert stats.exec.peak_staging_bytes <= knobs["budget_bytes"], (i, stats.exec.peak_staging_bytes)
            done.append("ok")
        except RefitError as e:
            # A clean refusal: agreed by every rank, at the plan step.
            assert e.step == "plan" and e.agreed, str(e)
            assert "staging does not fit the budget" in str(e), str(e)
            done.append("refused")
    return done


@st.composite
def _knob_cases(draw) -> dict:
    rows = draw(st.sampled_from([8, 64, 256]))
    cols = draw(st.sampled_from([4, 32, 128]))
    budget = [draw(st.sampled_from([256, 4096, 65536, 1 << 20, 256 << 20])) for _ in range(4)]
    rounds = [draw(st.one_of(st.none(), st.sampled_from([64, 1024, 16384, 1 << 20]))) for _ in range(4)]
    return {"shape": [rows, cols], "budget": budget, "rounds": rounds}


KNOBS_SEED = 0xF05D79FF4CD76E04F8CEB039EADB1C8940A5351374944485D74495A656FB0322B91E8FCF5CA62C7D61882356702CE888
"""The seed the cases are drawn with: the one Hypothesis derived
(``derandomize``) from this collector's source before it changed, so the
cases are the ones the test always played, whatever edits come."""


def _collect(n: int) -> list[dict]:
    found: list[dict] = []

    @seed(KNOBS_SEED)
    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None)
    @given(_knob_cases())
    def collect(c):
        found.append(c)

    collect()
    return found


def test_per_rank_budgets_and_rounds_give_one_agreed_plan():
    """Budgets and round sizes drawn per rank (engines often have less memory
    than trainers): the refit is bit-exact, or refused by every rank at the
    plan step with a clear error; never hung, never aborted."""
    cases = _collect(30)
    server = procs.StoreServer()
    outcomes = procs.run(_knobs_scenario, 4, server.address, cases, timeout=HANG_S, reuse=True)
    assert [o.exitcode for o in outcomes] == [0, 0, 0, 0], [(o.exitcode, o.error) for o in outcomes]
    results = procs.check(outcomes)
    # Every rank reached the same verdict on every case.
    assert all(r == results[0] for r in results), results
    assert results[0].count("ok") >= len(cases) // 2, results[0]


def _split_scenario(rank: int, address: str) -> dict:
    # Rank 3 was started with another split of the same world size.
    s, d = (3, 1) if rank == 3 else (2, 2)
    # Every hello must arrive for the verdict (a join that must succeed): the
    # group timeout is a hang guard; the refusal itself is agreed at once.
    cfg = group_config(address, s, d)
    meta = TensorMeta("model.w", (8, 6), "float32")
    dst = torch.zeros(8, 6)
    try:
        if rank < s:
            Sender.from_pieces(
                [PieceSpec(meta, Box((0, 0), (8, 6)), "w", (8, 6))], {"w": _full((8, 6))}, config=cfg, rank=rank
            ).push(1)
        else:
            Receiver({"w": dst}, [PieceSpec(meta, Box((0, 0), (8, 6)), "w", (8, 6))], config=cfg, rank=rank).pull(1)
    except RefitError as e:
        return {"step": e.step, "error": str(e), "agreed": e.agreed, "untouched": bool((dst == 0).all())}
    return {"step": None}


def test_a_rank_with_another_role_split_is_refused_at_join():
    server = procs.StoreServer()
    results = procs.check(procs.run(_split_scenario, 4, server.address, reuse=True))
    for r in results:
        assert r["step"] == "join", r
        assert "ranks disagree on the group's role split" in r["error"], r["error"]
        assert "2 sources + 2 destinations on rank(s) 0-2" in r["error"], r["error"]
        assert "3 sources + 1 destinations on rank(s) 3" in r["error"], r["error"]
        assert r["agreed"], r  # every rank read every hello at the join: none timed out
        assert r["untouched"]


def test_a_local_holding_tensors_of_two_dtypes_must_name_its_dtype():
    """A fused local whose tensors differ in dtype is ambiguous unless the
    layout names its dtype (``build_layout`` always does; a layout built by
    hand may not): refused by the local checks, at the plan step on every
    rank, before any byte moves. With its dtype named, it is a cast."""
    from reshard.plan.checks import check_locals
    from reshard.plan.layout import Layout, LocalTensor, Piece

    a, b = TensorMeta("a", (2, 4), "float16"), TensorMeta("b", (3, 4), "float32")

    def layout(dtype: str) -> Layout:
        return Layout(
            rank=0,
            tensors=(a, b),
            locals=(LocalTensor("fused", (5, 4), dtype),),
            pieces=(Piece(0, Box((0, 0), (2, 4)), 0, (0, 0)), Piece(1, Box((0, 0), (3, 4)), 0, (2, 0))),
        )

    fused = {"fused": torch.zeros(5, 4)}
    (problem,) = check_locals(layout(""), fused, role="destination")
    assert "'fused' holds tensors of dtypes float16 and float32 ('a', 'b')" in problem.message
    assert "destination rank 0" in problem.message
    assert check_locals(layout("float32"), fused, role="destination") == []
