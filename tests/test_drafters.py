"""Speculative decoding: the drafter refit with its policy, sliced, in real
vLLM engines on this CPU (issue 48; :mod:`reshard.adapters.vllm.drafter`).

One engine host process runs every configuration in turn (a method and a
TP size), each as one scenario with a trainer rank beside the engine (a
``Sender`` over the checkpoint tensors, pushing into the offline engine):

1. a fresh engine on the target and drafter of v2: its whole state
   (target and drafter, ``engine_state``) and greedy tokens;
2. the engine under test on v1, refit to v2 with the drafter frozen
   (``draft="frozen"``): reported frozen, and its state differs from the
   fresh engine's in the drafter only (the state check can fail);
3. the drafter a destination again, but the trainer publishes the target
   only: the plan fails on every rank, naming the drafter's tensors;
4. the trainer publishes target and drafter: every worker receives exactly
   what it keeps (the drafter's share reported apart), and the state and
   tokens equal the fresh engine's (so do tensors the drafter shares with
   the target by reference: EAGLE's and MTP's embedding and head).

For ``draft_model`` the draft is the policy itself, so acceptance is the
functional check: whole before, falls after the policy-only refit (2),
whole again after the drafter's (4). vLLM counts it only with
``disable_log_stats=False`` (``vllm:spec_decode_num_*``, cumulative).
"""

from __future__ import annotations

import gc
import os
import shutil
from typing import Any

import pytest

from reshard.testing.drafters import build_eagle3_head, build_eagle_head, build_mtp_model, speculative_config
from reshard.testing.tiny import build_tiny_model

from . import procs

pytestmark = [pytest.mark.engine, pytest.mark.slow]

CONFIGS = [("draft_model", 1), ("eagle", 1), ("eagle3", 1), ("mtp", 1), ("qwen3_next_mtp", 1), ("eagle", 2)]
"""(method, TP): a separate draft model (acceptance), an EAGLE head sharing
the target's embedding and head, an EAGLE-3 head (its own head, a wider
attention input), DeepSeek-V3 MTP (MLA, MoE experts repacked,
``shared_head.head`` shared), Qwen3-Next MTP (``mtp.*``, a linear-attention
target, MoE), and the EAGLE head sliced at TP=2."""

_COUNTERS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def _models(root: str, method: str) -> dict[str, Any]:
    """Target and drafter paths of v1 and v2, engine arguments, the drafter's canonical prefix."""
    if method == "qwen3_next_mtp":
        v1 = build_mtp_model(os.path.join(root, "qwen3_next1"), "qwen3_next", seed=0, torch_dtype="bfloat16")
        v2 = build_mtp_model(os.path.join(root, "qwen3_next2"), "qwen3_next", seed=7, torch_dtype="bfloat16")
        return {
            "v": (str(v1), str(v2)),
            "d": (None, None),
            "args": {"dtype": "bfloat16", "enable_prefix_caching": False},
            "spec": {},
            "mtp_prefix": "mtp.",
            "method": "mtp",
        }
    if method == "mtp":
        v1 = build_mtp_model(os.path.join(root, "mtp1"), seed=0, torch_dtype="bfloat16")
        v2 = build_mtp_model(os.path.join(root, "mtp2"), seed=7, torch_dtype="bfloat16")
        return {
            "v": (str(v1), str(v2)),
            "d": (None, None),
            "args": {"attention_backend": "CPU_MLA", "dtype": "bfloat16"},
            "spec": {"attention_backend": "CPU_MLA"},
            "mtp_prefix": "model.layers.2.",
        }
    v1 = build_tiny_model(os.path.join(root, "llama1"), "llama", seed=0)
    v2 = build_tiny_model(os.path.join(root, "llama2"), "llama", seed=7)
    if method == "draft_model":
        # The draft is the policy (another copy): acceptance is whole.
        drafts = []
        for v, name in ((v1, "draft1"), (v2, "draft2")):
            d = os.path.join(root, name)
            if not os.path.exists(d):
                shutil.copytree(v, d)
            drafts.append(d)
        d1, d2 = drafts
    else:
        build = build_eagle3_head if method == "eagle3" else build_eagle_head
        d1 = str(build(os.path.join(root, f"{method}_1"), seed=3))
        d2 = str(build(os.path.join(root, f"{method}_2"), seed=9))
    return {"v": (str(v1), str(v2)), "d": (d1, d2), "args": {}, "spec": {}}


def _checkpoint(path: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _tensors(m: dict[str, Any], i: int, *, drafter: bool) -> dict[str, Any]:
    """What the trainer publishes for version ``i``: the target's checkpoint
    tensors, and the drafter's under its canonical names (or not)."""
    from safetensors.torch import load_file

    out = load_file(os.path.join(m["v"][i], "model.safetensors"))
    if "mtp_prefix" in m and not drafter:
        out = {k: v for k, v in out.items() if not k.startswith(m["mtp_prefix"])}
    if m["d"][i] is not None and drafter:
        out.update({"draft." + k: v for k, v in load_file(os.path.join(m["d"][i], "model.safetensors")).items()})
    return out


def _acceptance(llm) -> tuple[int, int]:
    """Cumulative (draft tokens, accepted tokens) of ``llm``."""
    got = {m.name: m.value for m in llm.get_metrics() if m.name in _COUNTERS}
    return int(got.get(_COUNTERS[0], 0)), int(got.get(_COUNTERS[1], 0))


def _greedy_accepting(llm) -> tuple[list[list[int]], float]:
    """Greedy tokens, and the share of draft tokens accepted while generating them."""
    from tests.vllm_support import greedy

    d0, a0 = _acceptance(llm)
    tokens = greedy(llm)
    d1, a1 = _acceptance(llm)
    return tokens, (a1 - a0) / max(d1 - d0, 1)


def _trainer(m: dict[str, Any], i: int) -> dict[str, Any]:
    """Sender arguments for a trainer of version ``i`` that trains the drafter
    beside the policy: the policy a transformers module, the drafter a
    second module (a draft model), or tensors (an EAGLE head, MTP layers the
    transformers model lacks, published under the policy checkpoint's names)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, m["args"].get("dtype", "float32"))
    policy = AutoModelForCausalLM.from_pretrained(m["v"][i], dtype=dtype)
    if "mtp_prefix" in m:
        w = load_file(os.path.join(m["v"][i], "model.safetensors"))
        return {
            "source": policy,
            "draft": {k: v for k, v in w.items() if k.startswith(m["mtp_prefix"])},
            "draft_names": "",
        }
    d = m["d"][i]
    if os.path.exists(os.path.join(d, "reshard-tiny.json")):
        return {"source": policy, "draft": AutoModelForCausalLM.from_pretrained(d, dtype=dtype)}
    return {"source": policy, "draft": load_file(os.path.join(d, "model.safetensors"))}


def _push(
    llm,
    source: Any,
    refit: int,
    tp: int,
    *,
    mode: str = "refit",
    after_round: Any = None,
    two_phase: bool = False,
    **sender: Any,
) -> list[dict[str, Any]]:
    """One refit of ``llm`` from a trainer rank in this process (its own refit group)."""
    from reshard import GroupConfig, Sender
    from reshard.adapters.vllm.driver import VllmEngines
    from reshard.testing.ports import free_port

    cfg = GroupConfig(address=f"127.0.0.1:{free_port()}", num_sources=1, num_destinations=tp, timeout_s=180)
    sender = Sender(source, config=cfg, **sender)
    try:
        sender.push(refit, engines=VllmEngines([llm], draft=mode, two_phase=two_phase), after_round=after_round)
        return [s.to_builtins() for s in sender.engine_stats]
    finally:
        sender.close()


def _delta_refits(llm, m: dict[str, Any], refit: int, tp: int) -> list[list[dict[str, Any]]]:
    """Delta refits of target and drafter (``GroupConfig.delta``) from one
    trainer: version 0 (dense, the base), then the trainer steps to version
    1 in place and the next refit sends deltas: each refit's stats."""
    import torch

    from reshard import GroupConfig, Sender
    from reshard.adapters.vllm.driver import VllmEngines
    from reshard.testing.ports import free_port

    cfg = GroupConfig(address=f"127.0.0.1:{free_port()}", num_sources=1, num_destinations=tp, timeout_s=180, delta=True)
    trainer, step = _trainer(m, 0), _trainer(m, 1)
    sender = Sender(**trainer, config=cfg)
    engines = VllmEngines([llm])
    out = []
    try:
        sender.push(refit, engines=engines)
        out.append([s.to_builtins() for s in sender.engine_stats])
        with torch.no_grad():
            for key in ("source", "draft"):
                if isinstance(trainer[key], dict):
                    for k, t in trainer[key].items():
                        t.copy_(step[key][k])
                else:
                    trainer[key].load_state_dict(step[key].state_dict())
        sender.push(refit + 1, engines=engines)
        out.append([s.to_builtins() for s in sender.engine_stats])
    finally:
        sender.close()
    return out


def scenario(rank: int, root: str, method: str, tp: int) -> dict[str, Any]:
    """Steps 1-4 of the module docstring for one configuration (in the host process)."""
    from reshard.adapters.vllm.driver import engine_state
    from reshard.errors import ReshardError
    from tests.vllm_support import make_llm, shutdown

    m = _models(root, method)
    out: dict[str, Any] = {}

    def start(i: int):
        spec = {**speculative_config(m.get("method", method), m["d"][i]), **m["spec"]}
        return make_llm(
            m["v"][i],
            tp,
            extension="reshard.adapters.vllm.ReshardWorkerExtension",
            speculative_config=spec,
            disable_log_stats=False,
            **{"dtype": "float32", **m["args"]},
        )

    llm = start(1)
    try:
        out["fresh_tokens"], out["fresh_acceptance"] = _greedy_accepting(llm)
        out["fresh"] = engine_state(llm)
    finally:
        shutdown(llm)
        del llm
        gc.collect()
    llm = start(0)
    try:
        out["start_tokens"], out["start_acceptance"] = _greedy_accepting(llm)
        out["frozen_stats"] = _push(llm, _tensors(m, 1, drafter=False), 1, tp, mode="frozen")
        out["frozen"] = engine_state(llm)
        out["frozen_tokens"], out["frozen_acceptance"] = _greedy_accepting(llm)
        try:
            _push(llm, _tensors(m, 1, drafter=False), 2, tp)
            out["refused"] = ""
        except ReshardError as e:
            out["refused"] = str(e)
        out["stats"] = _push(llm, refit=3, tp=tp, **_trainer(m, 1))
        out["refit"] = engine_state(llm)
        out["tokens"], out["acceptance"] = _greedy_accepting(llm)
        if method == "draft_model":
            # A refit that fails in the middle of the transfer (the trainer
            # raises after round 2 of many): the drafter's reload is left as
            # the target's is (put back, or mixed and said so), and the next
            # refit brings both back to a fresh engine's state.
            def fail(i: int) -> None:
                if i == 2:
                    raise RuntimeError("trainer fails after round 2")

            try:
                _push(llm, refit=4, tp=tp, after_round=fail, round_bytes=256 << 10, **_trainer(m, 0))
                out["failed"] = ""
            except Exception as e:
                out["failed"] = f"{type(e).__name__}: {e}"
            out["after_failure_stats"] = _push(llm, refit=5, tp=tp, **_trainer(m, 1))
            out["after_failure"] = engine_state(llm)
        # Two-phase refits (staged while serving, then committed): target
        # and drafter staged together, committed together.
        _push(llm, refit=10, tp=tp, two_phase=True, **_trainer(m, 0))
        out["two_phase_stats"] = _push(llm, refit=11, tp=tp, two_phase=True, **_trainer(m, 1))
        out["two_phase"] = engine_state(llm)
        out["drafter_names"] = sorted(
            k for k in _tensors(m, 1, drafter=True) if k.startswith("draft.") or k.startswith(m.get("mtp_prefix", "@"))
        )
    finally:
        shutdown(llm)
    return out


DELTA = ("mtp", 1)
"""The configuration delta refits are checked on (MTP layers in the target's
checkpoint, MoE experts repacked, ``shared_head.head`` shared)."""


def delta_scenario(rank: int, root: str, method: str, tp: int) -> dict[str, Any]:
    """Delta refits of target and drafter (:func:`_delta_refits`) in a host
    process of their own: a delta refit imports numba, whose llvmlite
    bindings break vLLM 0.32's triton-kernel scan (``vars(value).get``) for
    every engine started in that process afterwards."""
    from reshard.adapters.vllm.driver import engine_state
    from tests.vllm_support import make_llm, shutdown

    m = _models(root, method)
    spec = {**speculative_config(m.get("method", method), m["d"][0]), **m["spec"]}
    llm = make_llm(
        m["v"][0],
        tp,
        extension="reshard.adapters.vllm.ReshardWorkerExtension",
        speculative_config=spec,
        **{"dtype": "float32", **m["args"]},
    )
    try:
        out: dict[str, Any] = {"delta_stats": _delta_refits(llm, m, 1, tp)}
        out["delta"] = engine_state(llm)
    finally:
        shutdown(llm)
    return out


def _worker_stats(llm) -> list[dict[str, Any]]:
    """Every worker's account of its last refit through the native backend."""

    def stats(worker) -> dict[str, Any]:
        return worker.weight_transfer_engine.receiver.last_stats.to_builtins()

    return llm.collective_rpc(stats)


def native_scenario(rank: int, root: str) -> dict[str, Any]:
    """vLLM's own weight-transfer API with the ``reshard`` backend and a
    draft model equal to the policy, refit in vLLM's draft session: the
    trainer engine publishes policy and drafter (a second module); the
    drafter is ``separate``, so the target's session leaves it alone
    (acceptance falls), and the draft session moves the drafter's bytes
    alone (acceptance whole again; state equal to a fresh engine's)."""
    from reshard.adapters.vllm.backend import ReshardTrainerEngine, ReshardTrainerInitInfo
    from reshard.adapters.vllm.driver import engine_state
    from reshard.testing.ports import free_port
    from tests.vllm_support import make_llm, shutdown

    m = _models(root, "draft_model")
    llm = make_llm(
        m["v"][0],
        1,
        extension="reshard.adapters.vllm.ReshardWorkerExtension",
        speculative_config=speculative_config("draft_model", m["d"][0]),
        disable_log_stats=False,
        weight_transfer_config={"backend": "reshard"},
    )
    out: dict[str, Any] = {}
    try:
        out["start_tokens"], out["start_acceptance"] = _greedy_accepting(llm)
        trainer = _trainer(m, 1)
        info = ReshardTrainerInitInfo(
            rank=0,
            address=f"127.0.0.1:{free_port()}",
            num_sources=1,
            num_destinations=1,
            timeout_s=180,
            worker_init={"draft": "separate"},
        )
        engine = ReshardTrainerEngine.trainer_init(info, client=llm, source=trainer["source"], draft=trainer["draft"])
        try:
            engine.send_weights()
            out["target_sent"] = engine.sender.last_stats.exec.bytes_sent
            out["target_stats"] = _worker_stats(llm)
            out["target_tokens"], out["target_acceptance"] = _greedy_accepting(llm)
            engine.send_draft_weights()
            out["draft_sent"] = engine.sender.last_stats.exec.bytes_sent
            out["draft_stats"] = _worker_stats(llm)
        finally:
            engine.shutdown()
        out["state"] = engine_state(llm)
        out["tokens"], out["acceptance"] = _greedy_accepting(llm)
        # (The checkpoint's tensors: the module's state dict names a tied weight twice.)
        out["draft_bytes"] = sum(t.nbytes for t in _checkpoint(m["d"][1]).values())
    finally:
        shutdown(llm)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, int], dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("drafters"))
    host = procs.Pool(1, daemon=False)
    out = {}
    try:
        for method, tp in CONFIGS:
            out[(method, tp)] = host.call(scenario, root, method, tp, timeout=600)[0]
        out[("native", 1)] = host.call(native_scenario, root, timeout=600)[0]
    finally:
        host.close()
    host = procs.Pool(1, daemon=False)
    try:
        out[("delta", 1)] = host.call(delta_scenario, root, *DELTA, timeout=600)[0]
    finally:
        host.close()
    return out


@pytest.fixture(params=CONFIGS, ids=[f"{m}-tp{tp}" for m, tp in CONFIGS])
def run(request, runs) -> dict[str, Any]:
    return runs[request.param]


def _differ(ours: list[dict[str, str]], ref: list[dict[str, str]]) -> list[str]:
    from reshard.adapters.core.state import compare_states

    assert len(ours) == len(ref)
    return [f"worker {i}: {p}" for i, (o, r) in enumerate(zip(ours, ref, strict=True)) for p in compare_states(o, r)]


def test_refit_of_target_and_drafter_equals_a_fresh_engine(run):
    assert any(k.startswith("drafter:") for k in run["fresh"][0]), "the state covers the drafter"
    assert not _differ(run["refit"], run["fresh"]), _differ(run["refit"], run["fresh"])[:10]
    assert run["tokens"] == run["fresh_tokens"]
    assert run["tokens"] != run["start_tokens"]


def test_each_worker_receives_exactly_what_it_and_its_drafter_keep(run):
    stats = run["stats"]
    for s in stats:
        assert s["drafter"] == "refit"
        assert 0 < s["drafter_kept_bytes"] < s["kept_bytes"]
        assert s["bytes_landed"] == s["kept_bytes"]
    if len(stats) > 1:
        # Sliced: no worker keeps (or receives) the whole drafter.
        whole = sum(s["drafter_kept_bytes"] for s in stats)
        assert all(s["drafter_kept_bytes"] < whole for s in stats)


def test_a_frozen_drafter_is_left_alone_and_the_state_check_sees_it(run):
    assert all(s["drafter"] == "frozen" and s["drafter_kept_bytes"] == 0 for s in run["frozen_stats"])
    differ = _differ(run["frozen"], run["fresh"])
    assert differ, "a stale drafter must fail the state check"
    assert all(": drafter:" in d for d in differ), [d for d in differ if ": drafter:" not in d][:5]
    # Speculative decoding is lossless: the tokens do not tell.
    assert run["frozen_tokens"] == run["fresh_tokens"]


def test_a_trainer_that_publishes_no_drafter_fails_the_plan_naming_its_tensors(run):
    assert run["refused"], "the refit without drafter tensors went through"
    named = [n for n in run["drafter_names"] if n in run["refused"]]
    assert named, run["refused"][:2000]


def test_acceptance_follows_the_drafter(runs):
    """A draft model equal to the policy: all accepted; after a policy-only
    refit much less; after the drafter's refit, all again."""
    run = runs[("draft_model", 1)]
    assert run["start_acceptance"] == run["fresh_acceptance"] == 1.0
    assert run["frozen_acceptance"] < 0.5
    assert run["acceptance"] == 1.0


def test_vllm_draft_session_through_the_reshard_backend_moves_the_drafter_alone(runs):
    """vLLM's ``start_draft_weight_update`` session through the ``reshard``
    backend: sliced (each worker receives what its drafter keeps, the
    trainer sends nothing of the policy), and the engine ends equal to a
    fresh one on policy and drafter."""
    run, fresh = runs[("native", 1)], runs[("draft_model", 1)]
    assert run["start_acceptance"] == 1.0
    # The target's session: the policy's bytes only, the drafter left for its own session.
    (target,) = run["target_stats"]
    assert target["drafter"] == "separate" and target["drafter_kept_bytes"] == 0
    assert run["target_sent"] == target["bytes_landed"] == target["kept_bytes"]
    assert run["target_acceptance"] < 0.5
    # The draft session: the drafter's bytes only.
    (draft,) = run["draft_stats"]
    assert draft["drafter"] == "refit"
    assert run["draft_sent"] == draft["bytes_landed"] == draft["kept_bytes"] == draft["drafter_kept_bytes"]
    assert draft["drafter_kept_bytes"] == run["draft_bytes"]
    assert run["acceptance"] == 1.0
    assert not _differ(run["state"], fresh["fresh"]), _differ(run["state"], fresh["fresh"])[:10]
    assert run["tokens"] == fresh["fresh_tokens"]


def test_a_two_phase_refit_stages_and_commits_target_and_drafter(run):
    """Two-phase refits (stage while serving, then commit): back to the old
    version and on to the new one, the drafter's bytes staged with the
    target's; the engine ends equal to a fresh engine, drafter included."""
    for s in run["two_phase_stats"]:
        assert s["two_phase"] and s["drafter"] == "refit"
        assert 0 < s["drafter_kept_bytes"] < s["kept_bytes"] == s["bytes_landed"]
        assert s["staging_bytes"] >= s["kept_bytes"]
    assert not _differ(run["two_phase"], run["fresh"]), _differ(run["two_phase"], run["fresh"])[:10]


def test_delta_refits_patch_target_and_drafter(runs):
    """Delta refits: the first dense (the base, drafter included), the next
    a delta; the engine ends equal to a fresh engine, drafter included."""
    run = {**runs[("delta", 1)], "fresh": runs[DELTA]["fresh"]}
    first, second = run["delta_stats"]
    for s in first + second:
        assert s["delta"] and s["drafter"] == "refit"
        assert 0 < s["drafter_kept_bytes"] < s["kept_bytes"]
    assert all(s["bytes_landed"] == s["kept_bytes"] for s in first)
    assert not _differ(run["delta"], run["fresh"]), _differ(run["delta"], run["fresh"])[:10]


def test_a_refit_that_fails_midway_leaves_target_and_drafter_recoverable(runs):
    """A trainer that fails in the middle of a refit of target and drafter:
    the refit fails (on the trainer and every worker), and the next one
    leaves the engine, drafter included, equal to a fresh engine."""
    run = runs[("draft_model", 1)]
    assert "round 2" in run["failed"], run["failed"][:2000]
    assert all(s["bytes_landed"] == s["kept_bytes"] for s in run["after_failure_stats"])
    assert not _differ(run["after_failure"], run["fresh"]), _differ(run["after_failure"], run["fresh"])[:10]
