"""``reshard bench --nodes N --link RATE``: refits across simulated nodes.

Builds a :class:`~reshard.testing.cluster.NodeCluster` (N network
namespaces on one bridge, each node's link shaped to RATE with ``tc``; root
and iproute2 needed), puts one trainer rank on each of the first
``--trainer-nodes`` nodes (FSDP2 ``Shard(0)``) and ``--replicas`` engine
replicas (vLLM TP=``--engine-tp`` layouts) on each other node, the refit
store on node 0, and runs in one run, alternating:

- ``leaders``: reshard with domains = nodes (one rank per engine node pulls
  each replicated slice over the node's link and forwards it over the node's
  loopback),
- ``self``: reshard with every engine rank its own domain (every replica
  pulls for itself over the link),
- ``gather_broadcast``: the baseline,
- ``delta``: a delta refit (domains = nodes) at ``--changed`` of the
  elements changed since the refit before (the first one dense),

then a raw point-to-point transfer over the group between one trainer rank
and one engine rank per trainer node, all at once (what the links move).
Bytes over node links come from the kernel's counters of each node's link,
read between steps (every step runs alone). Beside each median time,
``reshard plan``'s model predicts the same cluster: NICs shared per node at
the link's rate, the loopback's rate measured on the spot, gloo's tree
broadcast, and a fixed per-refit cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "measure_loopback", "run_cluster_bench"]

METHODS = ("leaders", "self", "gather_broadcast")


def measure_loopback(cluster: Any, size: int = 256 << 20) -> float:
    """Bytes/s two processes move over a node's loopback (one TCP stream)."""
    node = cluster.nodes[0]
    code = (
        "import socket, sys, time\n"
        f"s = socket.create_server(('127.0.0.1', 0)); port = s.getsockname()[1]\n"
        "import os\n"
        "if os.fork() == 0:\n"
        "    c = socket.create_connection(('127.0.0.1', port)); buf = bytes(1 << 22)\n"
        f"    for _ in range({size} // len(buf)): c.sendall(buf)\n"
        "    c.close(); os._exit(0)\n"
        "a, _ = s.accept(); buf = bytearray(1 << 22); n = 0; t0 = time.perf_counter()\n"
        "while (k := a.recv_into(buf)):\n    n += k\n"
        "print(n / (time.perf_counter() - t0))\n"
    )
    rates = []
    for _ in range(3):
        out = subprocess.run(node.command(sys.executable, "-c", code), capture_output=True, text=True, check=True)
        rates.append(float(out.stdout.strip()))
    return max(rates)


def _memcpy_rate(size: int = 128 << 20) -> float:
    import torch

    a = torch.ones(size, dtype=torch.uint8)
    b = torch.empty_like(a)
    best = float("inf")
    for i in range(4):
        t0 = time.perf_counter()
        b.copy_(a)
        if i:
            best = min(best, time.perf_counter() - t0)
    return size / best


def _layout(args: argparse.Namespace) -> dict[str, Any]:
    t_nodes, nodes, r, tp = args.trainer_nodes, args.nodes, args.replicas, args.engine_tp
    e_nodes = nodes - t_nodes
    world_e = e_nodes * r * tp
    node_of = list(range(t_nodes)) + [t_nodes + j // (r * tp) for j in range(world_e)]
    case = dict(
        hidden=args.hidden,
        heads=args.hidden // 64,
        kv_heads=max(1, args.hidden // 128),
        intermediate=args.intermediate,
        layers=args.layers,
        vocab=args.vocab,
        trainer_ranks=t_nodes,
        engine_tp=tp,
        engine_dp=e_nodes * r,
    )
    nodes_label = [f"node{n}" for n in node_of]
    own = [f"node{n}" if i < t_nodes else f"rank{i}" for i, n in enumerate(node_of)]
    return {"node_of": node_of, "case": case, "leaders": nodes_label, "self": own}


def _steps(args: argparse.Namespace) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = []
    n = 0
    seed = 10
    for rep in range(args.warmup + args.reps):
        for m in METHODS:
            n += 1
            seed += 1
            variant = "self" if m == "self" else "leaders"
            method = "gather_broadcast" if m == "gather_broadcast" else "reshard"
            last = rep == args.warmup + args.reps - 1
            steps.append(dict(n=n, seed=seed, variant=variant, method=method, name=m, rep=rep, check=last))
    half = args.changed / 2  # two sets of changed positions differ between refits: about `changed` in all
    # The first delta refit is dense (no base yet), the second compiles the
    # sparse encoders (numba): neither is measured, whatever --warmup says.
    for k in range(2 + args.warmup + args.reps):
        n += 1
        steps.append(
            dict(
                n=n,
                seed=k + 1,
                base_seed=777,
                changed=half,
                variant="delta",
                method="reshard",
                name="delta",
                rep=k - 2,
                check=k == 1 + args.warmup + args.reps,
                zero=False,
            )
        )
    # A delta refit of values that did not change moves headers only: what a
    # refit costs here beyond its link bytes (the control plane, and the
    # delta's digests and compares of every slice), the model's fixed cost.
    last = steps[-1]
    for rep in range(args.warmup + args.reps):
        n += 1
        steps.append(dict(last, n=n, name="unchanged", rep=rep, check=False))
    return steps


def run_cluster_bench(args: argparse.Namespace) -> dict[str, Any]:
    from reshard.testing.cluster import NodeCluster, rate_bytes_per_s
    from reshard.testing.ports import free_port
    from reshard.tools.cluster_run import collect, start_ranks, start_store

    lay = _layout(args)
    steps = _steps(args)
    work = Path(tempfile.mkdtemp(prefix="reshard-cluster-"))
    for s in steps:
        s["gate"] = str(work / f"gate{s['n']}")
    with NodeCluster(args.nodes) as c:
        loop = measure_loopback(c)
        link = args.link if args.link != "auto" else f"{int(loop * 8 / args.ratio / 1e6)}mbit"
        c.rate = link
        for node in c.nodes:
            c.shape(node)
        port = free_port()
        store = start_store(c, c.nodes[0], port)
        t_nodes = args.trainer_nodes
        first_engine = {n: lay["node_of"].index(n) for n in range(t_nodes, args.nodes)}
        pairs = [[t, first_engine[t_nodes + t % (args.nodes - t_nodes)]] for t in range(t_nodes)]
        spec = dict(
            address=f"{c.nodes[0].address}:{port}",
            case=lay["case"],
            timeout_s=args.timeout,
            variants={
                "leaders": {"job": "leaders", "domains": lay["leaders"]},
                "self": {"job": "self", "domains": lay["self"]},
                "delta": {"job": "delta", "domains": lay["leaders"], "delta": True},
            },
            steps=steps,
            raw={"variant": "leaders", "pairs": pairs, "bytes": args.raw_mb << 20},
        )
        procs = start_ranks(c, lay["node_of"], spec)
        link_bytes: dict[int, dict[str, int]] = {}
        try:
            for s in steps:
                before = c.counters()
                Path(s["gate"]).touch()
                deadline = time.monotonic() + args.timeout * 3
                while sum(1 for p in procs for r in p.results if r["refit"] == s["n"]) < len(procs):
                    if time.monotonic() > deadline or any(p.proc.poll() is not None for p in procs):
                        raise RuntimeError(f"step {s} did not finish: {[p.errors[-6:] for p in procs]}")
                    time.sleep(0.02)
                after = c.counters()
                link_bytes[s["n"]] = {
                    "into_nodes": sum(after[i][1] - before[i][1] for i in after),
                    "into_engine_nodes": sum(after[i][1] - before[i][1] for i in after if i >= t_nodes),
                }
            collect(procs, args.timeout * 3)
        finally:
            store.kill()
    out = _summarize(args, lay, steps, procs, link_bytes, loop, link)
    if args.refit_seconds is None:
        args.refit_seconds = out["methods"]["unchanged"]["seconds_median"] or 0.0
    out["refit_seconds"] = args.refit_seconds
    out["memcpy_bytes_per_s"] = memcpy = _memcpy_rate()
    out["prediction"] = predict(args, lay, loop, rate_bytes_per_s(link), memcpy)
    return out


def _summarize(args, lay, steps, procs, link_bytes, loop, link) -> dict[str, Any]:
    by_n: dict[int, list[dict]] = {}
    for p in procs:
        for r in p.results:
            by_n.setdefault(r["refit"], []).append(r)
    t = args.trainer_nodes
    methods: dict[str, Any] = {}
    for name in (*METHODS, "delta", "unchanged"):
        runs = [s for s in steps if s["name"] == name and s["rep"] >= args.warmup]
        times, into, engine_in, ok, correct = [], [], [], True, True
        for s in runs:
            rs = by_n[s["n"]]
            ok = ok and all(r["ok"] for r in rs)
            if not all(r["ok"] for r in rs):
                continue
            times.append(max(r["stats"]["finished_at"] for r in rs) - max(r["stats"]["started_at"] for r in rs))
            into.append(link_bytes[s["n"]]["into_nodes"])
            engine_in.append(link_bytes[s["n"]]["into_engine_nodes"])
            if s["check"]:
                correct = all(r.get("correct", True) for r in rs if r["rank"] >= t)
        errors = sorted({r.get("error", "")[:300] for s in runs for r in by_n[s["n"]] if not r["ok"]})
        methods[name] = {
            "seconds_median": statistics.median(times) if times else None,
            "seconds_all": times,
            "link_bytes_median": statistics.median(into) if into else None,
            "engine_node_ingress_median": statistics.median(engine_in) if engine_in else None,
            "ok": ok,
            "correct": correct,
            "errors": errors,
        }
    raw = [p.raw for p in procs if p.raw and p.raw["rank"] < t]
    raw_rate = min(r["bytes"] / r["seconds"] for r in raw) if raw else None
    return {
        "nodes": args.nodes,
        "trainer_nodes": t,
        "replicas_per_node": args.replicas,
        "engine_tp": args.engine_tp,
        "case": lay["case"],
        "link": link,
        "loopback_bytes_per_s": loop,
        "raw_pair_bytes_per_s": raw_rate,
        "methods": methods,
        "reps": args.reps,
        "warmup": args.warmup,
        "changed": args.changed,
    }


def predict(args, lay, loop: float, link_bps: float, memcpy: float) -> dict[str, float]:
    """``reshard plan``'s model of the same cluster (seconds per method)."""
    from reshard.costmodel.cluster import Cluster, Deployment
    from reshard.costmodel.cost import gather_broadcast_cost, reshard_cost
    from reshard.costmodel.delta import DeltaAssumptions, delta_cost
    from reshard.costmodel.rules import EngineSpec, TrainerSpec, engine_layouts, trainer_layouts
    from reshard.plan.planner import Planner
    from reshard.tools.bench import BenchCase, bench_tensors

    case = BenchCase(name="cluster", **lay["case"])
    metas = bench_tensors(case)
    t = case.trainer_ranks
    t_side = trainer_layouts(metas, case.config, TrainerSpec(fsdp=t))
    e_side = engine_layouts(metas, case.config, EngineSpec(tp=case.engine_tp, dp=case.engine_dp), base=t)
    cl = Cluster(
        name="netns",
        gpus_per_host=max(1, args.replicas * args.engine_tp),
        hosts_per_domain=1,
        nic_gbit=link_bps * 8 / 1e9,
        nvlink_gbyte=loop / 1e9,
        hbm_gbyte=memcpy / 1e9,
        nic_per_host=True,
        broadcast="tree",
        refit_seconds=args.refit_seconds,
        round_latency_s=1e-3,
        message_latency_s=1e-3,
    )
    out: dict[str, float] = {}
    world = len(lay["node_of"])
    for name in ("leaders", "self"):
        labels = lay[name]
        index = {lab: i for i, lab in enumerate(sorted(set(labels)))}
        dom = tuple(index[lab] for lab in labels)
        placement = Deployment(
            gpu_of=tuple(range(world)),
            host_of=tuple(lay["node_of"]),
            domain_of=dom,
            trainer_ranks=range(t),
            engine_ranks=range(t, world),
        )
        sources = t_side.layout_set("source", check_ranks=())
        planner = Planner(sources, e_side.layout_set("destination", check_ranks=()), domain_of=dom.__getitem__)
        traffic = planner.traffic()
        out[name] = reshard_cost(traffic, cl, placement).estimated_seconds
        if name == "leaders":
            out["gather_broadcast"] = gather_broadcast_cost(
                t_side.stages, sources, placement.engine_ranks, cl, placement
            ).estimated_seconds
            a = DeltaAssumptions(changed=args.changed, compare_bytes_per_s=memcpy / 4, digest_bytes_per_s=memcpy)
            out["delta"] = delta_cost(traffic, cl, placement, a).estimated_seconds
            out["leaders_network_bytes"] = reshard_cost(traffic, cl, placement).network_bytes
        else:
            out["self_network_bytes"] = reshard_cost(traffic, cl, placement).network_bytes
    return out


def format_result(res: dict[str, Any]) -> str:
    mb = 1e6
    case = res["case"]
    lines = [
        f"{res['nodes']} nodes: {res['trainer_nodes']} trainer nodes (1 rank each, fsdp={res['trainer_nodes']}), "
        f"{res['nodes'] - res['trainer_nodes']} engine nodes x {res['replicas_per_node']} replicas "
        f"(tp={res['engine_tp']}); links {res['link']} each way, loopback {res['loopback_bytes_per_s'] * 8 / 1e9:.2f} "
        f"Gb/s measured; model hidden {case['hidden']}, {case['layers']} layers, vocab {case['vocab']} (bf16); "
        f"{res['reps']} runs after {res['warmup']} warm-up",
        f"{'method':<18}{'median s':>10}{'predicted s':>13}{'pred/meas':>10}{'link MB':>10}{'into engine nodes MB':>22}"
        f"{'correct':>9}",
    ]
    pred = res["prediction"]
    for name, m in res["methods"].items():
        if name == "unchanged":
            continue
        s = m["seconds_median"]
        p = pred.get(name)
        lines.append(
            f"{name:<18}{(s or float('nan')):>10.3f}{(p or float('nan')):>13.3f}"
            f"{(p / s if s and p else float('nan')):>10.2f}{(m['link_bytes_median'] or 0) / mb:>10.1f}"
            f"{(m['engine_node_ingress_median'] or 0) / mb:>22.1f}{m['correct'] and m['ok']!s:>9}"
        )
        for e in m["errors"]:
            lines.append(f"    error: {e}")
    ms = res["methods"]
    if ms["leaders"]["seconds_median"] and ms["self"]["seconds_median"]:
        lines.append(
            f"leaders vs every replica pulling: {ms['self']['seconds_median'] / ms['leaders']['seconds_median']:.2f}x "
            f"faster, {ms['leaders']['engine_node_ingress_median'] / ms['self']['engine_node_ingress_median']:.3f}x "
            "the bytes into engine nodes"
        )
    if ms["leaders"]["seconds_median"] and ms["gather_broadcast"]["seconds_median"]:
        lines.append(
            f"reshard (leaders) vs gather-and-broadcast: "
            f"{ms['gather_broadcast']['seconds_median'] / ms['leaders']['seconds_median']:.2f}x"
        )
    if ms["delta"]["seconds_median"] and ms["leaders"]["seconds_median"]:
        lines.append(
            f"delta refit at ~{100 * res['changed']:g}% changed: "
            f"{ms['delta']['seconds_median'] / ms['leaders']['seconds_median']:.2f}x a dense refit's time"
        )
    lines.append(
        f"fixed cost per refit (a delta refit of unchanged values, in the model): {res['refit_seconds']:.3f} s; "
        f"memory copy {res['memcpy_bytes_per_s'] / 1e9:.1f} GB/s (the model's compare and digest rates)"
    )
    if res["raw_pair_bytes_per_s"]:
        raw = res["raw_pair_bytes_per_s"]
        lead = ms["leaders"]
        line = f"raw point-to-point over one link: {raw * 8 / 1e6:.0f} Mb/s per pair (all trainer nodes at once)"
        if lead["seconds_median"]:
            per_node = lead["engine_node_ingress_median"] / (res["nodes"] - res["trainer_nodes"])
            fill = per_node / lead["seconds_median"] / raw
            line += f"; reshard (leaders) fills each engine node's link at {fill:.2f}x that"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="reshard bench --nodes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nodes", type=int, required=True, help="nodes in all (trainer nodes first)")
    ap.add_argument("--link", default="auto", help="tc rate of every node's link (e.g. 400mbit); auto: loopback/ratio")
    ap.add_argument("--ratio", type=float, default=16.0, help="loopback rate over link rate for --link auto")
    ap.add_argument("--trainer-nodes", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=4, help="engine replicas per engine node")
    ap.add_argument("--engine-tp", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--changed", type=float, default=0.01, help="share of elements a delta refit changes")
    ap.add_argument("--raw-mb", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument(
        "--refit-seconds",
        type=float,
        default=None,
        help="the model's fixed cost per refit (default: measured, a delta refit of unchanged values)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.nodes - args.trainer_nodes < 1:
        ap.error("--nodes must leave at least one engine node after --trainer-nodes")
    res = run_cluster_bench(args)
    print(json.dumps(res, indent=2) if args.json else format_result(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
