"""``reshard bench --engine vllm|sglang``: refits into a real engine, every
method from one run (:mod:`reshard.tools.engine_bench` for vLLM,
:mod:`reshard.tools.sglang_bench` for SGLang)."""

from __future__ import annotations

import argparse
import json
import os

from reshard.tools import engine_bench
from reshard.tools.sglang_bench import run_sglang_bench

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="reshard bench --engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--engine", choices=["vllm", "sglang"], default="vllm", help="the engine (SGLang: TP=1, its venv)")
    ap.add_argument("--sglang-python", default=None, help="SGLang's venv Python (default: .venv-sglang)")
    ap.add_argument("--size-mb", type=float, default=256, help="checkpoint size (default 256)")
    ap.add_argument("--tp", type=int, default=None, help="engine TP (default: 2 for vLLM, 1 for SGLang)")
    ap.add_argument("--trainers", type=int, default=2, help="FSDP2 trainer ranks")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (default: a folder in /dev/shm)")
    ap.add_argument(
        "--delta",
        action="store_true",
        help="vLLM: delta refits after AdamW steps, against dense ones and gather-and-broadcast",
    )
    ap.add_argument(
        "--lora",
        action="store_true",
        help="vLLM: a LoRA policy, merged vs adapter-only vs TRL's gather-and-broadcast vs an adapter file",
    )
    ap.add_argument(
        "--draft",
        action="store_true",
        help="vLLM: a speculative engine across refits, its drafter refit with the policy vs left stale",
    )
    ap.add_argument("--spec-tokens", type=int, default=3, help="--draft: draft tokens per step")
    ap.add_argument("--lora-rank", type=int, default=16, help="--lora: the adapter's rank")
    ap.add_argument("--lr", type=float, default=1e-6, help="--delta: the AdamW learning rate")
    ap.add_argument("--master", default="bfloat16", choices=["bfloat16", "float32"], help="--delta: trainer dtype")
    ap.add_argument(
        "--methods",
        default=None,
        help="vLLM: comma-separated methods to run (default: all of them; reshard always runs)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object (with every rank's timeline)")
    ap.add_argument("--plot", default=None, help="write a PNG of the results")
    args = ap.parse_args(argv)
    import sys

    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else print
    saved = None
    if args.json:
        # vLLM logs to stdout (its workers too): send all of it to stderr, so
        # stdout holds the JSON object only.
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(2, 1)
    try:
        if args.draft:
            if args.engine != "vllm":
                ap.error("--draft runs into vLLM")
            from reshard.tools.draft_bench import format_draft_result, run_draft_bench

            res = run_draft_bench(
                size_mb=args.size_mb,
                tp=args.tp or 1,
                reps=args.reps,
                spec_tokens=args.spec_tokens,
                workdir=args.workdir,
                say=say,
            )
            if saved is not None:
                os.dup2(saved, 1)
                os.close(saved)
                saved = None
            print(json.dumps(res, indent=2) if args.json else format_draft_result(res))
            return 0
        if args.lora:
            if args.engine != "vllm":
                ap.error("--lora runs into vLLM")
            from reshard.tools.lora_bench import format_lora_result, run_lora_bench

            res = run_lora_bench(
                size_mb=args.size_mb,
                tp=args.tp or 2,
                trainers=args.trainers,
                lora_rank=args.lora_rank,
                reps=args.reps,
                warmup=args.warmup,
                dtype=args.dtype,
                workdir=args.workdir,
                say=say,
            )
            if saved is not None:
                os.dup2(saved, 1)
                os.close(saved)
                saved = None
            print(json.dumps(res, indent=2) if args.json else format_lora_result(res))
            return 0
        if args.delta:
            if args.engine != "vllm":
                ap.error("--delta runs into vLLM")
            from reshard.tools.delta_engine_bench import run_delta_engine_bench

            res = run_delta_engine_bench(
                size_mb=args.size_mb,
                tp=args.tp or 2,
                trainers=args.trainers,
                reps=args.reps,
                warmup=args.warmup,
                lr=args.lr,
                master=args.master,
                workdir=args.workdir,
                say=say,
            )
        elif args.engine == "sglang":
            if args.tp not in (None, 1):
                ap.error("SGLang runs at TP=1 on CPU")
            res = run_sglang_bench(
                size_mb=args.size_mb,
                trainers=args.trainers,
                reps=args.reps,
                warmup=args.warmup,
                dtype=args.dtype,
                workdir=args.workdir,
                python=args.sglang_python,
                say=say,
            )
        else:
            methods: tuple[str, ...] = engine_bench.METHODS
            if args.methods:
                wanted = {"reshard", *args.methods.split(",")}
                unknown = wanted - set(methods)
                if unknown:
                    ap.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(methods)}")
                methods = tuple(m for m in methods if m in wanted)
            res = engine_bench.run_engine_bench(
                size_mb=args.size_mb,
                tp=args.tp or 2,
                trainers=args.trainers,
                reps=args.reps,
                warmup=args.warmup,
                dtype=args.dtype,
                workdir=args.workdir,
                methods=methods,
                say=say,
            )
    finally:
        if saved is not None:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
    if args.json:
        print(json.dumps(res, indent=1))
    elif args.delta:
        from reshard.tools.delta_engine_bench import format_delta_engine

        print(format_delta_engine(res), flush=True)
    else:
        print(engine_bench.format_result(res), flush=True)
    if args.plot and not args.delta:
        engine_bench.plot(res, args.plot)
    return 0
