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


def _toy_deployment(hosts: list[int], domains: list[int], trainers: int):
    from reshard.costmodel.cluster import Deployment

    n = len(hosts)
    return Deployment(
        gpu_of=tuple(range(n)),
        host_of=tuple(hosts),
        domain_of=tuple(domains),
        trainer_ranks=range(trainers),
        engine_ranks=range(trainers, n),
    )


def test_a_nic_shared_by_a_hosts_ranks_carries_all_their_bytes():
    from reshard.costmodel.cluster import Cluster
    from reshard.costmodel.cost import link_loads
    from reshard.plan.traffic import Traffic

    # One trainer rank on host 0 sends 100 bytes to each of 4 ranks on host 1,
    # each its own domain (every replica pulls for itself).
    traffic = Traffic(domain_of=lambda r: r)
    for d in range(1, 5):
        traffic.pairs[(0, d)] = 100
        traffic.transfers[(0, d)] = 1
    placement = _toy_deployment([0, 1, 1, 1, 1], [0, 1, 2, 3, 4], 1)
    loads = link_loads(traffic, placement)
    per_gpu = Cluster(name="a", gpus_per_host=4, hosts_per_domain=1, nic_gbit=8e-9, nvlink_gbyte=1)
    shared = Cluster(name="b", gpus_per_host=4, hosts_per_domain=1, nic_gbit=8e-9, nvlink_gbyte=1, nic_per_host=True)
    # 1 byte/s NICs: the sender's rail carries 400 bytes either way; the
    # receivers' 100 each on their own rails, 400 on their host's shared one.
    assert loads.seconds(per_gpu) == 400
    assert loads.nics(shared)[0] == {1: 400}
    assert loads.nics(per_gpu)[0] == {1: 100, 2: 100, 3: 100, 4: 100}


def test_gloo_broadcast_tree_levels_add_up_by_their_busiest_link():
    from reshard.costmodel.cluster import Cluster
    from reshard.costmodel.cost import tree_broadcast_seconds

    cl = Cluster(name="t", gpus_per_host=4, hosts_per_domain=1, nic_gbit=8e-9, nvlink_gbyte=1e9, nic_per_host=True)
    # Root on host 0, engines 1-4 on host 1, 5-8 on host 2 (the bench's
    # 2 x 4 replicas): levels 0->1 | 0->2, 1->3 | 0->4, 1->5, 2->6, 3->7 |
    # 0->8; the third sends 3 copies out of host 1 (ranks 1-3 to 5-7).
    hosts = [0, 1, 1, 1, 1, 2, 2, 2, 2]
    placement = _toy_deployment(hosts, hosts, 1)
    assert tree_broadcast_seconds(list(range(9)), 10, cl, placement) == 10 + 10 + 30 + 10
    ring = Cluster(name="r", gpus_per_host=4, hosts_per_domain=1, nic_gbit=8e-9, nvlink_gbyte=1e9)
    assert ring.broadcast == "ring"


def test_a_cluster_is_a_preset_a_description_or_a_preset_changed():
    from reshard.costmodel.cluster import PRESETS, Cluster

    assert Cluster.parse("dgx-h100") is PRESETS["dgx-h100"]
    c = Cluster.parse("gpus_per_host=4,nic_gbit=0.4,nvlink-gbyte=5,nic_per_host=1,broadcast=tree,refit_seconds=0.25")
    assert (c.gpus_per_host, c.hosts_per_domain, c.nic_gbit, c.nvlink_gbyte) == (4, 1, 0.4, 5.0)
    assert c.nic_per_host and c.broadcast == "tree" and c.refit_seconds == 0.25
    d = Cluster.parse("dgx-h100:nic_per_host=1")
    assert d.nic_per_host and d.nic_gbit == PRESETS["dgx-h100"].nic_gbit
    assert Cluster.parse("netns:gpus_per_host=1,nic_gbit=1,nvlink_gbyte=1").name == "netns"
    with pytest.raises(ValueError, match="needs nic_gbit, nvlink_gbyte"):
        Cluster.parse("gpus_per_host=4")
    with pytest.raises(ValueError, match="'speed=1' is not key=value for one of"):
        Cluster.parse("gpus_per_host=4,speed=1")
    with pytest.raises(ValueError, match="broadcast is ring or tree"):
        Cluster.parse("gpus_per_host=4,nic_gbit=1,nvlink_gbyte=1,broadcast=star")
    with pytest.raises(ValueError, match="unknown cluster 'dgx'"):
        Cluster.parse("dgx")
