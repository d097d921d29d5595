"""Free TCP ports for tests, examples and benchmarks on one machine.

A port found free by binding port 0 comes from the kernel's ephemeral range,
the same range every outgoing connection takes its source port from: between
finding it and binding it for real (a store, a process group), any process on
the machine (Ray, vLLM, a second test run) may take it for a connection, and
the bind then fails with "Address already in use". Below that range other
programs pick ports the same way (SGLang its NCCL port from 22000-29999, Ray
its workers' from 10002-19999). :func:`free_port` picks ports above the
ephemeral range instead (61000-65535 by default), at random, checks that each
binds, and never returns one twice in a process.
"""

from __future__ import annotations

import random
import socket
import threading

__all__ = ["free_port"]

_given: set[int] = set()
_lock = threading.Lock()
_rng = random.SystemRandom()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that binds now, above the kernel's ephemeral range
    (any free port where that range leaves no room above it), not returned
    before by this process."""
    _, hi = _ephemeral_range()
    with _lock:
        if 65535 - hi >= 1000:
            for _ in range(500):
                port = _rng.randrange(hi + 1, 65536)
                if port not in _given and _binds(host, port):
                    _given.add(port)
                    return port
        while True:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _given:
                _given.add(port)
                return port
