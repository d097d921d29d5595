"""Every exported name imports, and the core never imports an engine."""

from __future__ import annotations

import subprocess
import sys

import reshard
import reshard.plan


def test_every_exported_name_exists():
    for mod in (reshard, reshard.plan):
        for name in mod.__all__:
            assert getattr(mod, name) is not None, f"{mod.__name__}.{name}"


def test_core_imports_no_engine_and_no_torch_distributed():
    code = (
        "import sys, reshard, reshard.plan.planner, reshard.costmodel.rules, reshard.costmodel.cost;"
        "bad = [m for m in ('vllm', 'sglang', 'megatron', 'torch') if m in sys.modules];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert out == "", f"core imported {out}"
