"""The ``reshard`` command line: ``plan``, ``bench``, ``demo``."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]


def _plan(args: argparse.Namespace) -> int:
    from reshard.costmodel.report import plan_report

    report = plan_report(
        model=args.model,
        trainer=args.trainer,
        engine=args.engine,
        cluster=args.cluster,
        colocate=args.colocate,
        round_bytes=args.round_mib << 20,
        changed=args.changed,
    )
    if args.json:
        print(json.dumps(report.data, indent=2))
    else:
        print(report.table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="predict what a layout change costs on a described cluster")
    p.add_argument(
        "--model",
        required=True,
        help="preset name (llama3-8b, llama3-70b, qwen3-30b-a3b, qwen3-235b, deepseek-v3, kimi-k2) "
        "or a path to a config.json",
    )
    p.add_argument("--trainer", required=True, help="trainer degrees: fsdp=64 | tp=4,pp=8,ep=16[,etp=1][,dp=4]")
    p.add_argument("--engine", required=True, help="engine degrees: tp=8,dp=16[,ep=on]")
    p.add_argument(
        "--cluster",
        required=True,
        help="dgx-h100 | gb200-nvl72 | a description: gpus_per_host=4,nic_gbit=100,nvlink_gbyte=450"
        "[,nic_per_host=1][,broadcast=tree][,refit_seconds=0.25]... "
        "(a preset's fields changed: dgx-h100:nic_per_host=1)",
    )
    p.add_argument("--colocate", action="store_true", help="engine rank i shares GPU i with trainer rank i")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--round-mib", type=int, default=128, help="tensor data per round (MiB)")
    p.add_argument(
        "--changed",
        type=float,
        default=None,
        help="also predict a delta refit when this share of the elements changed (0.02: 2%%)",
    )
    p.set_defaults(func=_plan)
    sub.add_parser(
        "bench",
        help="reshard vs gather-and-broadcast on this machine; --engine vllm: into a real engine "
        "(see reshard bench --help)",
    )
    sub.add_parser("demo", help="train a tiny model and hot-swap it into a vLLM engine (see reshard demo --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        if any(a in ("delta", "--case=delta") for a in argv[1:]) and "--engine" not in argv:
            # Dense, delta and gather-and-broadcast refits after AdamW steps.
            from reshard.tools.delta_bench import main as delta_main

            return delta_main(argv[1:])
        if any(a == "--nodes" or a.startswith("--nodes=") for a in argv[1:]) and "--engine" not in argv:
            # Across nodes simulated by network namespaces.
            from reshard.tools.cluster_bench import main as cluster_main

            return cluster_main(argv[1:])
        from reshard.tools.bench import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "demo":
        from reshard.tools.demo import main as demo_main

        return demo_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"reshard {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
