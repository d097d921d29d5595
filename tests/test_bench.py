"""`reshard bench` runs end to end and checks every byte (timings are not asserted)."""

from __future__ import annotations

from dataclasses import replace

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
