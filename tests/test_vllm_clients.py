"""vLLM's own weight-sync clients drive the ``reshard`` backend of a real
``api_server`` (``--weight-transfer-config '{"backend": "reshard"}'``).

The trainer processes never start an engine and never load vLLM's plugins:
they call ``WeightTransferTrainerFactory.trainer_init(ReshardTrainerInitInfo(...),
client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))`` and
``send_weights()``, as vLLM's RL examples do with its built-in backends. One
bf16 server at TP=2 (the native backend at TP=1 is tests/test_vllm_backend.py),
started on checkpoint v2, so its first tokens are a fresh server's on v2.
"""

from __future__ import annotations

import pytest

from reshard.testing.tiny import build_tiny_model

from . import procs
from .vllm_support import VllmServer, weight_sync_trainer

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _phases(url: str, tp: int) -> list[tuple[str, int, str, int, str]]:
    """Each failure phase, then the call after it: ``(call, status, text,
    expected status, expected text)``. A stale reply (another call's answer)
    shows up as the wrong status or text."""
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    c = HTTPVLLMWeightSyncClient(url, timeout=120)
    good = {"address": "127.0.0.1:1", "num_sources": 1, "num_destinations": tp, "timeout_s": 10}
    script = [
        ("parse init", c.init_weight_transfer_engine, ({"bogus": 1},), 500, "Invalid init_info"),
        ("init", c.init_weight_transfer_engine, (good,), 200, ""),
        ("bad init", c.init_weight_transfer_engine, ({**good, "address": "nohost"},), 500, "is not host:port"),
        ("start without init", c.start_weight_update, (), 500, "init_weight_transfer_engine must succeed"),
        ("init", c.init_weight_transfer_engine, (good,), 200, ""),
        ("start", c.start_weight_update, (), 200, ""),
        ("start twice", c.start_weight_update, (), 500, "already active"),
        ("start", c.start_weight_update, (), 200, ""),
        ("parse update", c.update_weights, ({"refit": 1, "bogus": 2},), 500, "Invalid update_info"),
        ("finish after a failed update", c.finish_weight_update, (), 500, "without a matching start"),
        ("start", c.start_weight_update, (), 200, ""),
        ("receive", c.update_weights, ({"refit": 1, "method": "bogus"},), 500, "unknown refit method"),
        ("start", c.start_weight_update, (), 200, ""),
        ("finish", c.finish_weight_update, (), 200, ""),
        ("finish twice", c.finish_weight_update, (), 500, "without a matching start"),
        ("start", c.start_weight_update, (), 200, ""),
        ("finish", c.finish_weight_update, (), 200, ""),
    ]
    out = []
    for name, fn, args, want, needle in script:
        try:
            fn(*args)
            got, text = 200, ""
        except requests.HTTPError as e:
            got, text = e.response.status_code, e.response.text
        out.append((name, got, text, want, needle))
    return out


TP = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tp = TP
    root = tmp_path_factory.mktemp(f"clients-tp{tp}")
    v1 = str(build_tiny_model(root / "v1", "qwen2", seed=0))
    v2 = str(build_tiny_model(root / "v2", "qwen2", seed=7))
    server = VllmServer(
        v2, tp=tp, log=str(root / "server.log"), args=["--weight-transfer-config", '{"backend": "reshard"}']
    )
    try:
        out = {"tp": tp, "fresh_v2": server.greedy(), "phases": _phases(server.url, tp)}
        # In place: v1, v2, a bad update, v1; two-phase: v2, a bad update.
        steps = [(v1, "", False), (v2, "", False), (v1, "shape", False), (v1, "", False)]
        steps += [(v2, "", True), (v1, "shape", True)]
        store_port, pg_port = procs.free_port(), procs.free_port()
        out["trainers"] = procs.check(
            procs.run(weight_sync_trainer, 2, server.url, store_port, pg_port, 2, tp, steps, timeout=600)
        )
        return out
    finally:
        server.close()


def test_trainer_processes_never_load_vllm_plugins(run):
    assert not any(t["plugins_loaded"] for t in run["trainers"])


def test_http_client_refit_gives_a_fresh_servers_tokens(run):
    steps = run["trainers"][0]["steps"]
    for t in run["trainers"]:
        assert [s["error"] for s in t["steps"]][:2] == [None, None], t["steps"]
    assert steps[0]["tokens"] != run["fresh_v2"], "the two checkpoints must generate differently"
    assert steps[1]["tokens"] == run["fresh_v2"]


def test_a_bad_update_is_a_clear_error_and_keeps_the_old_weights(run):
    for t in run["trainers"]:
        error = t["steps"][2]["error"]
        assert error is not None
        assert "model.norm.weight" in error and "'plan'" in error, error
        # Refused on every rank's verdict at the plan step; none waited out the timeout.
        assert "did not report" not in error, error
    assert run["trainers"][0]["steps"][2]["tokens"] == run["fresh_v2"]


def test_the_next_good_update_works(run):
    steps = run["trainers"][0]["steps"]
    assert steps[3]["error"] is None
    assert steps[3]["tokens"] == steps[0]["tokens"]


def test_a_two_phase_refit_gives_a_fresh_servers_tokens_and_a_bad_one_keeps_them(run):
    """``two_phase=True``: staged while the server serves, committed paused;
    a staging failure (refused at the plan) surfaces at the commit, and the
    server keeps serving its weights."""
    steps = run["trainers"][0]["steps"]
    assert steps[4]["error"] is None, steps[4]
    assert steps[4]["tokens"] == run["fresh_v2"]
    for t in run["trainers"]:
        assert "model.norm.weight" in (t["steps"][5]["error"] or ""), t["steps"][5]
    assert steps[5]["tokens"] == run["fresh_v2"]


def test_after_each_failed_phase_the_next_reply_is_its_own(run):
    bad = [(n, got, text[:300], want, needle) for n, got, text, want, needle in run["phases"] if got != want]
    assert not bad, bad
    for name, _got, text, _want, needle in run["phases"]:
        assert needle in text, (name, text[:500])
