"""``--weight-transfer-config '{"backend": "reshard"}'``: vLLM's own weight-transfer
API, registered through the ``vllm.general_plugins`` entry point, no user code
in the engine; the trainer side comes from ``WeightTransferTrainerFactory``."""

from __future__ import annotations

import pytest

from reshard.testing.tiny import build_tiny_model

from . import procs
from .vllm_support import backend_scenario

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("backend")
    v1 = build_tiny_model(root / "v1", "qwen2", seed=0)
    v2 = build_tiny_model(root / "v2", "qwen2", seed=7)
    return procs.check(
        # TP=1 (the engine in the test process's child): the native backend at
        # TP=2 is driven by vLLM's HTTP client in tests/test_vllm_clients.py.
        procs.run(backend_scenario, 1, 1, str(v1), str(v2), procs.free_port(), timeout=900, daemon=False)
    )[0]


def test_native_backend_refit_gives_a_fresh_engines_tokens(run):
    assert run["before"] != run["fresh_v2"]
    assert run["after"] == run["fresh_v2"]


def test_native_backend_mismatch_raises_and_engine_keeps_serving(run):
    assert run["mismatch_error"] is not None
    assert "model.norm.weight" in run["mismatch_error"] and "'plan'" in run["mismatch_error"]
    assert run["after_mismatch"] == run["fresh_v2"]


def test_native_backend_refits_again_after_a_failure(run):
    assert run["back"] == run["before"]
