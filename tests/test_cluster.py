"""Refits across hosts: nodes as network namespaces (reshard/testing/cluster.py).

The harness itself (isolated nodes, counters, cleanup also after SIGTERM and
SIGKILL), a gloo refit across three nodes (the store on one, trainer ranks
on a second, engine workers on a third, each reached by its own address)
bit for bit, and a link taken down mid-refit at a round fixed by the plan:
every rank fails naming the store or the peers it could not reach, and the
next refit works once the link is back. Skipped without root or iproute2.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reshard.testing.cluster import NETWORK, PREFIX, NodeCluster, remove_stale, unavailable
from reshard.testing.ports import free_port

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no node cluster here: {WHY}")

CASE = dict(
    hidden=256, heads=4, kv_heads=2, intermediate=512, layers=2, vocab=1024, trainer_ranks=2, engine_tp=2, engine_dp=1
)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _in(c: NodeCluster, i: int, code: str, timeout: float = 60) -> str:
    out = subprocess.run(
        c.nodes[i].command(sys.executable, "-c", code), capture_output=True, text=True, timeout=timeout, check=True
    )
    return out.stdout


def test_nodes_reach_each_other_only_inside_their_namespaces_and_are_removed():
    def addresses() -> str:
        return subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout

    root_addrs = addresses()
    with NodeCluster(2, rate="100mbit") as c:
        names = {n.netns for n in c.nodes} | {c.switch}
        assert names <= _namespaces()
        assert [n.address for n in c.nodes] == [f"{NETWORK}.1", f"{NETWORK}.2"]
        # Nothing of the cluster is visible in this process's namespace.
        assert f"{NETWORK}." not in addresses()
        assert addresses() == root_addrs
        before = c.counters()
        port = free_port()
        server = c.popen(
            c.nodes[1],
            [
                sys.executable,
                "-c",
                "import socket\n"
                f"s = socket.create_server(('{c.nodes[1].address}', {port}))\n"
                "print('up', flush=True)\n"
                "a, _ = s.accept(); n = 0\n"
                "while (d := a.recv(1 << 16)):\n    n += len(d)\n"
                "print(n, flush=True)\n",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "up"
        size = 4 << 20
        _in(c, 0, f"import socket; s = socket.create_connection(('{c.nodes[1].address}', {port})); "
                  f"s.sendall(bytes({size})); s.close()")  # fmt: skip
        assert int(server.stdout.readline()) == size
        server.wait(timeout=30)
        after = c.counters()
        assert after[0][0] - before[0][0] >= size  # out of node 0
        assert after[1][1] - before[1][1] >= size  # into node 1
        # Inside a node, its own address goes over its loopback, not its link.
        assert "127.0.0.1" in _in(c, 0, "import socket; print(socket.gethostbyname('localhost'))")
    assert not names & _namespaces()


@pytest.mark.parametrize("sig", ["TERM", "INT", "KILL"])
def test_a_killed_run_leaves_no_namespace_behind(sig):
    code = (
        "import sys, time\n"
        "from reshard.testing.cluster import NodeCluster\n"
        "c = NodeCluster(2)\n"
        "print(c.prefix, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        prefix = proc.stdout.readline().strip()
        assert prefix.startswith(PREFIX)
        assert any(n.startswith(prefix) for n in _namespaces())
        proc.send_signal(getattr(__import__("signal"), f"SIG{sig}"))
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig == "KILL":
        # Nothing ran in the killed process: the next run removes its leftovers.
        remove_stale()
    assert not any(n.startswith(prefix) for n in _namespaces())


def _results_of(procs, refit: int) -> dict[int, dict]:
    return {p.rank: r for p in procs for r in p.results if r["refit"] == refit}


def test_refit_across_hosts_bit_exact_and_a_link_down_mid_refit(tmp_path: Path):
    from reshard.tools.cluster_run import collect, start_ranks, start_store

    timeout_s = 20
    with NodeCluster(3, rate="200mbit") as c:
        port = free_port()
        store = start_store(c, c.nodes[0], port)
        spec = dict(
            address=f"{c.nodes[0].address}:{port}",
            case=CASE,
            timeout_s=timeout_s,
            round_bytes=64 * 1024,
            variants={"main": {"job": "cluster", "domains": ["node1", "node1", "node2", "node2"]}},
            hook={"refit": 2, "round": 0, "dir": str(tmp_path)},
            steps=[{"n": 1, "seed": 1}, {"n": 2, "seed": 2}, {"n": 3, "seed": 3, "gate": str(tmp_path / "up")}],
        )
        procs = start_ranks(c, [1, 1, 2, 2], spec)
        try:
            deadline = time.monotonic() + 240
            while not (tmp_path / "reached").exists():
                assert time.monotonic() < deadline and all(p.proc.poll() is None for p in procs), [
                    p.errors[-5:] for p in procs
                ]
                time.sleep(0.05)
            # Trainer rank 0 finished round 0 of refit 2 and waits: the
            # trainers' node loses its link, then the refit goes on.
            c.link(c.nodes[1], up=False)
            down = time.monotonic()
            (tmp_path / "go").touch()
            while len(_results_of(procs, 2)) < 4:
                assert time.monotonic() - down < 4 * timeout_s, [p.errors[-5:] for p in procs]
                time.sleep(0.1)
            c.link(c.nodes[1], up=True)
            (tmp_path / "up").touch()
            collect(procs, 240)
        finally:
            store.kill()
        assert c.counters()[1][0] > 0
    first, failed, after = (_results_of(procs, n) for n in (1, 2, 3))
    assert all(p.proc.returncode == 0 for p in procs), [p.errors[-10:] for p in procs]
    for r in (2, 3):
        assert first[r]["ok"] and first[r]["correct"], first[r]
        assert after[r]["ok"] and after[r]["correct"], after[r]
        # An engine worker learns which trainer ranks it lost.
        assert "ranks [0" in failed[r]["error"] or "ranks 0-1" in failed[r]["error"], failed[r]["error"]
    for r in (0, 1):
        assert first[r]["ok"] and after[r]["ok"]
        # The trainers' node lost everything: the store's address is named.
        assert spec["address"] in failed[r]["error"], failed[r]["error"]
    for r in range(4):
        assert not failed[r]["ok"]
        assert "step 'transfer'" in failed[r]["error"]
        # Within the timeout, plus the grace an agreement gives the ranks'
        # statuses after an abort (transport.group.ABORT_GRACE_S).
        assert failed[r]["seconds"] < timeout_s + 10 + 15, failed[r]
    print(json.dumps({r: round(failed[r]["seconds"], 1) for r in failed}))


_TRAINER = (
    "import json, sys\n"
    "from tests.vllm_support import fsdp_trainer\n"
    "print('RESULT ' + json.dumps(fsdp_trainer(*json.loads(sys.argv[1]))), flush=True)\n"
)


ENGINE_TP = 2


def _fresh(rank: int, path: str) -> dict:
    """Greedy tokens and every worker's state of a fresh TP=ENGINE_TP engine on ``path``."""
    from reshard.adapters.vllm.driver import engine_state
    from reshard.testing.engines import greedy, shutdown
    from tests.vllm_support import make_llm

    llm = make_llm(path, ENGINE_TP, extension="reshard.adapters.vllm.ReshardWorkerExtension")
    try:
        return {"tokens": greedy(llm), "state": engine_state(llm)}
    finally:
        shutdown(llm)


def test_vllm_engine_on_another_host_refit_equals_a_fresh_engine(tmp_path: Path):
    """A real ``vllm serve`` with TP=2 on node 2, reached only at its node's
    address; the store on node 0; 2 FSDP2 trainer ranks on node 1, rank 0
    driving the server over HTTP. Afterwards the server's whole state (both
    workers'), read over HTTP from node 1, is a fresh engine's."""
    import os

    from reshard.adapters.core.state import compare_states
    from reshard.adapters.vllm.driver import HttpEngine, engine_state
    from reshard.testing import build_tiny_model
    from reshard.tools.cluster_run import start_store
    from tests import procs
    from tests.vllm_support import VllmServer, server_greedy

    v1 = build_tiny_model(tmp_path / "v1", "qwen2", seed=0)
    v2 = build_tiny_model(tmp_path / "v2", "qwen2", seed=7)
    fresh = procs.check(procs.run(_fresh, 1, str(v2), timeout=600, daemon=False))[0]
    with NodeCluster(3) as c:
        port = free_port()
        store = start_store(c, c.nodes[0], port)
        srv = VllmServer(
            str(v1),
            tp=ENGINE_TP,
            dtype="float32",
            log=str(tmp_path / "server.log"),
            args=["--worker-extension-cls", "reshard.adapters.vllm.ReshardWorkerExtension"],
            node=c.nodes[2],
        )
        try:
            before = c.nodes[1].call(server_greedy, srv.url)
            assert before != fresh["tokens"], "the two checkpoints must generate differently"
            repo = str(Path(__file__).resolve().parents[1])
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
            pg_port = free_port()  # the trainers' own gloo group, on node 1's loopback
            store_address = f"{c.nodes[0].address}:{port}"
            trainers = [
                c.popen(
                    c.nodes[1],
                    [
                        sys.executable,
                        "-c",
                        _TRAINER,
                        json.dumps([r, store_address, pg_port, str(v2), 2, ENGINE_TP, 1, 0, "", srv.url]),
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                )
                for r in range(2)
            ]
            outs = [t.communicate(timeout=600) for t in trainers]
            results = [
                json.loads(o.split("RESULT ", 1)[1].splitlines()[0]) if "RESULT " in o else e[-3000:] for o, e in outs
            ]
            assert all(isinstance(r, dict) and r["ok"] for r in results), results
            workers = results[0]["engine_stats"]
            assert len(workers) == ENGINE_TP and all(w["ok"] for w in workers)
            assert all(w["bytes_received"] == w["kept_bytes"] for w in workers)
            assert c.nodes[1].call(server_greedy, srv.url) == fresh["tokens"]
            ours = c.nodes[1].call(engine_state, HttpEngine(srv.url))
            assert len(ours) == len(fresh["state"]) == ENGINE_TP
            for mine, theirs in zip(ours, fresh["state"], strict=True):
                assert not compare_states(mine, theirs)
            # The bytes crossed node links: node 2 took in at least what its workers kept.
            assert c.counters()[2][1] >= sum(w["kept_bytes"] for w in workers)
        finally:
            srv.close()
            store.kill()
