"""Refit ranks started on the nodes of a :class:`~reshard.testing.cluster.NodeCluster`.

:func:`start_store` starts the refit store on one node; :func:`start_ranks`
starts one :mod:`reshard.tools.cluster_rank` process per rank, each inside
its node's namespace; :func:`collect` waits for them (killing every one on
a timeout) and parses what each printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from reshard.testing.cluster import Node, NodeCluster

__all__ = ["RankProc", "collect", "start_ranks", "start_store"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("GLOO_SOCKET_IFNAME", None)
    return env


@dataclass
class RankProc:
    rank: int
    node: Node
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)

    def _read(self, stream: Any, into: list[str]) -> None:
        for line in stream:
            into.append(line.rstrip("\n"))

    def start_reading(self) -> None:
        for stream, into in ((self.proc.stdout, self.lines), (self.proc.stderr, self.errors)):
            th = threading.Thread(target=self._read, args=(stream, into), daemon=True)
            th.start()
            self.readers.append(th)

    @property
    def results(self) -> list[dict[str, Any]]:
        return [json.loads(x[7:]) for x in self.lines if x.startswith("RESULT ")]

    @property
    def raw(self) -> dict[str, Any] | None:
        raws = [json.loads(x[4:]) for x in self.lines if x.startswith("RAW ")]
        return raws[0] if raws else None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _start(cluster: NodeCluster, node: Node, spec: dict[str, Any], rank: int) -> RankProc:
    proc = cluster.popen(
        node,
        [sys.executable, "-m", "reshard.tools.cluster_rank"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(spec) + "\n")
    proc.stdin.flush()
    rp = RankProc(rank, node, proc)
    rp.start_reading()
    return rp


def start_store(cluster: NodeCluster, node: Node, port: int, timeout: float = 120) -> RankProc:
    """The refit store on ``node`` at ``node.address:port`` (closed by :meth:`RankProc.kill`
    or by closing its stdin)."""
    rp = _start(cluster, node, {"store": f"{node.address}:{port}"}, -1)
    deadline = time.monotonic() + timeout
    while "READY" not in rp.lines:
        if rp.proc.poll() is not None or time.monotonic() > deadline:
            rp.kill()
            raise RuntimeError(f"the store on node {node.index} did not start: {' '.join(rp.errors[-5:])}")
        time.sleep(0.05)
    return rp


def start_ranks(cluster: NodeCluster, node_of: list[int], spec: dict[str, Any]) -> list[RankProc]:
    """Rank ``r`` on node ``node_of[r]``, running ``spec`` (with its ``rank``);
    ``spec["domains"]``, when given, sets each variant's domain per rank."""
    procs = []
    try:
        for r, n in enumerate(node_of):
            s = dict(spec, rank=r)
            s["variants"] = {
                name: dict(v, domain=v["domains"][r]) if "domains" in v else v for name, v in spec["variants"].items()
            }
            procs.append(_start(cluster, cluster.nodes[n], s, r))
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return procs


def collect(procs: list[RankProc], timeout: float) -> list[RankProc]:
    """Wait for every rank to exit (all are killed past ``timeout``; ``RuntimeError`` then)."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            left = deadline - time.monotonic()
            try:
                p.proc.wait(timeout=max(0.1, left))
            except subprocess.TimeoutExpired:
                tails = {q.rank: q.errors[-8:] for q in procs if q.proc.poll() is None}
                raise RuntimeError(f"ranks still running after {timeout} s: {tails}") from None
        for p in procs:
            for th in p.readers:
                th.join(timeout=10)
    finally:
        for p in procs:
            p.kill()
    return procs
