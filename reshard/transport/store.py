"""The refit store: the TCPStore a refit group rendezvouses on, hosted by one
rank (refit rank 0 unless ``GroupConfig.host_store`` says otherwise) and
reached by the others within the group's timeout."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import threading
import time
from typing import Any

from reshard.errors import RefitError
from reshard.transport.config import GroupConfig

__all__ = ["STORE_CALL_BOUND_S", "BoundedStore", "StoreCalls", "StoreUnreachable", "connect_store", "serve_store"]

log = logging.getLogger(__name__)

_SERVERS: dict[int, Any] = {}
_SERVERS_LOCK = threading.Lock()


def serve_store(config: GroupConfig) -> Any:
    """The TCPStore server for ``config.address`` hosted by this process.

    Created once per port and kept for the life of the process, so a group
    rebuilt after a failure (or a new generation) reuses it. It listens on
    ``config.store_bind`` (default: the address's host) only: torch's
    ``TCPStore(host, port, is_master=True)`` listens on every interface
    whatever ``host`` says, so reshard binds the socket itself and hands it
    over (``master_listen_fd``).
    """
    import torch.distributed as dist

    with _SERVERS_LOCK:
        server = _SERVERS.get(config.port)
        if server is not None:
            return server
        timeout = datetime.timedelta(seconds=config.timeout_s)
        bind = _bind_host(config)
        if bind is None:
            server = dist.TCPStore(
                config.host, config.port, None, True, timeout=timeout, wait_for_workers=False, use_libuv=True
            )
        else:
            info = socket.getaddrinfo(bind, config.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            sock = socket.socket(info[0], socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(info[4])
                sock.listen(2048)
            except OSError:
                sock.close()
                raise
            fd = sock.detach()  # the store owns (and closes) the socket from here on
            try:
                server = dist.TCPStore(
                    config.host,
                    config.port,
                    None,
                    True,
                    timeout=timeout,
                    wait_for_workers=False,
                    master_listen_fd=fd,
                    use_libuv=True,
                )
            except Exception:
                os.close(fd)
                raise
        _SERVERS[config.port] = server
        return server


def _bind_host(config: GroupConfig) -> str | None:
    """The address the hosted store listens on; ``None``: every interface."""
    bind = config.store_bind
    if bind is not None:
        return None if bind in ("", "0.0.0.0", "::", "*") else bind
    host = config.host
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        return None if literal.is_unspecified else host
    addr = str(socket.getaddrinfo(host, config.port, type=socket.SOCK_STREAM)[0][4][0])
    if ipaddress.ip_address(addr).is_loopback and host != "localhost":
        # A hostname that resolves to loopback here (Debian's 127.0.1.1 entry)
        # may be how other hosts reach this one through DNS: binding to it
        # would lock them out. Listen everywhere, as torch does, and say so.
        log.warning(
            "refit store: %s resolves to %s on this host; listening on every interface "
            "(set GroupConfig.store_bind to choose)",
            host,
            addr,
        )
        return None
    return addr


def connect_store(config: GroupConfig, rank: int) -> Any:
    """This rank's client of the refit store (or the server, when it hosts it)."""
    from torch.distributed import TCPStore

    host_store = config.host_store if config.host_store is not None else rank == 0
    try:
        if host_store:
            return serve_store(config)
        # TCPStore's own connect retries can take twice its timeout: probe the
        # port first, within the timeout, and give the store what is left.
        deadline = time.monotonic() + config.timeout_s
        while True:
            try:
                with socket.create_connection((config.host, config.port), timeout=1.0):
                    break
            except OSError:
                if time.monotonic() + 0.1 >= deadline:
                    raise
                time.sleep(0.1)
        store = TCPStore(
            config.host,
            config.port,
            None,
            False,
            timeout=datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())),
            wait_for_workers=False,
            use_libuv=True,
        )
        store.set_timeout(datetime.timedelta(seconds=config.timeout_s))
        return store
    except Exception as e:
        what = "host" if host_store else "reach"
        raise RefitError(
            "join", {rank: f"cannot {what} the refit store at {config.address} within {config.timeout_s}s: {e}"}
        ) from e


STORE_CALL_BOUND_S = 30.0
"""The longest one call on the refit store may take (or the group's
timeout, when shorter) before the store counts as unreachable: generous,
since a store starved of CPU on a loaded machine answers late but answers. A call
normally takes a round trip; one sent while the link to the store's host is
down is retransmitted by TCP for many minutes, and c10d's client waits as
long (its timeout bounds ``wait``, not a read of an answer that never
comes)."""


class StoreUnreachable(RuntimeError):
    """A call on the refit store got no answer within its bound."""


class StoreCalls:
    """reshard's own calls on one connection to the refit store, each made
    by one helper thread and waited for at most ``bound_s``: a caller that
    polls the store (an abort key, a counter) also keeps its own deadline
    when the store's host becomes unreachable. After a call that timed out
    the connection counts as lost: later calls fail at once (the group is
    rebuilt on a new connection at its next refit)."""

    def __init__(self, address: str, bound_s: float) -> None:
        import queue

        self.address = address
        self.bound_s = bound_s
        self.lost: str | None = None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, done, box = job
            try:
                box.append((True, fn(*args)))
            except BaseException as e:  # handed to the caller
                box.append((False, e))
            done.set()

    def call(self, fn: Any, *args: Any) -> Any:
        with self._lock:
            if self.lost is not None:
                raise StoreUnreachable(self.lost)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="reshard-store", daemon=True)
                self._thread.start()
            done = threading.Event()
            box: list[tuple[bool, Any]] = []
            self._jobs.put((fn, args, done, box))
            if not done.wait(self.bound_s):
                self.lost = (
                    f"the refit store at {self.address} did not answer within {self.bound_s:g} s "
                    "(its host or the link to it is down?)"
                )
                raise StoreUnreachable(self.lost)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        if self._thread is not None and self.lost is None:
            self._jobs.put(None)


class BoundedStore:
    """``store``'s methods, each call made through ``calls`` (:class:`StoreCalls`)."""

    def __init__(self, store: Any, calls: StoreCalls) -> None:
        self._store = store
        self._calls = calls

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._store, name)
        calls = self._calls
        return lambda *args: calls.call(fn, *args)
