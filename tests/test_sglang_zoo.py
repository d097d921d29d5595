"""The SGLang zoo: every tiny architecture SGLang 0.5.23 serves on CPU here,
refit into a real bfloat16 SGLang server (TP=1, its own venv) from 2 FSDP2
trainer ranks holding the model in bfloat16.

One architecture:

1. the server starts on checkpoint v2: its greedy tokens, its whole state
   (:func:`reshard.adapters.core.state.model_state`, read inside the worker
   by the reshard hook) and SGLang's own checksums are a fresh server's;
2. SGLang's own reload moves it to v1 (its tokens must differ);
3. a refit moves it back to v2: tokens, whole state and SGLang's checksums
   must equal the fresh server's, and the worker must land exactly what it
   keeps.

Architectures SGLang itself cannot serve on CPU here are in
:data:`UNSERVABLE` with SGLang's error; a test checks that SGLang still
fails on them with that error, so one that starts working shows up.
"""

from __future__ import annotations

from typing import Any

import pytest

from reshard.adapters.core.state import compare_states

from . import procs
from .support import group_config

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.sglang]

ZOO = [
    "gemma",
    "gemma3_text",
    "gpt2",
    "llama",
    "mixtral",
    "olmo2",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "starcoder2",
]
"""Architectures refit and compared (TP=1, bfloat16). Not Mistral: SGLang
serves it with its Llama class unchanged (``class
MistralForCausalLM(LlamaForCausalLM): pass``), the llama entry's loader."""

UNINFORMATIVE_TOKENS = {
    "gemma3_text": "SGLang's Gemma 3 takes its logits from the embedding (its checkpoint's lm_head is never loaded), "
    "and this tiny model then repeats the last prompt token whatever its other weights: its tokens cannot tell "
    "v1 from v2, its state can",
}
"""Architectures whose greedy tokens on SGLang do not depend on the weights
a refit changes: their tokens are still compared, their state decides."""

UNSERVABLE = {
    "qwen2_moe": "0 active drivers",
    "deepseek_v3": "assert rope_scaling is not None",
}
"""Architectures SGLang 0.5.23 cannot serve on CPU here, and the error it
gives: Qwen2-MoE's shared-expert gate is a Triton kernel and Triton has no
CPU driver here; SGLang's CPU rotary embedding for MLA needs a YaRN
``rope_scaling`` (and with one, MLA under the ``torch_native`` attention
backend fails on a batched matmul's shapes). DeepSeek-V2 fails the same
way in the same rotary embedding; one MLA model is started to check it."""


def _state(server, address: str) -> list[dict[str, str]]:
    from reshard.adapters.sglang import SglangEngine

    cfg = group_config(address, 2, server.tp)
    return SglangEngine(server.url, tp_size=server.tp).state(cfg)


def _scenario(server, trainers, v1, v2) -> dict[str, Any]:
    from .sglang_support import refit_with_trainers

    store = procs.StoreServer()
    out: dict[str, Any] = {"fresh": server.generate(), "fresh_state": _state(server, store.address)}
    out["fresh_cs"] = server.checksums()
    server.load_from_disk(v1)
    out["v1"] = server.generate()
    out["refit"] = refit_with_trainers(server, trainers, store.address, v2, refit=1, generation=0, dtype="bfloat16")
    out["after"] = server.generate()
    out["after_state"] = _state(server, store.address)
    out["after_cs"] = server.checksums()
    return out


@pytest.fixture(scope="module")
def zoo(sglang_python, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Every architecture's scenario; two servers alive at a time (the next
    one starts while the current one is refit)."""
    from reshard.testing.tiny import build_tiny_model

    from .sglang_support import Server, Trainers

    root = tmp_path_factory.mktemp("sglang-zoo")
    kinds = ZOO + sorted(UNSERVABLE)
    models = {
        k: tuple(
            build_tiny_model(root / k / v, k, seed=seed, torch_dtype="bfloat16") for v, seed in (("v1", 0), ("v2", 7))
        )
        for k in kinds
    }

    def start(i: int) -> Server:
        kind = kinds[i]
        return Server(
            sglang_python, models[kind][1], tp=1, port=procs.free_port(), log=root / f"{kind}.log", dtype="bfloat16"
        )

    trainers = Trainers(2)
    servers = {0: start(0), 1: start(1)}
    out: dict[str, dict[str, Any]] = {}
    try:
        for i, kind in enumerate(kinds):
            server = servers.pop(i)
            try:
                if kind in UNSERVABLE:
                    try:
                        server.wait_ready()  # it generates a token
                        server.generate()
                        out[kind] = {"served": True}
                    except Exception as e:
                        out[kind] = {"served": False, "why": f"{e}\n{server.log_tail()}"}
                else:
                    server.wait_ready()
                    out[kind] = _scenario(server, trainers, *models[kind])
            except Exception as e:
                out[kind] = {"error": f"{type(e).__name__}: {e}\n--- server log ---\n{server.log_tail()}"}
            finally:
                server.stop()
            if i + 2 < len(kinds):
                servers[i + 2] = start(i + 2)
    finally:
        for s in servers.values():
            s.stop()
        trainers.close()
    return out


@pytest.fixture(params=ZOO)
def run(request, zoo):
    r = zoo[request.param]
    assert "error" not in r, r["error"]
    assert r["refit"]["error"] is None, r["refit"]["error"]
    assert all(t["ok"] for t in r["refit"]["trainers"]), r["refit"]["trainers"]
    return r


def test_refit_gives_a_fresh_servers_tokens(run, request):
    kind = request.node.callspec.params["run"]
    if kind not in UNINFORMATIVE_TOKENS:
        assert run["v1"] != run["fresh"], "the two checkpoints must generate differently"
    assert run["after"] == run["fresh"]


def test_refit_leaves_the_whole_state_of_a_fresh_server(run):
    """Every tensor the forward pass may read (parameters, buffers, derived
    tensors such as Gemma's ``gemma_weight``, each linear layer's output on a
    fixed input) equals a fresh server's; and so does every parameter by
    SGLang's own checksum."""
    for ours, fresh in zip(run["after_state"], run["fresh_state"], strict=True):
        differ = compare_states(ours, fresh)
        assert not differ, f"{len(differ)} tensors differ from a fresh server's, first {differ[:5]}"
    assert run["after_cs"] == run["fresh_cs"]


def test_each_worker_lands_what_it_keeps(run):
    (reply,) = run["refit"]["replies"]
    stats = reply["stats"]
    assert stats["bytes_landed"] == stats["kept_bytes"] > 0
    # Trainers and server hold bfloat16: nothing is cast, every byte received is kept.
    assert stats["bytes_received"] == stats["kept_bytes"] == sum(t["sent"] for t in run["refit"]["trainers"])


@pytest.mark.parametrize("kind", sorted(UNSERVABLE))
def test_sglang_still_cannot_serve_these_on_cpu(zoo, kind):
    r = zoo[kind]
    assert "error" not in r, r["error"]
    assert not r["served"], f"SGLang now serves {kind} on CPU: move it into ZOO"
    assert UNSERVABLE[kind] in r["why"], r["why"]
