"""`reshard plan`: the CLI contract and the acceptance numbers of the cost model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from reshard.costmodel.report import plan_report

KEYS = {"network_bytes", "nvlink_bytes", "max_rank_recv_bytes", "max_rank_send_bytes", "estimated_seconds"}


@pytest.fixture(scope="module")
def dgx():
    return plan_report(model="llama3-70b", trainer="fsdp=64", engine="tp=8,dp=8", cluster="dgx-h100").data


def test_json_contract_from_the_command_line():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "reshard.tools.cli",
            "plan",
            "--model",
            "llama3-8b",
            "--trainer",
            "fsdp=8",
            "--engine",
            "tp=2,dp=2",
            "--cluster",
            "dgx-h100",
            "--json",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    d = json.loads(out)
    assert set(d["model"]) >= {"name", "params", "bytes"}
    assert d["trainer_ranks"] == 8 and d["engine_ranks"] == 4
    assert set(d["reshard"]) >= KEYS and set(d["gather_broadcast"]) >= KEYS
    assert set(d["lower_bound"]) >= {"network_bytes", "seconds"}
    assert d["speedup"] > 1
    # Planning was timed on sampled ranks (the time itself is the machine's, not asserted).
    assert d["plan_sample_ranks"] and isinstance(d["plan_seconds"], float)
    assert isinstance(d["plan_cpu_seconds"], float)


def test_llama70b_fsdp64_to_tp8_dp8_on_dgx_h100(dgx):
    model_bytes = dgx["model"]["bytes"]
    assert dgx["reshard"]["network_bytes"] == pytest.approx(8 * model_bytes, rel=0.005)
    assert dgx["reshard"]["network_bytes"] == dgx["lower_bound"]["network_bytes"]
    assert dgx["reshard"]["estimated_seconds"] <= 1.3 * dgx["lower_bound"]["seconds"]
    assert dgx["speedup"] >= 4
    # Every engine rank receives what it keeps: an eighth of the model (plus replicated norms).
    assert dgx["reshard"]["max_rank_recv_bytes"] == pytest.approx(model_bytes / 8, rel=0.01)
    assert dgx["gather_broadcast"]["max_rank_recv_bytes"] == model_bytes


def test_llama70b_fsdp72_to_tp8_dp9_on_gb200_nvl72():
    d = plan_report(model="llama3-70b", trainer="fsdp=72", engine="tp=8,dp=9", cluster="gb200-nvl72").data
    # One copy crosses into the engine rack; the other eight move over NVLink.
    assert d["reshard"]["network_bytes"] == pytest.approx(d["model"]["bytes"], rel=0.01)
    assert d["reshard"]["nvlink_bytes"] == pytest.approx(8 * d["model"]["bytes"], rel=0.01)


def test_colocated_trainer_and_engine_share_gpus():
    d = plan_report(model="llama3-8b", trainer="fsdp=8", engine="tp=8", cluster="dgx-h100", colocate=True).data
    # fsdp=8 and tp=8 cut the same rows of column-parallel tensors: those stay on their GPU.
    assert d["reshard"]["network_bytes"] == 0
    assert d["reshard"]["local_bytes"] > 0


def test_bad_specs_are_clear_errors():
    with pytest.raises(ValueError, match="unknown degree 'xp'"):
        plan_report(model="llama3-8b", trainer="xp=2", engine="tp=2", cluster="dgx-h100")
    with pytest.raises(ValueError, match="not a multiple of ep\\*etp"):
        plan_report(model="qwen3-30b-a3b", trainer="tp=2,dp=1,ep=4", engine="tp=2", cluster="dgx-h100")
    with pytest.raises(ValueError, match="unknown cluster"):
        plan_report(model="llama3-8b", trainer="fsdp=2", engine="tp=2", cluster="dgx-a100")
