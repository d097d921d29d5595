"""A cluster on one machine: nodes as Linux network namespaces.

Each node is a network namespace with its own address (``10.249.0.<i+1>/24``)
and its own loopback: ranks in one node reach each other (and the node's own
address) over that loopback, never over a link. Nodes are joined by veth
pairs to a bridge inside a switch namespace of their own, so no address, route
or link of the machine's own namespace is touched and no packet can leave the
machine. Each node's link can be shaped with ``tc``: a token bucket (``tbf``)
at ``rate`` in both directions (the node's side and the switch's side of its
veth), and a ``netem`` delay.

Every namespace and link a :class:`NodeCluster` creates carries one name
prefix, unique to the run (``rsc<pid>``, plus a counter): ``close()`` removes
them (and kills what still runs inside), and so do ``atexit`` (Ctrl-C
included) and SIGTERM/SIGHUP handlers; a new cluster
first removes what runs of dead processes left behind (a ``kill -9`` leaves
its namespaces to the next run). Deleting a namespace deletes the veth ends
inside it, and their peers with them.

It needs root and iproute2 (``ip``, ``tc``); :func:`unavailable` says why
a run cannot have it (tests skip with that reason).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["NETWORK", "Node", "NodeCluster", "call_in", "link_counters", "unavailable"]

NETWORK = "10.249.0"
"""The /24 every node's address comes from (``10.249.0.<i+1>``): an address
that exists only inside the namespaces a cluster creates."""

PREFIX = "rsc"
"""Every namespace and link name a cluster creates starts with this, then
the creating process's id: ``rsc<pid>x<k>n<i>`` (a node), ``...sw`` (the
switch), veth ends ``...n<i>`` inside the node, ``...s<i>`` on the switch."""

_NAME = re.compile(rf"^{PREFIX}(\d+)x\d+")
_lock = threading.Lock()
_live: list[NodeCluster] = []
_state = {"count": 0, "handlers": 0}


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def unavailable() -> str | None:
    """Why this process cannot build a cluster (``None`` when it can)."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or in a container with CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"iproute2's `{tool}` is not installed (apt-get install iproute2)"
    probe = f"{PREFIX}{os.getpid()}probe"
    out = _run("ip", "netns", "add", probe, check=False)
    if out.returncode != 0:
        return f"`ip netns add` is refused here: {out.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove the namespaces that clusters of processes no longer running
    left behind (their links go with them); the names removed."""
    out = _run("ip", "netns", "list", check=False).stdout
    gone = []
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            kill_inside(name)
            _run("ip", "netns", "del", name, check=False)
            gone.append(name)
    return gone


def kill_inside(netns: str) -> None:
    """Kill every process still running inside ``netns`` (one this module created)."""
    out = _run("ip", "netns", "pids", netns, check=False).stdout
    for pid in (int(x) for x in out.split() if x.isdigit()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _cleanup_all() -> None:
    for c in list(_live):
        c.close()


def _on_signal(signum: int, frame: Any) -> None:
    _cleanup_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    if _state["handlers"]:
        return
    _state["handlers"] = 1
    atexit.register(_cleanup_all)
    if threading.current_thread() is threading.main_thread():
        # SIGINT raises KeyboardInterrupt, which unwinds through close() and
        # atexit already; SIGTERM and SIGHUP would end the process without either.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _on_signal)


@dataclass(frozen=True, slots=True)
class Node:
    index: int
    netns: str
    address: str
    veth: str
    """This node's end of its link (inside the node's namespace)."""
    switch_veth: str
    """The switch's end of the node's link (inside the switch namespace)."""

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` with this node's network (:func:`call_in`)."""
        return call_in(self.netns, fn, *args)


@dataclass
class NodeCluster:
    """``nodes`` network namespaces on one bridge, each link at ``rate``
    (a ``tc`` rate: ``"1gbit"``, ``"400mbit"``; ``None``: unshaped) with
    ``delay`` (``"1ms"``; ``None``: none) each way."""

    nodes_count: int
    rate: str | None = None
    delay: str | None = None
    burst: str | None = None
    """The token bucket's depth (``None``: 4 ms at ``rate``, at least 64 KiB: a deeper
    bucket lets short transfers run faster than the rate)."""
    nodes: list[Node] = field(default_factory=list, init=False)
    prefix: str = field(default="", init=False)
    closed: bool = field(default=False, init=False)
    procs: list[subprocess.Popen[Any]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.nodes_count <= 200:
            raise ValueError(f"a cluster has 1 to 200 nodes, got {self.nodes_count}")
        why = unavailable()
        if why is not None:
            raise RuntimeError(f"cannot build a node cluster: {why}")
        remove_stale()
        _install_handlers()
        with _lock:
            _state["count"] += 1
            self.prefix = f"{PREFIX}{os.getpid()}x{_state['count']}"
            _live.append(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def _build(self) -> None:
        sw = self.switch
        _run("ip", "netns", "add", sw)
        _run("ip", "-n", sw, "link", "set", "lo", "up")
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for i in range(self.nodes_count):
            ns = f"{self.prefix}n{i}"
            node = Node(
                index=i,
                netns=ns,
                address=f"{NETWORK}.{i + 1}",
                veth=f"{self.prefix}n{i}",
                switch_veth=f"{self.prefix}s{i}",
            )
            _run("ip", "netns", "add", ns)
            self.nodes.append(node)
            # Both ends are created inside the switch namespace (never in this
            # process's own), then one end moves into the node.
            _run("ip", "-n", sw, "link", "add", node.switch_veth, "type", "veth", "peer", "name", node.veth)
            _run("ip", "-n", sw, "link", "set", node.veth, "netns", ns)
            _run("ip", "-n", sw, "link", "set", node.switch_veth, "master", "br0")
            _run("ip", "-n", sw, "link", "set", node.switch_veth, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "addr", "add", f"{node.address}/24", "dev", node.veth)
            _run("ip", "-n", ns, "link", "set", node.veth, "up")
            self.shape(node)

    def _qdisc(self, ns: str, dev: str) -> None:
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        if self.rate is None and self.delay is None:
            return
        parent = ["root"]
        if self.delay is not None:
            # Needs the kernel's sch_netem module (absent from some
            # containers' kernels: "Specified qdisc kind is unknown").
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                 "delay", self.delay, "limit", "100000")  # fmt: skip
            parent = ["parent", "1:1"]
        if self.rate is not None:
            burst = self.burst or _burst(self.rate)
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, *parent, "handle", "10:", "tbf",
                 "rate", self.rate, "burst", burst, "latency", "400ms")  # fmt: skip

    def shape(self, node: Node) -> None:
        """(Re)apply the cluster's rate and delay to ``node``'s link, both ways."""
        self._qdisc(node.netns, node.veth)
        self._qdisc(self.switch, node.switch_veth)

    def link(self, node: Node, up: bool) -> None:
        """Take ``node``'s link down (no packet in or out, its connections
        left open, as a pulled cable leaves them) or bring it back up."""
        state = "up" if up else "down"
        _run("ip", "-n", self.switch, "link", "set", node.switch_veth, state)
        _run("ip", "-n", node.netns, "link", "set", node.veth, state)
        if up:
            _run("ip", "-n", node.netns, "addr", "replace", f"{node.address}/24", "dev", node.veth)

    def counters(self) -> dict[int, tuple[int, int]]:
        """Per node, bytes its link carried (out of the node, into the node)."""
        return {n.index: link_counters(n.netns, n.veth) for n in self.nodes}

    def popen(self, node: Node, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        """``argv`` started inside ``node``'s namespace (killed by :meth:`close`)."""
        proc = subprocess.Popen(node.command(*argv), **kw)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        """Remove every namespace (and with it every link) of this cluster."""
        with _lock:
            if self.closed:
                return
            self.closed = True
            if self in _live:
                _live.remove(self)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for ns in [n.netns for n in self.nodes] + [self.switch]:
            kill_inside(ns)
        for node in self.nodes:
            _run("ip", "netns", "del", node.netns, check=False)
        _run("ip", "netns", "del", self.switch, check=False)
        left = [n for n in _run("ip", "netns", "list", check=False).stdout.split() if n.startswith(self.prefix)]
        for name in left:
            _run("ip", "netns", "del", name, check=False)

    def __enter__(self) -> NodeCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _burst(rate: str) -> str:
    bits = _rate_bits(rate)
    return str(max(64 * 1024, int(bits / 8 / 250)))


def _rate_bits(rate: str) -> float:
    m = re.fullmatch(r"([0-9.]+)\s*([kmgt]?)(bit|bps)?", rate.strip().lower())
    if m is None:
        raise ValueError(f"not a tc rate: {rate!r} (e.g. 400mbit, 1gbit)")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    unit = 8 if m.group(3) == "bps" else 1
    return float(m.group(1)) * scale * unit


def rate_bytes_per_s(rate: str) -> float:
    """A ``tc`` rate (``400mbit``; ``50mbps`` is bytes) in bytes per second."""
    return _rate_bits(rate) / 8


def link_counters(netns: str, dev: str) -> tuple[int, int]:
    """(bytes sent, bytes received) by ``dev`` in ``netns``, from the kernel's counters."""
    out = _run("ip", "netns", "exec", netns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes",
               f"/sys/class/net/{dev}/statistics/rx_bytes").stdout.split()  # fmt: skip
    return int(out[0]), int(out[1])


def call_in(netns: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a helper thread that entered ``netns`` (``setns`` is
    per thread: the rest of this process stays where it is); its result, or
    its exception raised here."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    box: list[tuple[bool, Any]] = []

    def target() -> None:
        try:
            fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
            try:
                if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            box.append((True, fn(*args)))
        except BaseException as e:  # handed to the caller
            box.append((False, e))

    th = threading.Thread(target=target, name=f"in-{netns}", daemon=True)
    th.start()
    th.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


@contextlib.contextmanager
def node_cluster(nodes: int, **kw: Any):
    c = NodeCluster(nodes, **kw)
    try:
        yield c
    finally:
        c.close()
