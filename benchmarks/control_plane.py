"""The refit control plane at scale: what one rank reads and writes on the
store per refit (not a test).

A real TCPStore and one lightweight client per rank (a thread each, no
process group, no tensors) run the agreements of one refit as
:class:`reshard.transport.session.RefitSession` runs them: ``enter`` (the
refit number, the last refit, every layout digest held alike), ``plan``
(each rank's per-peer message summaries), ``links`` (each rank's check of
its own pairs) and ``transfer``. Every rank has the same number of peers
(``--peers``) whatever the world. Counted for one trainer rank and one
engine rank: store round trips and bytes sent and received, polls (the
waits' reads of one counter, the abort key and the epoch) apart, since
their number depends on how long the slowest rank takes.

    python benchmarks/control_plane.py [--worlds 64,256,1024] [--peers 8]

``--legacy REV`` runs the same refit with the agreement of git revision
``REV`` (every rank reads every status: its checks poll every status key),
from a worktree, for the same table.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

POLLS = ("check", "add0", "get_epoch")


@dataclass
class Counts:
    ops: int = 0
    sent: int = 0
    received: int = 0
    polls: int = 0
    poll_bytes: int = 0
    by_op: dict[str, int] = field(default_factory=dict)
    read: list[str] = field(default_factory=list)
    """Keys whose values this rank read, in order."""


class CountingStore:
    """A store client that counts round trips and bytes (keys and values
    sent, values received) by operation."""

    def __init__(self, inner: Any, counts: Counts | None) -> None:
        self.inner = inner
        self.counts = counts

    def _count(self, op: str, sent: int, received: int = 0) -> None:
        c = self.counts
        if c is None:
            return
        if op in POLLS:
            c.polls += 1
            c.poll_bytes += sent + received
            return
        c.ops += 1
        c.sent += sent
        c.received += received
        c.by_op[op] = c.by_op.get(op, 0) + 1

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(key, value)
        self._count("set", len(key) + len(value))

    def get(self, key: str) -> bytes:
        v = self.inner.get(key)
        self._count("get_epoch" if key.endswith("epoch") else "get", len(key), len(v))
        return v

    def multi_get(self, keys: list[str]) -> list[bytes]:
        vs = self.inner.multi_get(keys)
        self._count("multi_get", sum(map(len, keys)), sum(map(len, vs)))
        if self.counts is not None:
            self.counts.read.extend(keys)
        return vs

    def check(self, keys: list[str]) -> bool:
        r = self.inner.check(keys)
        self._count("check", sum(map(len, keys)), 1)
        return r

    def add(self, key: str, n: int) -> int:
        r = self.inner.add(key, n)
        self._count("add0" if n == 0 else "add", len(key) + 8, 8)
        return r

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        r = self.inner.compare_set(key, expected, desired)
        self._count("compare_set", len(key) + len(expected) + len(desired), len(r))
        return r

    def append(self, key: str, value: str) -> None:
        self.inner.append(key, value)
        self._count("append", len(key) + len(value))

    def delete_key(self, key: str) -> bool:
        r = self.inner.delete_key(key)
        self._count("delete_key", len(key), 1)
        return r

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _peers(rank: int, world: int, sources: int, n: int) -> list[int]:
    """``n`` peers on the other side, spread over it (the same count for every rank)."""
    if rank < sources:
        side = list(range(sources, world))
    else:
        side = list(range(sources))
    step = max(1, len(side) // n)
    start = (rank * 7) % len(side)
    return sorted({side[(start + i * step) % len(side)] for i in range(min(n, len(side)))})


def _refit(group: Any, wire: Any, world: int, peers: list[int], legacy: bool) -> None:
    """One refit's agreements, as the session runs them."""
    import msgspec

    rank = group.rank
    digests = [f"{r:032x}" for r in range(world)]
    counted = "peers" in inspect.signature(group.agree).parameters
    enter = wire.Status(rank=rank, step="enter", refit=2, ok=True, last_refit=1, layout=digests[rank])
    summary = {p: (3, 1 << 20, 0x5EED) for p in peers}
    plan = wire.Status(rank=rank, step="plan", refit=2, ok=True, staging_need=1 << 20, sends=summary, recvs=summary)
    group.begin()
    if legacy or not counted:
        group.agree("enter", 2, enter)
        group.agree("plan", 2, plan)
        group.agree("transfer", 2, wire.Status(rank=rank, step="transfer", refit=2, ok=True))
        return
    common = msgspec.msgpack.encode((2, 1, digests))
    group.agree("enter", 2, enter, peers=(), common=common)
    group.agree("plan", 2, plan, peers=peers)
    group.agree("links", 2, wire.Status(rank=rank, step="links", refit=2, ok=True), peers=())
    group.agree("transfer", 2, wire.Status(rank=rank, step="transfer", refit=2, ok=True), peers=())


def measure(world: int, n_peers: int, legacy: bool) -> dict[str, Any]:
    import datetime

    from torch.distributed import PrefixStore, TCPStore

    from reshard.testing.ports import free_port
    from reshard.transport import wire
    from reshard.transport.auth import job_keys
    from reshard.transport.config import GroupConfig
    from reshard.transport.group import RefitGroup

    sources = world // 2
    port = free_port()
    server = TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=600), use_libuv=True)
    cfg = GroupConfig(address=f"127.0.0.1:{port}", num_sources=sources, num_destinations=world - sources, timeout_s=600)
    keys = job_keys(None, "cp", 0)
    watched = {0: Counts(), sources: Counts()}
    groups = []
    for r in range(world):
        client = TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=600), use_libuv=True)
        groups.append(
            RefitGroup(
                config=cfg,
                rank=r,
                role="source" if r < sources else "destination",
                store=CountingStore(PrefixStore("e0", client), watched.get(r)),
                pg=None,
                backend="gloo",
                keys=keys,
                epoch=0,
                # The waits watch the job's epoch here (counted as polls).
                _ns=CountingStore(client, watched.get(r)),
                _tcp_store=client,
            )
        )
    server.set("epoch", "0")
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(_refit, g, wire, world, _peers(g.rank, world, sources, n_peers), legacy) for g in groups]
        for f in futures:
            f.result()
    seconds = time.perf_counter() - t0
    out = {"world": world, "peers": n_peers, "legacy": legacy, "seconds": round(seconds, 2), "ranks": {}}
    for r, c in watched.items():
        out["ranks"][str(r)] = {
            "role": "trainer" if r < sources else "engine",
            "round_trips": c.ops,
            "bytes_sent": c.sent,
            "bytes_received": c.received,
            "polls": c.polls,
            "bytes_per_poll": round(c.poll_bytes / max(c.polls, 1)),
            "by_op": c.by_op,
            "read": c.read,
            "peers": _peers(r, world, sources, n_peers),
        }
    for g in groups:
        with contextlib.suppress(Exception):
            g._tcp_store = None
    del groups, server
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="64,256,1024")
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--legacy", metavar="REV", help="also measure the agreement of git revision REV")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--_one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    threading.stack_size(256 << 10)
    if args._one:
        world, legacy = args._one.split(":")
        print(json.dumps(measure(int(world), args.peers, legacy == "1")))
        return
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        rows.append(_run_one(world, args.peers, None))
        if args.legacy:
            rows.append(_run_one(world, args.peers, args.legacy))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"control plane of one refit, per rank; every rank has {args.peers} peers")
    print(
        f"{'world':>6} {'code':>10} {'rank':>8} {'round trips':>12} {'KB sent':>9} {'KB received':>12} "
        f"{'polls':>6} {'B/poll':>7} {'s':>6}"
    )
    for row in rows:
        if "error" in row:
            print(f"{row['world']:>6} {row['code']:>10}  did not finish: {row['error'][:150]}")
        for c in row["ranks"].values():
            print(
                f"{row['world']:>6} {row['code']:>10} {c['role']:>8} {c['round_trips']:>12} "
                f"{c['bytes_sent'] / 1e3:>9.1f} {c['bytes_received'] / 1e3:>12.1f} {c['polls']:>6} "
                f"{c['bytes_per_poll']:>7} {row['seconds']:>6.1f}"
            )


def _run_one(world: int, peers: int, rev: str | None) -> dict[str, Any]:
    """One world in a fresh process (its own threads and sockets), with this
    checkout's code or with revision ``rev``'s (a temporary worktree)."""
    env = dict(os.environ)
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True).stdout
    repo = repo.strip()
    with tempfile.TemporaryDirectory() as tmp:
        root = repo
        if rev is not None:
            root = os.path.join(tmp, "wt")
            subprocess.run(["git", "worktree", "add", "--detach", "-q", root, rev], cwd=repo, check=True)
        try:
            env["PYTHONPATH"] = root
            script = os.path.join(repo, "benchmarks", "control_plane.py")
            cmd = [sys.executable, script, f"--_one={world}:{int(rev is not None)}", f"--peers={peers}"]
            done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, cwd=root)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["?"])[-1]
                row = {"world": world, "peers": peers, "error": last, "ranks": {}, "seconds": 0.0}
            else:
                row = json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            if rev is not None:
                subprocess.run(["git", "worktree", "remove", "--force", root], cwd=repo, check=False)
    row["code"] = rev or "this"
    return row


if __name__ == "__main__":
    main()
