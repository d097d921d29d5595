"""`reshard bench` runs end to end and checks every byte (timings are not asserted)."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

from reshard.tools.bench import CASES, format_result, run_bench


def test_bench_smoke_both_methods_correct():
    case = replace(CASES["replicas"], layers=1, vocab=4096, hidden=256, heads=4, kv_heads=2, intermediate=512)
    res = run_bench(case, reps=1, warmup=0, timeout=300)
    for method in ("reshard", "gather_broadcast"):
        assert res["method"][method]["correct"], method
    # reshard moves exactly what the workers keep (two models, plus the norms
    # every TP rank keeps a copy of); the baseline broadcasts the whole model
    # to each of the four workers.
    kept = res["bytes_kept_total"]
    assert 2 * res["model_bytes"] < kept < 2.01 * res["model_bytes"]
    assert res["method"]["reshard"]["bytes_received_total"] == kept
    assert res["method"]["gather_broadcast"]["bytes_received_total"] == 4 * res["model_bytes"]
    assert res["raw_p2p_bytes"] == kept
    assert "speedup over gather-and-broadcast" in format_result(res)


def _engine_rows(methods: tuple[str, ...], reps: int) -> list[dict]:
    """Rows as an engine bench records them: every method once per rep, the
    first rep a warm-up; refit ``k`` of a method takes ``k`` seconds."""
    rows = []
    for rep in range(reps + 1):
        for m in methods:
            secs = float(rep + 1) if m != "raw_p2p" else 0.5
            workers = [{"bytes_received": 100, "plan_seconds": 0.01, "seconds": secs / 2, "apply_seconds": 0.1}]
            row = {"step": len(rows), "rep": rep, "method": m, "warmup": rep == 0, "seconds": secs}
            row.update(paused_seconds=secs / 4 if m == "two_phase" else secs, flush_seconds=0.0, workers=workers)
            if m == "gather_save_reload":
                # The driver waits for rank 0's file, then reloads it.
                row.update(saved_seconds=secs / 2, trainers=[{"gather_seconds": secs / 4, "save_seconds": secs / 4}])
            rows.append(row)
    return rows


def test_engine_bench_summaries_for_both_engines():
    """The summary reads every method's medians from the timed refits only and
    prints the ratios an engine has (SGLang: no two-phase)."""
    from reshard.tools import engine_bench, sglang_bench

    for methods in (engine_bench.METHODS, sglang_bench.METHODS):
        tokens = {m: [[1, 2]] for m in methods if m != "raw_p2p"}
        res = engine_bench.summarize(
            _engine_rows(methods, 3), tokens, [100], 200, 1.0, 1, 2, "float32", 3, 1, names=methods, engine="x"
        )
        assert set(res["method"]) == set(methods)
        assert res["method"]["reshard"]["seconds_median"] == 3.0  # reps 1..3 take 2, 3, 4 s
        assert res["ratios"]["reshard_vs_raw_throughput"] == 0.5 / 3.0
        assert all(res["tokens_match_reload"].values())
        text = engine_bench.format_result(res)
        assert "the whole refit at 0.17x" in text
        if "gather_save_reload" in methods:
            assert res["method"]["gather_save_reload"]["steps"] == {"gather": 0.75, "save": 0.75, "reload": 1.5}
        assert ("two-phase pauses generation for 25% of its refit" in text) == ("two_phase" in methods)


def test_plan_colocate_counts_on_the_same_gpu_link_what_the_executor_moves_through_shared_memory():
    """``reshard plan --colocate`` and the executor agree on where bytes go:
    trainer rank i and engine rank i share GPU i (one GPU per host, so each
    pair is its own domain); on CPU, processes labelled alike per GPU share
    memory and the rest take gloo. The plan's same-GPU bytes are exactly
    what the engine ranks receive over shared memory (through channels, and
    read straight from exported tensors), its NVLink and network bytes
    exactly what they receive over gloo."""
    from reshard.costmodel.cluster import Cluster, place
    from reshard.costmodel.cost import reshard_cost
    from reshard.costmodel.rules import EngineSpec, TrainerSpec, engine_layouts, trainer_layouts
    from reshard.plan.planner import Planner
    from reshard.tools.bench import bench_tensors

    cluster = Cluster(name="one-gpu-hosts", gpus_per_host=1, hosts_per_domain=1, nic_gbit=100, nvlink_gbyte=100)
    placement = place(cluster, 2, 2, colocate=True)
    case = replace(
        CASES["colocated"],
        layers=1,
        vocab=4096,
        hidden=256,
        heads=4,
        kv_heads=2,
        intermediate=512,
        domains=tuple(f"d{d}" for d in placement.domain_of),
        shm_hosts=tuple(f"gpu{g}" for g in placement.gpu_of),
    )
    metas = bench_tensors(case)
    sources = trainer_layouts(metas, case.config, TrainerSpec.parse("fsdp=2")).layout_set("source")
    dests = engine_layouts(metas, case.config, EngineSpec(tp=2, dp=1), base=2).layout_set("destination")
    traffic = Planner(sources, dests, domain_of=placement.domain_of.__getitem__).traffic()
    cost = reshard_cost(traffic, cluster, placement)
    assert cost.local_bytes > 0 and cost.network_bytes > 0

    res = run_bench(case, reps=1, warmup=0, timeout=300)
    for method in ("reshard_export", "reshard_shm", "reshard"):
        assert res["method"][method]["correct"], method
    assert res["method"]["reshard"]["recv_by_link"] == {"gloo": res["bytes_kept_total"]}
    for method in ("reshard_export", "reshard_shm"):
        links = res["method"][method]["recv_by_link"]
        assert links == {"shm": cost.local_bytes, "gloo": cost.network_bytes + cost.nvlink_bytes}, (method, links)


def test_the_gpu_check_dry_runs_on_a_cpu(tmp_path):
    """The GPU check runs only where a GPU is lent: its dry run (the cases a
    CPU allows: the executor's variants over a loopback stand-in for NCCL,
    a trainer rank and an engine worker in one process, the colocated refit
    over shared memory) keeps the script itself working, and writes one
    line per case."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
    out = subprocess.run(
        ["bash", str(script), "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = (tmp_path / "gpu_check.txt").read_text().splitlines()[1:]
    verdicts = {line.split()[1].rstrip(":"): line.split()[0] for line in lines}
    cpu = ["executor_dense", "executor_checksums", "executor_delta", "executor_cpu_destination"]
    cpu += ["ipc_same_process", "colocated"]
    assert {name: verdicts.get(name) for name in cpu} == dict.fromkeys(cpu, "PASS"), lines
    assert verdicts["watchdog"] == verdicts["coalescing_exception"] == "SKIP", lines
