"""Every tiny architecture of the zoo, refit into a real bf16 vLLM engine at
TP=2 (and some at TP=1) from 2 FSDP2 trainer ranks (see
``tests/zoo_support.py``); two configurations also take a two-phase refit.

The zoo runs once per session (about 8 minutes on a 2-core machine); each
test below reads its configuration's results.
"""

from __future__ import annotations

import pytest

from reshard.adapters.core.state import compare_states
from reshard.testing.tiny import NONDETERMINISTIC

from .zoo_support import CONFIGS, SHARED_MEMORY, TWO_PHASE, ZOO, assert_matches_reload, completed, run_configs

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="session")
def zoo(tmp_path_factory):
    return run_configs(str(tmp_path_factory.mktemp("zoo")), CONFIGS)


@pytest.fixture(params=CONFIGS, ids=[f"{k}-tp{t}" for k, t in CONFIGS])
def run(request, zoo):
    return completed(zoo[request.param])


def test_refit_gives_a_fresh_engines_tokens(run):
    assert run["before"] != run["fresh_v2"], "v1 and v2 must generate differently"
    if (run["kind"], run["tp"]) in NONDETERMINISTIC:
        # Two fresh engines of this architecture disagree with each other on
        # this CPU (MLA at TP=2): the parameters are compared with vLLM's own
        # reload instead (test_every_parameter_equals_vllms_own_reload).
        pytest.skip("a fresh engine is not deterministic here; parameters are checked instead")
    assert run["after"] == run["fresh_v2"]


def test_refit_leaves_the_whole_state_of_a_fresh_engine(run):
    """Every tensor the engine's forward pass may read (parameters, buffers,
    repacked kernel weights, absorbed MLA matrices, each linear layer's
    output on a fixed input) equals a fresh engine's on the same weights."""
    assert len(run["after_state"]) == len(run["fresh_state"]) == run["tp"]
    for rank, (ours, fresh) in enumerate(zip(run["after_state"], run["fresh_state"], strict=True)):
        differ = compare_states(ours, fresh)
        assert not differ, f"worker {rank}: {len(differ)} tensors differ from a fresh engine's, first {differ[:5]}"


def test_every_parameter_equals_vllms_own_reload(run):
    assert_matches_reload(run)


def test_each_worker_receives_what_it_keeps_and_trainers_send_it(run):
    r = run["refit"]
    # Colocated configurations move every byte through shared memory; with
    # the trainers' shards exported, every byte is read straight from them.
    mode = SHARED_MEMORY.get((run["kind"], run["tp"]), "")
    link = "shm" if mode else "gloo"
    for stats, init in zip(r["stats"], r["init"], strict=True):
        assert stats["bytes_landed"] == stats["kept_bytes"] == init["kept_bytes"]
        assert stats["recv_by_link"] == {link: stats["bytes_received"]}
        assert stats["direct_bytes"] == (stats["bytes_received"] if mode == "export" else 0)
        _received_is_kept_unless_cast(stats)
    assert sum(t["sent"] for t in r["trainers"]) == sum(s["bytes_received"] for s in r["stats"])
    assert all(t["links"] == ({link: t["sent"]} if t["sent"] else {}) for t in r["trainers"])
    assert all(t["direct"] == (t["sent"] if mode == "export" else 0) for t in r["trainers"])


def _received_is_kept_unless_cast(stats: dict) -> None:
    """The trainers hold every tensor in bfloat16 as the checkpoint does;
    the only casts are into tensors vLLM keeps in float32 on this machine
    (on CPUs with AMX, a small linear layer's bias is converted to float32
    when it is packed): each such byte lands as two."""
    assert set(stats["casts"]) <= {"bfloat16->float32"}, stats["casts"]
    cast = stats["casts"].get("bfloat16->float32", 0)
    assert stats["bytes_received"] + cast == stats["bytes_landed"]


def test_plan_rules_agree_with_the_layout_learned_from_vllm(run):
    """``reshard plan``'s vLLM sharding rules (used only to cost clusters that
    do not exist yet) describe exactly the pieces each worker learned from
    vLLM's own loaders, for the architectures the rules cover."""
    if run["kind"] not in RULES_COVER:
        pytest.skip(f"reshard plan's rules do not cover {run['kind']} (engines learn their layouts at run time)")
    from reshard.costmodel.rules import EngineSpec, engine_layouts
    from reshard.models import canonical_tensors
    from reshard.testing.tiny import tiny_config

    from .oracle import layout_set_slots

    def norm(tensor, offs, sizes, local, local_shape, offset, dims):
        return (
            tensor,
            tuple(offs),
            tuple(sizes),
            local,
            tuple(local_shape),
            tuple(offset) or (0,) * len(local_shape),
            tuple(dims) or tuple(range(len(offs))),
        )

    cfg = tiny_config(run["kind"], torch_dtype="bfloat16")
    rules = engine_layouts(tuple(canonical_tensors(cfg)), cfg, EngineSpec.parse(f"tp={run['tp']}"))
    by_rank = layout_set_slots(rules.layout_set("dst"))
    assert sorted(by_rank) == list(range(run["tp"]))
    for rank, learned in enumerate(run["learned"]):
        ours = {norm(t, s.box.offsets, s.box.sizes, s.local, s.local_shape, s.offset, s.dims) for t, s in by_rank[rank]}
        theirs = {norm(*p) for p in learned}
        assert ours == theirs, (
            f"worker {rank}: only in the rules {sorted(ours - theirs)[:5]}, only learned {sorted(theirs - ours)[:5]}"
        )


RULES_COVER = set(ZOO) - {"deepseek_v2", "gpt2", "phi3", "starcoder2"}
"""The rules know the module names of Llama-, Qwen-, Mixtral-, Gemma-, OLMo-
and DeepSeek-V3-style checkpoints. Not: checkpoints that fuse tensors
themselves (Phi-3's qkv_proj, GPT-2's transposed Conv1D c_attn), other MLP
names (Starcoder2's c_fc / c_proj) and MLA without q-LoRA."""


@pytest.fixture(params=sorted(TWO_PHASE), ids=[f"{k}-tp{t}" for k, t in sorted(TWO_PHASE)])
def staged(request, zoo):
    r = zoo[request.param]
    assert "error" not in r, r["error"]
    assert r["staged"]["error"] is None, r["staged"]["error"]
    assert all("error" not in t for t in r["staged"]["trainers"]), r["staged"]["trainers"]
    return r


def test_two_phase_refit_gives_a_fresh_engines_tokens_and_state(staged):
    assert staged["after_staged"] == staged["fresh_v2"]
    for ours, fresh in zip(staged["staged_state"], staged["fresh_state"], strict=True):
        assert not compare_states(ours, fresh)


def test_two_phase_lands_the_parameters_of_an_in_place_refit_and_of_vllms_reload(staged):
    ours, inplace, ref = staged["staged"]["digests"], staged["refit"]["digests"], staged["reference"]
    assert len(ours) == len(inplace) == len(ref) == staged["tp"]
    for w_ours, w_inplace, w_ref in zip(ours, inplace, ref, strict=True):
        assert w_ours == w_inplace
        assert w_ref.keys() <= w_ours.keys()
        assert not sorted(k for k in w_ref if w_ours[k] != w_ref[k])


def test_two_phase_stats_say_what_was_staged(staged):
    r = staged["staged"]
    for stats, init in zip(r["stats"], r["init"], strict=True):
        assert stats["two_phase"] and stats["atomic"]
        assert stats["bytes_landed"] == stats["kept_bytes"] == init["kept_bytes"]
        _received_is_kept_unless_cast(stats)
        # One staging buffer per parameter: what the worker keeps, plus the
        # zeroed padding no piece writes (vocabulary padding).
        assert stats["staging_bytes"] >= stats["kept_bytes"]
    assert sum(t["sent"] for t in r["trainers"]) == sum(s["bytes_received"] for s in r["stats"])


def test_layers_that_serve_their_checkpoint_tensors_take_the_bytes_in_place(run):
    """A layer whose live tensors are its checkpoint-loading tensors and
    whose processing leaves them as they are (every plain RMSNorm, such as
    the final norm of these architectures) takes its bytes in place, outside
    vLLM's lifecycle (``reshard.adapters.vllm.direct``); the state checks
    above hold with it. On CPU the other layers are materialized in buffers
    kept across refits, which the engine keeps none of after processing."""
    if run["kind"] not in ("qwen2", "llama", "qwen3", "mistral"):
        pytest.skip("the rule is checked where a plain layer is known to exist")
    for stats in run["refit"]["stats"]:
        assert stats["layers_direct"] >= 1, stats
        assert stats["buffers_kept_by_engine"] == 0, stats
