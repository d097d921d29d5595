"""``reshard bench --engine vllm --delta``: delta refits into a real vLLM
engine, against dense refits and gather-and-broadcast, from one run.

A Qwen2-style model of a settable size (initialized as models are) is
written to ``/dev/shm``; a real vLLM engine (offline ``LLM``, TP=2, bf16, on
CPU) starts on it and two FSDP2 trainer ranks hold it in bf16 (or float32
master weights), taking AdamW steps (on the model's loss on random tokens)
between refits. Two passes, each after a warm-up:

1. the workers join a dense refit group: after every step, ``reshard`` (in
   place) and ``gather_broadcast`` refit the engine;
2. the workers join a delta group (``GroupConfig.delta``: they keep a copy of
   their slices as the base): after every step, ``delta`` refits it (its
   first refit, dense, is the warm-up).

Each refit is timed from a barrier of every process to the moment the
engine generates again; wire bytes are what the workers received. At the
end the trainer's weights are saved and reloaded by vLLM itself: the greedy
tokens after the last delta refit must equal those after that reload.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from reshard.tools.engine_bench import (
    barrier,
    bench_store,
    collect,
    free_port,
    fsdp2_trainer,
    join_all,
    model_config,
    scratch,
    spawn_ranks,
)

__all__ = ["format_delta_engine", "run_delta_engine_bench"]

PASSES = (("dense", ("reshard", "gather_broadcast")), ("delta", ("delta",)))


def _steps(warmup: int, reps: int) -> list[tuple[str, int, str]]:
    """``(pass, step, method)`` in the order every process runs them."""
    out = []
    for name, methods in PASSES:
        for step in range(warmup + reps):
            out += [(name, step, m) for m in methods]
    return out


def trainer_rank(rank: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from reshard import GroupConfig, Sender

    torch.set_num_threads(1)
    world = cfg["trainers"]
    store = bench_store(cfg["bench_address"])
    model = fsdp2_trainer(rank, world, cfg["pg_port"], cfg["path"], cfg["master"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    senders = {
        name: Sender(
            model,
            config=GroupConfig(
                address=cfg["refit_address"],
                num_sources=world,
                num_destinations=cfg["tp"],
                timeout_s=600,
                job=f"bench-{name}",
                delta=name == "delta",
            ),
        )
        for name, _ in PASSES
    }
    out = []
    refit = 0
    prev = None
    try:
        for i, (name, step, method) in enumerate(_steps(cfg["warmup"], cfg["reps"])):
            if (name, step) != prev:
                # A training step (not timed): the loss on random tokens, AdamW.
                g = torch.Generator().manual_seed(1000 * i + rank)
                tokens = torch.randint(4, model.config.vocab_size, (1, 32), generator=g)
                model(input_ids=tokens, labels=tokens).loss.backward()
                opt.step()
                opt.zero_grad()
                prev = (name, step)
            barrier(store, i, cfg["parties"])
            refit += 1
            st = senders[name].push(refit, method="gather_broadcast" if method == "gather_broadcast" else "reshard")
            out.append({"step": i, "method": method, **st.as_dict()})
        _save(model, cfg["final_path"], cfg["path"], rank)
    finally:
        for s in senders.values():
            s.close()
        dist.destroy_process_group()
    return out


def _save(model, path: str, source: str, rank: int) -> None:
    """The trainer's weights as a checkpoint in the engine's dtype (every rank gathers; rank 0 writes)."""
    import shutil

    import safetensors.torch
    import torch
    from torch.distributed.tensor import DTensor

    full = {}
    for name, p in model.state_dict().items():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        full[name] = t.detach().to(torch.bfloat16).contiguous()
    if rank:
        return
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(source).iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    safetensors.torch.save_file(full, str(out / "model.safetensors"), metadata={"format": "pt"})


def run_delta_engine_bench(
    *,
    size_mb: float = 256,
    tp: int = 2,
    trainers: int = 2,
    reps: int = 3,
    warmup: int = 1,
    lr: float = 1e-6,
    master: str = "bfloat16",
    workdir: str | None = None,
    say=print,
) -> dict[str, Any]:
    import torch

    from reshard.adapters.core.spec import GroupSpec
    from reshard.adapters.vllm.driver import init_workers, pull_workers
    from reshard.testing.engines import greedy, offline_llm, shutdown
    from reshard.testing.tiny import build_tiny_model
    from reshard.transport.group import GroupConfig

    with scratch(workdir, "reshard-delta-bench-") as work:
        say(f"building a {size_mb:.0f} MB bfloat16 checkpoint in {work} ...")
        path = build_tiny_model(work / "v0", "qwen2", seed=0, **model_config(size_mb, "bfloat16"))
        bench_address = f"127.0.0.1:{free_port()}"
        refit_address = f"127.0.0.1:{free_port()}"
        store = bench_store(bench_address, host=True)
        cfg = {
            "trainers": trainers,
            "tp": tp,
            "reps": reps,
            "warmup": warmup,
            "lr": lr,
            "master": master,
            "path": str(path),
            "final_path": str(work / "final"),
            "bench_address": bench_address,
            "refit_address": refit_address,
            "pg_port": free_port(),
            "parties": 1 + trainers,
        }
        say(f"starting vLLM (TP={tp}, bfloat16, CPU) ...")
        llm = offline_llm(str(path), tp, dtype="bfloat16")
        torch.set_num_threads(1)
        q, procs = spawn_ranks((trainer_rank, r, (cfg,)) for r in range(trainers))
        rows: list[dict[str, Any]] = []
        out: dict[str, Any] = {}
        try:
            current = None
            steps = _steps(warmup, reps)
            say(f"{len(steps)} refits: a dense pass then a delta pass, an AdamW step (lr {lr:g}) before each step ...")
            for i, (name, step, method) in enumerate(steps):
                if name != current:
                    group = GroupConfig(
                        address=refit_address,
                        num_sources=trainers,
                        num_destinations=tp,
                        timeout_s=600,
                        job=f"bench-{name}",
                        delta=name == "delta",
                    )
                    init_workers(llm, GroupSpec.of(group, with_token=True))
                    current = name
                barrier(store, i, 1 + trainers)
                t0 = time.perf_counter()
                how = "gather_broadcast" if method == "gather_broadcast" else "reshard"
                replies = pull_workers(llm, i + 1, method=how)
                llm.reset_prefix_cache()
                rows.append(
                    {
                        "step": i,
                        "method": method,
                        "warmup": step < warmup,
                        "seconds": time.perf_counter() - t0,
                        "workers": [dict(r.stats) for r in replies],
                    }
                )
            out["tokens_delta"] = greedy(llm)
            results = collect(q, procs, timeout=900)
            llm.collective_rpc(
                "reload_weights", kwargs={"weights_path": cfg["final_path"], "is_checkpoint_format": True}
            )
            llm.reset_prefix_cache()
            out["tokens_reload"] = greedy(llm)
        finally:
            join_all(procs)
            shutdown(llm)
        for _name, _rank, value in results:
            for r in value:
                rows[r["step"]].setdefault("trainers", []).append(r)
        return _summarize(rows, out, size_mb, tp, trainers, master, lr, reps, warmup)


def _summarize(rows, out, size_mb, tp, trainers, master, lr, reps, warmup) -> dict[str, Any]:
    methods: dict[str, Any] = {}
    for m in ("delta", "reshard", "gather_broadcast"):
        timed = [r for r in rows if r["method"] == m and not r["warmup"]]
        wire = [sum(w["wire_bytes"] for w in r["workers"]) for r in timed]
        dense = [sum(w["dense_bytes"] for w in r["workers"]) for r in timed]
        changed = [
            sum(t["delta_changed"] for t in r["trainers"]) / max(1, sum(t["delta_elements"] for t in r["trainers"]))
            for r in timed
        ]
        methods[m] = {
            "seconds_median": statistics.median(r["seconds"] for r in timed),
            "seconds_all": [r["seconds"] for r in timed],
            "wire_bytes_median": statistics.median(wire),
            "dense_bytes_median": statistics.median(dense),
            "apply_median": statistics.median(max(w.get("apply_seconds", 0.0) for w in r["workers"]) for r in timed),
            "layers_skipped": [max(w.get("layers_skipped", 0) for w in r["workers"]) for r in timed],
            "changed_fraction": statistics.median(changed) if m == "delta" else None,
        }
    dense_s = methods["reshard"]["seconds_median"]
    dense_w = methods["reshard"]["wire_bytes_median"]
    for m in methods.values():
        m["time_vs_dense"] = m["seconds_median"] / dense_s
        m["wire_vs_dense"] = m["wire_bytes_median"] / dense_w
    return {
        "engine": f"vllm tp={tp} (CPU, offline LLM, bfloat16)",
        "trainer": f"fsdp={trainers} ({master})",
        "size_mb": size_mb,
        "lr": lr,
        "reps": reps,
        "warmup": warmup,
        "method": methods,
        "tokens_match_reload": out["tokens_delta"] == out["tokens_reload"],
        "rows": rows,
    }


def format_delta_engine(res: dict[str, Any]) -> str:
    d = res["method"]["delta"]
    lines = [
        f"engine bench (delta): trainer {res['trainer']} -> {res['engine']}, a {res['size_mb']:.0f} MB model, "
        f"AdamW lr {res['lr']:g}; medians of {res['reps']} refits per method after {res['warmup']} warm-up",
        f"{'method':<18}{'median s':>10}{'x dense':>9}{'wire MB':>10}{'x dense':>9}{'apply s':>9}",
    ]
    for name, m in res["method"].items():
        lines.append(
            f"{name:<18}{m['seconds_median']:>10.3f}{m['time_vs_dense']:>9.2f}{m['wire_bytes_median'] / 1e6:>10.1f}"
            f"{m['wire_vs_dense']:>9.3f}{m['apply_median']:>9.3f}"
        )
    lines.append(
        f"{100 * d['changed_fraction']:.2f}% of the elements changed per step; delta refits take "
        f"{d['time_vs_dense']:.2f}x a dense refit's time with {d['wire_vs_dense']:.3f}x its bytes "
        f"(layers left alone per refit: {d['layers_skipped']}); greedy tokens after the last delta refit equal "
        f"those after vLLM's own reload of the trainer's weights: {res['tokens_match_reload']}"
    )
    return "\n".join(lines)
