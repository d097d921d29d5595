"""``reshard bench --engine vllm``: refits into a real engine, every method from one run.

A Qwen2-style model of a settable size is written to ``/dev/shm``; a real
vLLM engine (offline ``LLM``, TP=2 by default, on CPU) starts on it, two
FSDP2 trainer ranks (gloo) hold another checkpoint of the same shapes, and
after a warm-up the methods alternate, each timed from the moment every
process is ready (a barrier) to the moment the engine generates again:

- ``reshard``: one refit, in place (vLLM's layerwise reload, layer by layer
  as the rounds land);
- ``two_phase``: workers stage the refit while the engine could serve, then
  apply it (the paused part is the apply and the cache flush only);
- ``gather_broadcast``: the baseline, through the same interface;
- ``gather_save_reload``: what a refit through files costs: the trainer
  ranks gather every full tensor to rank 0 (FSDP2's ``full_tensor()``),
  which saves them as safetensors to ``/dev/shm``, then vLLM's own
  ``reload_weights(weights_path=...)`` loads them;
- ``reload``: that reload alone, from a checkpoint already on ``/dev/shm``;
- ``raw_p2p``: plain gloo sends of the same bytes, from the trainer ranks to
  one process per engine worker (as many bytes as each worker keeps): the
  wire's ceiling on this machine.

Per refit, every rank's timeline: trainer ranks (plan, agree, transfer),
engine workers (plan, agree, transfer, apply, staging), the driver (engine
call, cache flush, the span generation was paused).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from reshard.testing.ports import free_port

__all__ = ["METHODS", "format_result", "plot", "run_engine_bench", "scratch"]

METHODS = ("reshard", "two_phase", "gather_broadcast", "gather_save_reload", "reload", "raw_p2p")
REFIT_METHODS = {"reshard": "reshard", "two_phase": "reshard", "gather_broadcast": "gather_broadcast"}
"""Methods that are refits (trainer ranks push), with the method they push."""

_DIMS = dict(
    hidden_size=1024,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=2816,
    vocab_size=8192,
    tie_word_embeddings=False,
)


def model_config(size_mb: float, dtype: str) -> dict[str, Any]:
    """Qwen2-style dimensions with as many layers as come closest to ``size_mb``."""
    h, kv, hd, i, v = (
        _DIMS[k] for k in ("hidden_size", "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size")
    )
    item = 2 if dtype in ("bfloat16", "float16") else 4
    per_layer = (2 * h * h + 2 * h * kv * hd + 3 * h * i + 2 * kv * hd + h + 2 * h) * item
    fixed = (2 * v * h + h) * item
    layers = max(1, round((size_mb * 1e6 - fixed) / per_layer))
    return {**_DIMS, "num_hidden_layers": layers, "torch_dtype": dtype}


# -- small helpers shared by every process --------------------------------------------


def bench_store(address: str, *, host: bool = False):
    from torch.distributed import TCPStore

    ip, port = address.rsplit(":", 1)
    return TCPStore(ip, int(port), None, host, timeout=datetime.timedelta(seconds=600), wait_for_workers=False)


def barrier(store, step: int, parties: int) -> None:
    key = f"bench/step{step}"
    store.add(key, 1)
    while int(store.add(key, 0)) < parties:
        time.sleep(0.001)


@contextlib.contextmanager
def scratch(workdir: str | None, prefix: str) -> Iterator[Path]:
    """A bench's working folder: ``workdir``, or a fresh folder in
    ``/dev/shm`` (where one exists) removed afterwards: it holds checkpoints
    of the model's size, and a tmpfs left full starves the next run."""
    if workdir is not None:
        yield Path(workdir)
        return
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def schedule(warmup: int, reps: int, methods: tuple[str, ...] = METHODS) -> list[tuple[int, str]]:
    return [(rep, m) for rep in range(warmup + reps) for m in methods]


def _raw_group(store, rank: int, world: int):
    from torch.distributed import PrefixStore, ProcessGroupGloo

    opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = datetime.timedelta(seconds=600)
    opts._devices = [ProcessGroupGloo.create_default_device()]
    return ProcessGroupGloo(PrefixStore("bench/raw", store), rank, world, opts)


def _raw_shares(kept: list[int], trainers: int) -> list[list[int]]:
    """Bytes trainer ``t`` sends to sink ``w``: each worker's bytes split evenly."""
    return [[k // trainers + (1 if t < k % trainers else 0) for k in kept] for t in range(trainers)]


# -- trainer ranks and raw sinks (processes of their own) ------------------------------------------


def spawn_ranks(jobs: Iterable[tuple[Callable, int, tuple]]) -> tuple[Any, list]:
    """Start ``fn(rank, *args)`` of each job in a spawned daemon process of its
    own (:func:`entry`); the results arrive on the queue returned (read them
    with :func:`collect`, then :func:`join_all` the processes)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=entry, args=(fn, rank, args, q), daemon=True) for fn, rank, args in jobs]
    for p in procs:
        p.start()
    return q, procs


def entry(fn, rank: int, args: tuple, q) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        q.put((fn.__name__, rank, fn(rank, *args), ""))
    except BaseException as e:  # reported to the driver
        q.put((fn.__name__, rank, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def fsdp2_trainer(rank: int, world: int, pg_port: int, path: str, dtype: str) -> Any:
    """This process as rank ``rank`` of a gloo group of ``world`` trainer
    ranks holding the model at ``path`` in ``dtype`` under FSDP2 (each
    decoder layer, then the whole model)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(pg_port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def trainer_rank(rank: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from reshard import GroupConfig, Sender

    torch.set_num_threads(1)
    world = cfg["trainers"]
    store = bench_store(cfg["bench_address"])
    model = fsdp2_trainer(rank, world, cfg["pg_port"], cfg["trainer_path"], cfg["dtype"])
    group = GroupConfig(address=cfg["refit_address"], num_sources=world, num_destinations=cfg["tp"], timeout_s=600)
    sender = Sender(model, config=group)
    kept = json.loads(store.get("bench/kept"))
    shares = _raw_shares(kept, world)[rank]
    raw = _raw_group(store, rank, world + len(kept))
    bufs = [torch.empty(n, dtype=torch.uint8) for n in shares]
    out = []
    refit = 0
    try:
        for step, (_, method) in enumerate(schedule(cfg["warmup"], cfg["reps"], tuple(cfg.get("methods", METHODS)))):
            barrier(store, step, cfg["parties"])
            if method in REFIT_METHODS:
                refit += 1
                st = sender.push(refit, method=REFIT_METHODS[method])
                out.append({"step": step, "method": method, **st.as_dict()})
            elif method == "gather_save_reload":
                out.append({"step": step, "method": method, **gather_save(model, rank, cfg["gather_dir"])})
                if rank == 0:
                    store.set(f"bench/saved{step}", "1")
            elif method == "raw_p2p":
                t0 = time.perf_counter()
                works = [raw.send([b], world + w, 0) for w, b in enumerate(bufs) if b.numel()]
                for wk in works:
                    wk.wait()
                out.append({"step": step, "method": method, "seconds": time.perf_counter() - t0})
    finally:
        sender.close()
        dist.destroy_process_group()
    return out


def gather_save(model, rank: int, directory: str) -> dict[str, float]:
    """Every full tensor gathered to rank 0 (collective), which saves them as
    one safetensors file in ``directory``: the files a reload then reads."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    from reshard.sender.pieces import default_rename

    t0 = time.perf_counter()
    full = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        cname = default_rename(name)
        if rank == 0 and cname is not None:
            full[cname] = t.detach().contiguous()
    t1 = time.perf_counter()
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        save_file(full, os.path.join(directory, "model.safetensors"))
    return {"gather_seconds": t1 - t0, "save_seconds": time.perf_counter() - t1, "seconds": time.perf_counter() - t0}


def raw_sink(rank: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Stands for engine worker ``rank``: receives its bytes from every trainer rank."""
    import torch

    torch.set_num_threads(1)
    store = bench_store(cfg["bench_address"])
    kept = json.loads(store.get("bench/kept"))
    trainers = cfg["trainers"]
    shares = [row[rank] for row in _raw_shares(kept, trainers)]
    raw = _raw_group(store, trainers + rank, trainers + len(kept))
    bufs = [torch.empty(n, dtype=torch.uint8) for n in shares]
    out = []
    for step, (_, method) in enumerate(schedule(cfg["warmup"], cfg["reps"], tuple(cfg.get("methods", METHODS)))):
        barrier(store, step, cfg["parties"])
        if method == "raw_p2p":
            t0 = time.perf_counter()
            works = [raw.recv([b], t, 0) for t, b in enumerate(bufs) if b.numel()]
            for wk in works:
                wk.wait()
            out.append({"step": step, "method": method, "seconds": time.perf_counter() - t0, "bytes": sum(shares)})
    return out


# -- the driver: this process, with the engine -------------------------------------------------


def run_engine_bench(
    *,
    size_mb: float = 256,
    tp: int = 2,
    trainers: int = 2,
    reps: int = 3,
    warmup: int = 1,
    dtype: str = "float32",
    workdir: str | None = None,
    methods: tuple[str, ...] = METHODS,
    say=print,
) -> dict[str, Any]:
    """``methods``: which of :data:`METHODS` to run (``reshard`` always runs:
    the ratios are against it)."""
    import torch

    from reshard.adapters.core.spec import GroupSpec
    from reshard.adapters.vllm.driver import commit_workers, init_workers, pull_workers, stage_workers
    from reshard.testing.engines import greedy, offline_llm, shutdown
    from reshard.testing.tiny import build_tiny_model
    from reshard.transport.group import GroupConfig

    with scratch(workdir, "reshard-engine-bench-") as work:
        cfg_model = model_config(size_mb, dtype)
        say(f"building two {size_mb:.0f} MB {dtype} checkpoints in {work} ...")
        engine_path = build_tiny_model(work / "v1", "qwen2", seed=0, **cfg_model)
        trainer_path = build_tiny_model(work / "v2", "qwen2", seed=7, **cfg_model)
        model_bytes = sum(f.stat().st_size for f in trainer_path.glob("*.safetensors"))

        bench_address = f"127.0.0.1:{free_port()}"
        refit_address = f"127.0.0.1:{free_port()}"
        store = bench_store(bench_address, host=True)
        cfg = {
            "trainers": trainers,
            "tp": tp,
            "reps": reps,
            "warmup": warmup,
            "dtype": dtype,
            "trainer_path": str(trainer_path),
            "bench_address": bench_address,
            "refit_address": refit_address,
            "pg_port": free_port(),
            "parties": 1 + trainers + tp,
            "methods": methods,
            "gather_dir": str(work / "gathered"),
        }
        say(f"starting vLLM (TP={tp}, CPU) ...")
        llm = offline_llm(str(engine_path), tp, dtype=dtype)
        torch.set_num_threads(1)
        q, procs = spawn_ranks(
            [(trainer_rank, r, (cfg,)) for r in range(trainers)] + [(raw_sink, w, (cfg,)) for w in range(tp)]
        )
        rows: list[dict[str, Any]] = []
        tokens: dict[str, list] = {}
        try:
            group = GroupConfig(address=refit_address, num_sources=trainers, num_destinations=tp, timeout_s=600)
            init = init_workers(llm, GroupSpec.of(group, with_token=True))
            kept = [int(r.stats["kept_bytes"]) for r in init]
            store.set("bench/kept", json.dumps(kept))
            steps = schedule(warmup, reps, methods)
            say(f"{len(steps)} timed steps ({warmup} warm-up round(s), then {reps}), methods alternating ...")
            refit = 0
            for step, (rep, method) in enumerate(steps):
                barrier(store, step, 1 + trainers + tp)
                row: dict[str, Any] = {"step": step, "rep": rep, "method": method, "warmup": rep < warmup}
                t0 = time.perf_counter()
                t_pause = t0
                replies = []
                if method in ("reshard", "gather_broadcast"):
                    refit += 1
                    replies = pull_workers(llm, refit, method=method)
                elif method == "two_phase":
                    refit += 1
                    stage_workers(llm, refit)
                    t_pause = time.perf_counter()
                    replies = commit_workers(llm, refit)
                elif method == "gather_save_reload":
                    store.wait([f"bench/saved{step}"])
                    row["saved_seconds"] = time.perf_counter() - t0
                    llm.collective_rpc(
                        "reload_weights", kwargs={"weights_path": cfg["gather_dir"], "is_checkpoint_format": True}
                    )
                elif method == "reload":
                    llm.collective_rpc(
                        "reload_weights", kwargs={"weights_path": str(trainer_path), "is_checkpoint_format": True}
                    )
                t_flush = time.perf_counter()
                if method != "raw_p2p":
                    llm.reset_prefix_cache()
                t_end = time.perf_counter()
                row.update(
                    seconds=t_end - t0,
                    paused_seconds=(t_end - t_pause) if method != "raw_p2p" else 0.0,
                    flush_seconds=t_end - t_flush,
                    workers=[dict(r.stats) for r in replies],
                )
                rows.append(row)
                if rep == warmup + reps - 1 and method != "raw_p2p":
                    tokens[method] = greedy(llm)
            results = collect(q, procs, timeout=600)
        finally:
            join_all(procs)
            shutdown(llm)
        merge_ranks(rows, results)
        return summarize(rows, tokens, kept, model_bytes, size_mb, tp, trainers, dtype, reps, warmup, names=methods)


def join_all(procs) -> None:
    """Wait a little for every helper process, then kill what is left."""
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()


def merge_ranks(rows: list[dict[str, Any]], results: list[tuple[str, int, Any]]) -> None:
    """Put every trainer rank's and raw sink's records into the driver's rows;
    a raw transfer takes as long as its slowest process."""
    for name, _rank, value in results:
        for r in value:
            rows[r["step"]].setdefault("trainers" if name == "trainer_rank" else "sinks", []).append(r)
    for row in rows:
        if row["method"] == "raw_p2p":
            row["seconds"] = max(r["seconds"] for r in row["trainers"] + row["sinks"])


def collect(q, procs, timeout: float, what: str = "engine bench") -> list[tuple[str, int, Any]]:
    """``(function name, rank, value)`` from every process started on :func:`entry`;
    ``RuntimeError`` naming ``what`` and every process's error when one fails or all go silent."""
    out: list[tuple[str, int, Any]] = []
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    while len(out) + len(errors) < len(procs) and time.monotonic() < deadline:
        try:
            name, rank, value, err = q.get(timeout=1)
        except Exception:
            if not any(p.is_alive() for p in procs):
                break
            continue
        if err:
            errors.append(f"{name} {rank}: {err}")
        else:
            out.append((name, rank, value))
    if errors or len(out) < len(procs):
        raise RuntimeError(f"{what} failed:\n" + "\n".join(errors or ["processes did not report"]))
    return out


def summarize(
    rows,
    tokens,
    kept,
    model_bytes,
    size_mb,
    tp,
    trainers,
    dtype,
    reps,
    warmup,
    *,
    names: tuple[str, ...] = METHODS,
    engine=None,
) -> dict[str, Any]:
    volume = sum(kept)
    methods: dict[str, Any] = {}
    for m in names:
        timed = [r for r in rows if r["method"] == m and not r["warmup"]]
        secs = [r["seconds"] for r in timed]
        paused = [r["paused_seconds"] for r in timed]
        entry: dict[str, Any] = {
            "seconds_median": statistics.median(secs),
            "seconds_all": secs,
            "paused_median": statistics.median(paused),
            "gb_per_s": volume / statistics.median(secs) / 1e9,
        }
        if m in REFIT_METHODS:
            entry["bytes_received"] = [w["bytes_received"] for w in timed[-1]["workers"]]
            entry["timeline"] = _timeline(timed)
        if m == "gather_save_reload":
            entry["steps"] = {
                "gather": statistics.median(max(t["gather_seconds"] for t in r["trainers"]) for r in timed),
                "save": statistics.median(max(t["save_seconds"] for t in r["trainers"]) for r in timed),
                "reload": statistics.median(r["seconds"] - r["saved_seconds"] for r in timed),
            }
        methods[m] = entry
    rs = methods["reshard"]
    ratios = {}
    if "raw_p2p" in methods:
        raw = methods["raw_p2p"]["seconds_median"]
        ratios["reshard_vs_raw_throughput"] = raw / rs["seconds_median"]
        # The transfer alone: until the slowest worker's last byte landed (the
        # engine's processing of the last layers may still run after it).
        if landed := rs.get("timeline", {}).get("worker_landed"):
            ratios["reshard_transfer_vs_raw"] = raw / landed
    for m, key in (
        ("reload", "reload_over_reshard"),
        ("gather_broadcast", "gather_broadcast_over_reshard"),
        ("gather_save_reload", "gather_save_reload_over_reshard"),
    ):
        if m in methods:
            ratios[key] = methods[m]["seconds_median"] / rs["seconds_median"]
    if "two_phase" in methods:
        two = methods["two_phase"]
        ratios["two_phase_paused_fraction"] = two["paused_median"] / two["seconds_median"]
        ratios["two_phase_paused_over_reshard"] = two["paused_median"] / rs["seconds_median"]
    reference = tokens.get("reload")
    return {
        "engine": engine or f"vllm tp={tp} (CPU, offline LLM)",
        "trainer": f"fsdp={trainers}",
        "dtype": dtype,
        "size_mb": size_mb,
        "model_bytes": model_bytes,
        "kept_bytes": kept,
        "reps": reps,
        "warmup": warmup,
        "method": methods,
        "ratios": ratios,
        "tokens_match_reload": {m: t == reference for m, t in tokens.items() if m != "reload"},
        "rows": rows,
    }


def _timeline(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over the timed refits of one method: where the time went, by
    the slowest rank of each side, and the slowest worker's phases (its
    transfer's wait on the wire and staging copies, the engine lifecycle's
    steps), with the CPU time every rank of a side used."""

    def med(values: list[float]) -> float:
        return statistics.median(values) if values else 0.0

    def worst(row, side: str, key: str) -> float:
        return max((float(x.get(key, 0.0)) for x in row.get(side, [])), default=0.0)

    def slowest(row) -> dict[str, Any]:
        workers = row.get("workers") or [{}]
        return max(workers, key=lambda w: float(w.get("total_seconds", 0.0)))

    def cpu(row, side: str) -> float:
        return sum(float(x.get("cpu_seconds", 0.0)) for x in row.get(side, []))

    out = {
        "trainer_plan": med([worst(r, "trainers", "plan_seconds") for r in rows]),
        "trainer_agree": med([worst(r, "trainers", "agree_seconds") for r in rows]),
        "trainer_transfer": med([worst(r, "trainers", "seconds") for r in rows]),
        "trainer_cpu": med([cpu(r, "trainers") for r in rows]),
        "worker_plan": med([worst(r, "workers", "plan_seconds") for r in rows]),
        "worker_agree": med([worst(r, "workers", "agree_seconds") for r in rows]),
        "worker_transfer": med([worst(r, "workers", "seconds") for r in rows]),
        "worker_landed": med([worst(r, "workers", "landed_seconds") for r in rows]),
        "worker_apply": med([worst(r, "workers", "apply_seconds") for r in rows]),
        "worker_stage": med([worst(r, "workers", "stage_seconds") for r in rows]),
        "worker_cpu": med([cpu(r, "workers") for r in rows]),
        "flush": med([r["flush_seconds"] for r in rows]),
        "paused": med([r["paused_seconds"] for r in rows]),
        "total": med([r["seconds"] for r in rows]),
    }
    # The slowest worker's phases: its transfer's (ExecStats.phase_seconds)
    # and its engine lifecycle's (LayerwiseUpdate.seconds).
    for source, prefix in (("phase_seconds", "phase_"), ("lifecycle_seconds", "step_")):
        keys = sorted({k for r in rows for k in (slowest(r).get(source) or {})})
        for k in keys:
            out[prefix + k] = med([float((slowest(r).get(source) or {}).get(k, 0.0)) for r in rows])
    return {k: v for k, v in out.items() if not math.isnan(v)}


def _phases(tl: dict[str, float], prefix: str) -> str:
    return ", ".join(
        f"{k.removeprefix(prefix).replace('_', ' ')} {v:.3f}" for k, v in tl.items() if k.startswith(prefix)
    )


def format_result(res: dict[str, Any]) -> str:
    kept = sum(res["kept_bytes"])
    lines = [
        f"engine bench: trainer {res['trainer']} -> {res['engine']}, {res['model_bytes'] / 1e6:.0f} MB "
        f"{res['dtype']} checkpoint, workers keep {kept / 1e6:.0f} MB; {res['reps']} runs per method after "
        f"{res['warmup']} warm-up",
        f"{'method':<18}{'median s':>10}{'GB/s':>8}{'paused s':>10}   timeline (median s, slowest rank)",
    ]
    details = []
    for name, m in res["method"].items():
        tl = m.get("timeline")
        detail = ""
        if tl:
            detail = (
                f"plan {tl['worker_plan']:.3f}, agree {tl['worker_agree']:.3f}, transfer {tl['worker_transfer']:.3f}, "
                f"apply {tl['worker_apply']:.3f}, flush {tl['flush']:.3f}"
            )
            if tl.get("worker_stage"):
                detail += f", staged in {tl['worker_stage']:.3f}"
            details.append(_detail(name, tl))
        if steps := m.get("steps"):
            detail = ", ".join(f"{k} {v:.3f}" for k, v in steps.items())
        paused = f"{m['paused_median']:>10.3f}" if name != "raw_p2p" else f"{'-':>10}"
        lines.append(f"{name:<18}{m['seconds_median']:>10.3f}{m['gb_per_s']:>8.2f}{paused}   {detail}")
    lines += details
    r = res["ratios"]
    parts = []
    if "reshard_transfer_vs_raw" in r:
        parts.append(
            f"reshard's transfer into the engine at {r['reshard_transfer_vs_raw']:.2f}x raw point-to-point "
            "throughput (until its last byte landed)"
        )
    if "reshard_vs_raw_throughput" in r:
        parts.append(f"the whole refit at {r['reshard_vs_raw_throughput']:.2f}x")
    if "gather_broadcast_over_reshard" in r:
        parts.append(f"gather-and-broadcast takes {r['gather_broadcast_over_reshard']:.2f}x reshard's time")
    if "gather_save_reload_over_reshard" in r:
        parts.append(f"gather + save + reload {r['gather_save_reload_over_reshard']:.2f}x")
    if "reload_over_reshard" in r:
        parts.append(f"a /dev/shm reload alone {r['reload_over_reshard']:.2f}x")
    summary = ", ".join(parts)
    if "two_phase_paused_fraction" in r:
        summary += (
            f"; two-phase pauses generation for {r['two_phase_paused_fraction']:.0%} of its refit "
            f"({r['two_phase_paused_over_reshard']:.0%} of an in-place refit's pause)"
        )
    lines.append(summary)
    match = res["tokens_match_reload"]
    lines.append(
        "greedy tokens after each method equal those after the engine's own reload: "
        + ", ".join(f"{m} {ok}" for m, ok in match.items())
    )
    return "\n".join(lines)


def _detail(name: str, tl: dict[str, float]) -> str:
    """Where one method's time went (medians, the slowest worker): its
    transfer until the last byte landed and that transfer's phases, the
    engine lifecycle's steps (for a two-phase refit: what ran while
    generation was paused), and the CPU time each side used."""
    lines = [f"  {name}: slowest worker's transfer landed in {tl.get('worker_landed', 0.0):.3f} s"]
    if phases := _phases(tl, "phase_"):
        lines[0] += f" ({phases})"
    if steps := _phases(tl, "step_"):
        when = "paused (commit)" if name == "two_phase" else "lifecycle"
        lines.append(f"    {when}: {steps}")
    lines.append(
        f"    cpu seconds: trainers {tl.get('trainer_cpu', 0.0):.3f}, workers {tl.get('worker_cpu', 0.0):.3f} "
        "(every rank of the side, summed)"
    )
    return "\n".join(lines)


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["method"])
    secs = [res["method"][n]["seconds_median"] for n in names]
    paused = [res["method"][n]["paused_median"] for n in names]
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    ax.bar(names, secs, color="#9ab", label="refit (median)")
    ax.bar(names, paused, color="#c44", width=0.4, label="generation paused")
    for i, s in enumerate(secs):
        ax.text(i, s, f"{s:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title(
        f"refit of {sum(res['kept_bytes']) / 1e6:.0f} MB into {res['engine'].split(' (')[0]}, "
        f"trainer {res['trainer']} ({res['dtype']}, 2-core CPU)",
        fontsize=9,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
