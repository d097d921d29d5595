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

__all__ = ["connect_store", "serve_store"]

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
