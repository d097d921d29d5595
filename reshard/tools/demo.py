"""``reshard demo``: train, hot-swap into a running vLLM engine, check.

A tiny Qwen2-style model is built locally. Two trainer ranks (FSDP2 on gloo;
this process is rank 0, a spawned process is rank 1) take optimizer steps
on a toy objective, and after each step the weights go into a real vLLM
engine (tensor-parallel, on CPU) twice: once by gather-and-broadcast (the
baseline most RL stacks use) and once by reshard, each one call of
``Sender.push(n, engines=...)``. Every engine worker receives only the
slices it keeps with reshard, every full tensor with the baseline. At the
end the trainer's weights are saved and a fresh engine loads them: its
greedy tokens must equal the hot-swapped engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from reshard.testing.ports import free_port

__all__ = ["main"]

# About 50 MB of float32 weights: big enough that the two methods differ,
# small enough for a 2-core laptop.
MODEL = dict(
    hidden_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=1536,
    num_hidden_layers=4,
)
_TERMINAL = [sys.stdout]
"""Where the steps and the table go; everything else (vLLM's, torch's and
the trainer's own output, from every process) goes to the log file."""


def _say(msg: str) -> None:
    print(msg, file=_TERMINAL[0], flush=True)


def _quiet_to(log: Path) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2, which
    child processes inherit) to ``log``; :func:`_say` keeps the terminal."""
    sys.stdout.flush()
    sys.stderr.flush()
    _TERMINAL[0] = os.fdopen(os.dup(1), "w", buffering=1)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _toy_batch(rank: int, world: int, vocab: int):
    """Teach the model to continue each prompt with a fixed phrase."""
    import torch

    from reshard.testing.engines import PROMPTS

    g = torch.Generator().manual_seed(1234)
    phrase = torch.randint(100, vocab, (24,), generator=g)
    rows = []
    for p in PROMPTS * 4:
        rows.append(torch.cat([torch.tensor(p), phrase])[:24])
    batch = torch.stack(rows)
    return batch[rank::world]


def _trainer(
    rank: int,
    world: int,
    pg_port: int,
    ckpt: str,
    refit_address: str,
    steps: int,
    engine_workers: int,
    engines=None,
    report=None,
):
    """One FSDP2 trainer rank; rank 0 also drives the engine and reports."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from reshard import GroupConfig, Sender

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(pg_port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=5e-4)
        batch = _toy_batch(rank, world, model.config.vocab_size)
        cfg = GroupConfig(address=refit_address, num_sources=world, num_destinations=engine_workers)
        sender = Sender(model, config=cfg)
        refit = 0
        try:
            # Step 0 is a warm-up swap of the starting weights by both methods
            # (first-use costs: connecting, buffers), not reported.
            for step in range(steps + 1):
                row: dict[str, Any] = {"step": step}
                if step:
                    out = model(input_ids=batch, labels=batch)
                    out.loss.backward()
                    opt.step()
                    opt.zero_grad()
                    loss = out.loss.detach()
                    dist.all_reduce(loss)
                    row["loss"] = float(loss) / world
                for method in ("gather_broadcast", "reshard"):
                    refit += 1
                    dist.barrier()
                    t0 = time.perf_counter()
                    st = sender.push(refit, method=method, engines=engines if rank == 0 else None)
                    seconds = time.perf_counter() - t0
                    if rank == 0:
                        got = [w.bytes_received for w in sender.engine_stats]
                        row[method] = {"seconds": seconds, "worker_bytes": got, "sent": st.exec.bytes_sent}
                if step:
                    # The check (not part of a refit): the trainer's full weights.
                    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
                    full = get_model_state_dict(model, options=options)
                    if report is not None:
                        report(row, full)
        finally:
            sender.close()
    finally:
        dist.destroy_process_group()


def _rank1(rank: int, world: int, pg_port: int, ckpt: str, address: str, steps: int, engine_workers: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    _trainer(rank, world, pg_port, ckpt, address, steps, engine_workers)


def _fresh(path: str, q) -> None:
    """A fresh TP=1 engine on ``path`` (its own process): greedy tokens."""
    from reshard.testing.engines import greedy, offline_llm, shutdown

    llm = offline_llm(path, 1)
    try:
        q.put(greedy(llm))
    finally:
        shutdown(llm)


def _mb(n: float) -> str:
    return f"{n / 1e6:7.1f} MB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="reshard demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="optimizer steps, each followed by a hot swap")
    p.add_argument("--tp", type=int, default=2, help="the engine's tensor-parallel size")
    p.add_argument("--workdir", default=None, help="where the tiny model goes (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--log", default=None, help="where vLLM's and torch's output goes (default: WORKDIR/demo.log)")
    args = p.parse_args(argv)

    import multiprocessing as mp

    import torch

    from reshard.adapters.vllm.driver import VllmEngines
    from reshard.testing.engines import greedy, offline_llm
    from reshard.testing.tiny import build_tiny_model

    t_start = time.monotonic()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="reshard-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    log = Path(args.log or work / "demo.log")
    _say(f"reshard demo: vLLM's and torch's output goes to {log}")
    _quiet_to(log)
    _say(f"[1/5] building a tiny Qwen2-style model in {work} ...")
    ckpt = build_tiny_model(work / "start", "qwen2", seed=0, **MODEL)
    n_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    _say(f"      {_mb(n_bytes).strip()} of float32 weights")

    _say(f"[2/5] starting a vLLM engine (TP={args.tp}, CPU) on it ...")
    llm = offline_llm(str(ckpt), args.tp)
    before = greedy(llm)
    _say(f"      greedy tokens before training: {before[0]}")

    _say("[3/5] starting the trainer: 2 ranks, FSDP2 on gloo (this process is rank 0) ...")
    pg_port, refit_port = free_port(), free_port()
    address = f"127.0.0.1:{refit_port}"
    ctx = mp.get_context("spawn")
    peer = ctx.Process(target=_rank1, args=(1, 2, pg_port, str(ckpt), address, args.steps, args.tp), daemon=True)
    peer.start()
    torch.set_num_threads(1)
    live = {"llm": llm}
    engines = VllmEngines([llm])
    rows: list[dict[str, Any]] = []

    def report(row: dict[str, Any], full: dict[str, Any]) -> None:
        rows.append(row)
        row["tokens"] = greedy(live["llm"])
        row["fresh"] = _fresh_tokens(ctx, ckpt, full, work / f"step{row['step']}")
        gb, rs = row["gather_broadcast"], row["reshard"]
        _say(
            f"      step {row['step']}: loss {row['loss']:.3f} | gather-broadcast {gb['seconds']:.3f} s, "
            f"{_mb(sum(gb['worker_bytes']))} into the engine | reshard {rs['seconds']:.3f} s, "
            f"{_mb(sum(rs['worker_bytes']))} | {gb['seconds'] / rs['seconds']:.2f}x faster, "
            f"{sum(gb['worker_bytes']) / sum(rs['worker_bytes']):.2f}x fewer bytes"
        )
        verdict = "same as a fresh engine on the trainer's weights" if row["tokens"] == row["fresh"] else "DIFFERENT"
        _say(f"              greedy tokens {row['tokens'][0]}: {verdict}")

    _say(f"[4/5] {args.steps} optimizer steps; after each, two hot swaps (gather-broadcast, then reshard)")
    _say("      and a fresh engine loads the trainer's weights from disk to check the swapped engine:")
    _trainer(0, 2, pg_port, str(ckpt), address, args.steps, args.tp, engines=engines, report=report)
    peer.join(timeout=120)
    live.clear()
    engines.engines.clear()
    from reshard.testing.engines import shutdown

    shutdown(llm)
    del llm

    _say("[5/5] summary")
    ok = bool(rows) and all(r["tokens"] == r["fresh"] for r in rows)
    changed = any(r["tokens"] != before for r in rows)
    total_rs = sum(sum(r["reshard"]["worker_bytes"]) for r in rows)
    total_gb = sum(sum(r["gather_broadcast"]["worker_bytes"]) for r in rows)
    t_rs = sum(r["reshard"]["seconds"] for r in rows)
    t_gb = sum(r["gather_broadcast"]["seconds"] for r in rows)
    _say(f"      reshard:          {_mb(total_rs)} into the engine in {t_rs:.2f} s")
    ratio = t_gb / max(t_rs, 1e-9)
    _say(f"      gather-broadcast: {_mb(total_gb)} into the engine in {t_gb:.2f} s ({ratio:.1f}x longer)")
    _say(
        ("OK: " if ok and changed else "FAILED: ")
        + f"generations changed with training ({changed}) and after every swap equal a fresh engine's on the "
        f"trainer's weights ({ok}). {time.monotonic() - t_start:.0f} s in all."
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "before": before, "ok": ok and changed}))
    return 0 if ok and changed else 1


def _fresh_tokens(ctx, ckpt: Path, full: dict[str, Any], out: Path) -> list[list[int]]:
    """Save ``full`` as a checkpoint next to the tokenizer and run a fresh engine on it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    model.load_state_dict(full)
    model.save_pretrained(out, safe_serialization=True)
    for f in ckpt.glob("*token*"):
        shutil.copy(f, out / f.name)
    q = ctx.Queue()
    proc = ctx.Process(target=_fresh, args=(str(out), q))
    proc.start()
    try:
        return q.get(timeout=600)
    finally:
        proc.join(timeout=120)


if __name__ == "__main__":
    sys.exit(main())
