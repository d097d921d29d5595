"""Two-phase refits into a real bf16 vLLM engine (TP=2, Qwen2-MoE: fused
projections, expert stacks that the CPU backend repacks, a shared expert and
its [1, H] gate), from 2 FSDP2 trainer ranks.

Workers receive into staging buffers (``stage_workers``), then apply them
(``commit_workers``). The parameters that land must be exactly those of an
in-place refit and of vLLM's own reload of the same checkpoint, captured as
each layer is processed (see ``tests/zoo_support.py``). Server behaviour
(serving while staging, failures while staging) is tested in
``tests/test_vllm_server.py``.
"""

from __future__ import annotations

import os

import pytest

from reshard.testing.tiny import build_tiny_model

from .zoo_support import Zoo, engine_greedy, engine_reload, engine_start, engine_stop

pytestmark = [pytest.mark.engine, pytest.mark.slow]

KIND, TP = "qwen2_moe", 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("two_phase"))
    v1 = str(build_tiny_model(os.path.join(root, "v1"), KIND, seed=0, torch_dtype="bfloat16"))
    v2 = str(build_tiny_model(os.path.join(root, "v2"), KIND, seed=7, torch_dtype="bfloat16"))
    zoo = Zoo({KIND: (v1, v2)})
    out: dict = {}
    try:
        out["fresh_v2"] = zoo.host.call(engine_start, v2, TP, timeout=600)[0]
        out["staged1"] = zoo._refit(v1, TP, 1, capture=False, two_phase=True)
        out["after1"] = zoo.host.call(engine_greedy)[0]
        out["staged2"] = zoo._refit(v2, TP, 2, capture=True, two_phase=True)
        out["after2"] = zoo.host.call(engine_greedy)[0]
        out["inplace3"] = zoo._refit(v1, TP, 3, capture=False)
        out["inplace4"] = zoo._refit(v2, TP, 4, capture=True)
        out["reference"] = zoo.host.call(engine_reload, v2)[0]
    finally:
        try:
            zoo.host.call(engine_stop, timeout=120)
        finally:
            zoo.close()
    for key in ("staged1", "staged2", "inplace3", "inplace4"):
        assert out[key]["error"] is None, out[key]["error"]
        assert all("error" not in t for t in out[key]["trainers"]), out[key]["trainers"]
    return out


def test_two_phase_refit_gives_a_fresh_engines_tokens(runs):
    assert runs["after1"] != runs["fresh_v2"], "v1 and v2 must generate differently"
    assert runs["after2"] == runs["fresh_v2"]


def test_two_phase_lands_the_parameters_of_an_in_place_refit_and_of_vllms_reload(runs):
    staged, inplace, ref = runs["staged2"]["digests"], runs["inplace4"]["digests"], runs["reference"]
    assert len(staged) == len(inplace) == len(ref) == TP
    for w_staged, w_inplace, w_ref in zip(staged, inplace, ref, strict=True):
        assert w_staged == w_inplace
        assert w_ref.keys() <= w_staged.keys()
        differ = sorted(k for k in w_ref if w_staged[k] != w_ref[k])
        assert not differ, differ


def test_two_phase_stats_say_what_was_staged(runs):
    for key in ("staged1", "staged2"):
        r = runs[key]
        for stats, init in zip(r["stats"], r["init"], strict=True):
            assert stats["two_phase"] and stats["atomic"]
            assert stats["bytes_received"] == stats["kept_bytes"] == init["kept_bytes"]
            # One staging buffer per parameter: what the worker keeps, plus the
            # zeroed vocabulary padding of the embedding and the LM head.
            assert stats["staging_bytes"] >= stats["kept_bytes"]
        assert sum(t["sent"] for t in r["trainers"]) == sum(s["bytes_received"] for s in r["stats"])
