"""TRL's ``GRPOTrainer`` with ``peft_config`` (a LoRA policy) through
reshard's integration: a TRL user adds ``peft_config`` and nothing else.

Two trainer processes (Accelerate's DDP on CPU: the policy replicated) train
a LoRA adapter (r=8 on every linear layer) for 3 steps. Accelerate runs
FSDP on accelerators only, and TRL applies ``peft_config`` itself, so on CPU
a TRL LoRA run is DDP; the PEFT reader under FSDP2, FSDP1 and ZeRO-3 is
checked tensor by tensor in tests/test_peft.py.

- server mode, merged refits (the default): a real vLLM server (TP=2)
  started with reshard's worker extension gets the merged policy each step,
  no gather of the base; a control run with syncing off;
- server mode, adapter-only refits (``ReshardOptions(lora="adapter")``): the
  server (``--enable-lora``) gets only the adapter, into its LoRA slots, and
  TRL's generation uses each new version;
- colocate mode, merged refits.

Checked: TRL's own logprob gap per step (engine sampling vs the trainer's
recompute) stays small with refits and grows without them; one refit per
step; each worker lands exactly what it keeps; and after a last refit the
engine's greedy tokens are the merged policy's own choices (PEFT's
``merge_and_unload``, teacher-forced), as in tests/test_trl.py.
"""

from __future__ import annotations

import pytest

from reshard.testing.tiny import build_tiny_model

from . import procs
from .test_trl import IN_STEP, STEPS, TIE, WORLD
from .trl_support import grpo_rank
from .vllm_support import PROMPTS, VllmServer

pytest.importorskip("trl")
pytest.importorskip("vllm")
pytest.importorskip("peft")

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PEFT = dict(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("trl-peft") / "policy", "qwen2", seed=0))


def _grpo(policy: str, out: str, mode: str, url: str, sync: bool, lora: str = "merged") -> list[dict]:
    args = (WORLD, procs.free_port(), policy, out, mode, url, procs.free_port(), STEPS, sync, PROMPTS, PEFT, lora)
    return procs.check(procs.run(grpo_rank, WORLD, *args, timeout=900, daemon=False))


def _server(policy: str, log: str, *, lora: bool):
    args = [
        "--worker-extension-cls", "reshard.adapters.vllm.ReshardWorkerExtension",
        "--logprobs-mode", "processed_logprobs",
    ]  # fmt: skip
    env = {}
    if lora:
        args += ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    return VllmServer(policy, tp=2, dtype="float32", log=log, args=args, env=env)


@pytest.fixture(scope="module")
def merged_server_runs(policy, tmp_path_factory):
    root = tmp_path_factory.mktemp("trl-peft-server")
    srv = _server(policy, str(root / "server.log"), lora=False)
    try:
        control = _grpo(policy, str(root / "control"), "server", srv.url, sync=False)
        synced = _grpo(policy, str(root / "synced"), "server", srv.url, sync=True)
        yield {"control": control, "synced": synced}
    finally:
        srv.close()


@pytest.fixture(scope="module")
def adapter_server_runs(policy, tmp_path_factory):
    root = tmp_path_factory.mktemp("trl-peft-adapter")
    srv = _server(policy, str(root / "server.log"), lora=True)
    try:
        yield {"synced": _grpo(policy, str(root / "synced"), "server", srv.url, sync=True, lora="adapter")}
    finally:
        srv.close()


def _check_synced(runs: list[dict], *, adapter: bool = False) -> None:
    rank0 = runs[0]
    print(f"TRL sampling_logp_difference/max per step with LoRA refits: {rank0['logp_max']}")
    assert len(rank0["logp_max"]) == STEPS and all(v < IN_STEP for v in rank0["logp_max"]), rank0["logp_max"]
    assert [o["refits_in_training"] for o in runs] == [STEPS] * WORLD
    workers = [w for o in runs for refit in o["engine_stats"] for w in refit]
    assert workers
    for w in workers:
        assert w["bytes_landed"] == w["kept_bytes"] > 0, w
    print(f"engine greedy tokens: largest gap to the merged policy's choice {rank0['engine_gap']} nats")
    assert rank0["engine_gap"] is not None and rank0["engine_gap"] < TIE, rank0


def test_server_mode_merged_lora_refits(merged_server_runs):
    _check_synced(merged_server_runs["synced"])
    control = merged_server_runs["control"][0]["logp_max"]
    synced = merged_server_runs["synced"][0]["logp_max"]
    # Without syncing, the engine samples from the base while the adapter trains.
    assert max(control) > 10 * max(*synced, 1e-4), (control, synced)


def test_server_mode_adapter_only_refits(adapter_server_runs):
    runs = adapter_server_runs["synced"]
    _check_synced(runs, adapter=True)
    # Only the adapter travels: far less than the model.
    sent = sum(runs[0]["sent"])
    workers = [w for refit in runs[0]["engine_stats"] for w in refit]
    assert all(w["bytes_received"] < 2e6 for w in workers), [w["bytes_received"] for w in workers]
    assert sent > 0
    # TRL's generation (and the check above) used the newest version: one per refit.
    assert runs[0]["served_model"] == f"policy@{STEPS + 1}"


def test_colocate_mode_merged_lora_refits(policy, tmp_path):
    _check_synced(_grpo(policy, str(tmp_path / "colocate"), "colocate", "", sync=True))
