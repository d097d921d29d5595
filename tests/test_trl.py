"""TRL's ``GRPOTrainer`` through reshard's integration
(``reshard.integrations.trl.ReshardGRPOTrainer``), in server mode against a
real vLLM server started with reshard's worker extension and in colocate
mode (TRL's own ``LLM`` in every trainer process), on 2 trainer processes
launched as ``accelerate launch --cpu`` launches them, the policy sharded
with FSDP2 over both. Accelerate runs FSDP on accelerators only (on CPU its
``MULTI_CPU`` mode wraps the model in DDP, replicas), so transformers shards
it at load time (``DistributedConfig(fsdp_size=2)``: DTensors on a gloo
mesh) and the trainer leaves it as it is.

Each mode trains 3 steps twice from the same checkpoint: once with every
sync a reshard refit, once with syncing off (the control). What is checked
is what TRL itself logs (``sampling/sampling_logp_difference/max``: the
largest gap between the engine's sampling logprobs and the trainer's
recomputed ones, per step), the refits (one per step), the bytes (each
worker receives exactly what it keeps; the trainer ranks send it between
them), that TRL's NCCL communicator never exists, and that after a last
refit the engine's greedy tokens are the trainer's own choices on its weights
(up to float32 rounding at a near-tie).
"""

from __future__ import annotations

import pytest

from reshard.testing.tiny import build_tiny_model

from . import procs
from .trl_support import grpo_rank
from .vllm_support import PROMPTS, VllmServer

pytest.importorskip("trl")
pytest.importorskip("vllm")

pytestmark = [pytest.mark.engine, pytest.mark.slow]

WORLD = 2
STEPS = 3
IN_STEP = 0.1
"""The largest logprob gap (nats) a synced step may show: float32 on both
sides, so what remains is kernel rounding (about 1e-6 here)."""
TIE = 1e-3
"""The largest gap (nats) between the trainer's most likely next token and
the engine's greedy choice at any position, teacher-forced: 0 where they
agree, float32 rounding (about 1e-6) where a near-tie splits them."""
STALE = 1.0
"""The gap the control run must exceed at some step: the engine generates
from the initial weights while the policy moves (2.6 and 4.1 here)."""


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("trl") / "policy", "qwen2", seed=0))


def _grpo(policy: str, out: str, mode: str, url: str, sync: bool) -> list[dict]:
    args = (WORLD, procs.free_port(), policy, out, mode, url, procs.free_port(), STEPS, sync, PROMPTS)
    return procs.check(procs.run(grpo_rank, WORLD, *args, timeout=900, daemon=False))


@pytest.fixture(scope="module")
def server_runs(policy, tmp_path_factory):
    root = tmp_path_factory.mktemp("trl-server")
    srv = VllmServer(
        policy,
        tp=1,
        dtype="float32",
        log=str(root / "server.log"),
        args=[
            "--worker-extension-cls", "reshard.adapters.vllm.ReshardWorkerExtension",
            "--logprobs-mode", "processed_logprobs",
        ],
    )  # fmt: skip
    try:
        # The control first: it never touches the server's weights.
        control = _grpo(policy, str(root / "control"), "server", srv.url, sync=False)
        synced = _grpo(policy, str(root / "synced"), "server", srv.url, sync=True)
        yield {"control": control, "synced": synced, "server_tokens": srv.greedy()}
    finally:
        srv.close()


@pytest.fixture(scope="module")
def colocate_runs(policy, tmp_path_factory):
    root = tmp_path_factory.mktemp("trl-colocate")
    control = _grpo(policy, str(root / "control"), "colocate", "", sync=False)
    synced = _grpo(policy, str(root / "synced"), "colocate", "", sync=True)
    return {"control": control, "synced": synced}


def _check_logprobs(runs: dict) -> None:
    synced = runs["synced"][0]["logp_max"]
    control = runs["control"][0]["logp_max"]
    print(f"TRL sampling_logp_difference/max per step: refits {synced}, no sync {control}")
    assert len(synced) == STEPS and len(control) == STEPS, (synced, control)
    assert all(v < IN_STEP for v in synced), f"TRL's sampling_logp_difference/max with reshard refits: {synced}"
    assert max(control) > STALE, f"... and with syncing off: {control}"
    # Every rank logs TRL's gathered metric.
    assert all(o["logp_max"] == synced for o in runs["synced"])


def _check_trainer(runs: dict) -> None:
    for o in runs["synced"] + runs["control"]:
        # FSDP2: the parameters are DTensors.
        assert o["dtensor_params"] > 0
        assert o["communicator"] is None
    assert [o["refits_in_training"] for o in runs["synced"]] == [STEPS] * WORLD
    assert [o["refits"] for o in runs["synced"]] == [STEPS + 1] * WORLD  # and the last one after training
    assert [o["refits_in_training"] for o in runs["control"]] == [0] * WORLD


def _check_bytes(workers_per_refit: list[list[dict]], sent_per_rank: list[list[int]]) -> None:
    """``workers_per_refit[i]``: every worker's stats of refit ``i``;
    ``sent_per_rank[r][i]``: what trainer rank ``r`` sent in refit ``i``."""
    assert len(workers_per_refit) == STEPS + 1
    for i, workers in enumerate(workers_per_refit):
        assert workers, f"refit {i + 1}: no worker stats"
        for w in workers:
            assert w["refit"] == i + 1
            assert w["bytes_received"] == w["kept_bytes"] > 0, w
            assert w["bytes_landed"] == w["kept_bytes"]
        sent = [s[i] for s in sent_per_rank]
        # Each trainer rank sends its own shard: both send, neither sends all.
        assert all(0 < x < sum(sent) for x in sent), sent
        assert sum(sent) == sum(w["bytes_received"] for w in workers)


def test_server_mode_refits_every_step_without_a_communicator(server_runs):
    _check_trainer(server_runs)
    rank0, rank1 = server_runs["synced"]
    # Rank 0 drives the server; the server has one worker.
    assert rank1["engine_stats"] == [[]] * (STEPS + 1)
    _check_bytes(rank0["engine_stats"], [rank0["sent"], rank1["sent"]])


def test_server_mode_trl_logprob_gap_stays_small_with_refits(server_runs):
    _check_logprobs(server_runs)


def _check_engine_tokens(rank0: dict) -> None:
    """The engine's greedy tokens are the trainer's own choices, position by
    position (teacher-forced on the trainer's weights), up to float32
    rounding: a near-tie may let transformers and vLLM pick different tokens,
    so the sequences themselves are not compared."""
    print(f"engine greedy tokens: largest gap to the trainer's choice {rank0['engine_gap']} nats")
    assert rank0["engine_greedy"] and rank0["engine_gap"] is not None
    assert rank0["engine_gap"] < TIE, (rank0["engine_gap"], rank0["engine_greedy"], rank0["greedy"])


def test_server_mode_serves_the_trainers_weights(server_runs):
    rank0 = server_runs["synced"][0]
    _check_engine_tokens(rank0)
    # The server still serves them after the trainers are gone.
    assert server_runs["server_tokens"] == rank0["engine_greedy"]
    assert server_runs["control"][0]["greedy"] != rank0["greedy"]


def test_colocate_mode_refits_every_step(colocate_runs):
    _check_trainer(colocate_runs)
    synced = colocate_runs["synced"]
    # Every rank drives its own colocated worker; together they are every worker.
    sent = [o["sent"] for o in synced]
    for i in range(STEPS + 1):
        workers = [w for o in synced for w in o["engine_stats"][i]]
        assert sorted(w["rank"] for w in workers) == [WORLD + r for r in range(WORLD)]
        for w in workers:
            assert w["refit"] == i + 1 and w["bytes_received"] == w["kept_bytes"] == w["bytes_landed"] > 0, w
        assert sum(s[i] for s in sent) == sum(w["bytes_received"] for w in workers)
        assert all(0 < s[i] < sum(t[i] for t in sent) for s in sent)


def test_colocate_mode_trl_logprob_gap_stays_small_with_refits(colocate_runs):
    _check_logprobs(colocate_runs)


def test_colocate_mode_engines_serve_the_trainers_weights(colocate_runs):
    synced = colocate_runs["synced"]
    _check_engine_tokens(synced[0])
    # Every rank's engine holds the same weights: the same kernels, the same tokens.
    assert [o["engine_greedy"] for o in synced] == [synced[0]["engine_greedy"]] * WORLD
