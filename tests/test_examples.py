"""Every example in ``examples/`` runs on this CPU machine at its small
default size and ends with an ``OK`` line (each checks its own outcome:
bytes landed bit for bit, or an engine now generates from the new weights)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .procs import RAY_TEST_ENV
from .sglang_support import sglang_python

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))
ENGINES = {"vllm_offline_rlhf.py", "vllm_server.py", "vllm_weight_transfer_http.py", "megatron_to_vllm.py"}
ENGINES |= {"ray_job.py", "sglang_server.py", "deepspeed_to_vllm.py", "trl_grpo.py"}


def test_every_example_is_listed():
    assert set(SCRIPTS) == {"explicit_layouts.py", "plan_from_python.py"} | ENGINES


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script, tmp_path):
    if script in ENGINES:
        pytest.importorskip("vllm")
    if script == "trl_grpo.py":
        pytest.importorskip("trl")
    if script == "deepspeed_to_vllm.py":
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/trainers_setup.sh)")
    args = []
    if script == "sglang_server.py":
        py = sglang_python()
        if py is None:
            pytest.skip("no SGLang venv (make sglang-setup)")
        args = ["--sglang-python", str(py)]
    # Ray's workers (ray_job.py) at the test's priority, not Ray's nice 15,
    # and not killed by Ray's memory monitor for what other jobs use.
    env = dict(os.environ, EXAMPLES_WORKDIR=str(tmp_path), PYTHONUNBUFFERED="1", **RAY_TEST_ENV)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    out = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert out and out[-1].startswith("OK"), proc.stdout[-3000:]
