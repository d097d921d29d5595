"""``make demo`` runs ``reshard demo``: a short run of it must succeed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_demo_hot_swaps_and_matches_a_fresh_engine(tmp_path):
    out = tmp_path / "demo.json"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "reshard.tools.cli",
            "demo",
            "--steps",
            "1",
            "--workdir",
            str(tmp_path),
            "--json",
            str(out),
        ],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK: " in proc.stdout
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["tokens"] == row["fresh"] != result["before"]
    # Each of the two engine workers keeps about half of the model with reshard;
    # gather-and-broadcast hands every worker every tensor.
    rs, gb = row["reshard"]["worker_bytes"], row["gather_broadcast"]["worker_bytes"]
    assert len(rs) == len(gb) == 2
    assert all(g > 1.8 * r for g, r in zip(gb, rs, strict=True))
