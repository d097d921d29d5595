"""Refits repeated while other CPU-heavy processes run beside the engine.

A DeepSeek-V3 configuration (MLA with q-LoRA, sigmoid routing with a float32
``e_score_correction_bias``, a shared expert) was once reported to serve
wrong tokens after a TP=1 refit on a heavily loaded machine only. Here a
TP=1 bfloat16 engine on vLLM's reference CPU MLA backend is refit back and
forth between two checkpoints, eight times, from 2 FSDP2 trainer ranks,
while another vLLM engine generates without pause and two processes
exchange gloo all-reduces: after every refit the engine's whole state
(:func:`reshard.adapters.core.state.model_state`) and greedy tokens must be
a fresh engine's on the same weights. Nothing here depends on timings:
the load only changes how the processes interleave.
"""

from __future__ import annotations

import os

import pytest

from reshard.adapters.core.state import compare_states

from . import procs

pytestmark = [pytest.mark.engine, pytest.mark.slow]

KIND = "deepseek_v3_g1"
REFITS = 8


def _generate_forever(rank: int, path: str) -> None:
    """A hog: an offline vLLM engine generating until the process is killed."""
    from reshard.testing.engines import greedy, offline_llm

    llm = offline_llm(path, 1, dtype="bfloat16")
    while True:
        greedy(llm, max_tokens=64)


def _all_reduce_forever(rank: int, port: int) -> None:
    """A hog: two gloo ranks all-reducing 16 MB until killed."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.ones(4 << 20)
    while True:
        dist.all_reduce(x)
        x.div_(2)


@pytest.fixture(scope="module")
def refits(tmp_path_factory):
    from reshard.testing.tiny import build_tiny_model

    from .zoo_support import ENGINE_ARGS, Zoo, engine_greedy, engine_start

    root = tmp_path_factory.mktemp("load")
    a = str(build_tiny_model(root / "a", KIND, seed=0, torch_dtype="bfloat16"))
    b = str(build_tiny_model(root / "b", KIND, seed=7, torch_dtype="bfloat16"))
    hog_model = str(build_tiny_model(root / "hog", "qwen2", seed=3, torch_dtype="bfloat16"))
    args = ENGINE_ARGS[KIND]
    zoo = Zoo({KIND: (a, b)})
    hogs = []
    out: dict = {"refits": []}
    try:
        fresh = {"b": zoo.host.call(engine_start, b, 1, args, timeout=600)[0]}
        fresh["a"] = zoo.host.call(engine_start, a, 1, args, timeout=600)[0]
        out["fresh"] = fresh
        port = procs.free_port()
        hogs = [procs.spawn(_generate_forever, 0, hog_model, daemon=False)]
        hogs += [procs.spawn(_all_reduce_forever, r, port) for r in range(2)]
        for i in range(REFITS):
            target = "b" if i % 2 == 0 else "a"
            r = zoo._refit(b if target == "b" else a, 1, i + 1, capture=False)
            r.update(target=target, **zoo.host.call(engine_greedy)[0])
            r["hogs_alive"] = all(h.process.is_alive() for h in hogs)
            out["refits"].append(r)
    finally:
        for h in hogs:
            h.process.kill()
            h.process.join(timeout=30)
        zoo.close()
    return out


@pytest.mark.parametrize("i", range(REFITS))
def test_every_refit_under_load_leaves_a_fresh_engines_state_and_tokens(refits, i):
    r = refits["refits"][i]
    assert r["error"] is None, r["error"]
    assert r["hogs_alive"], "the load must run during every refit"
    fresh = refits["fresh"][r["target"]]
    assert fresh["tokens"] != refits["fresh"]["a" if r["target"] == "b" else "b"]["tokens"]
    (ours,), (theirs,) = r["state"], fresh["state"]
    differ = compare_states(ours, theirs)
    assert not differ, f"refit {i + 1} to {r['target']}: {len(differ)} tensors differ, first {differ[:5]}"
    assert r["tokens"] == fresh["tokens"]
    (stats,) = r["stats"]
    assert stats["bytes_landed"] == stats["kept_bytes"]
