"""Joining a refit group: what a rank announces, what every rank checks
before any process group exists, and the process group itself.

:meth:`reshard.transport.group.RefitGroup.join` drives these steps; each is
a function of the rank's settings or of the hellos every rank read alike,
so every rank reaches the same verdict.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from reshard.errors import RefitError, span
from reshard.transport import wire
from reshard.transport.config import GroupConfig

if TYPE_CHECKING:
    import torch

__all__ = [
    "NCCL_ERROR_HANDLING",
    "NCCL_TIMEOUT_MARGIN_S",
    "PROCESS",
    "check_hellos",
    "claim",
    "gloo_devices",
    "hello_for",
    "make_pg",
    "nccl_error_handling",
    "nccl_pg",
    "nccl_timeout",
    "route_source",
    "shared_gpus",
]

PROCESS = secrets.token_hex(8)
"""This process's token in the hellos (:attr:`reshard.transport.wire.Hello.process`)."""


def hello_for(
    config: GroupConfig,
    rank: int,
    role: str,
    dev: torch.device,
    backend: str,
    *,
    budget_bytes: int,
    round_bytes: int,
    big_bytes: int,
) -> tuple[wire.Hello, torch.device]:
    """What this rank announces when it joins, and its device (a CUDA
    device without an index becomes the current one)."""
    import torch

    domain = config.domain or os.environ.get("RESHARD_DOMAIN") or socket.gethostname()
    shm_host = ipc_host = gpu = ""
    gpus: tuple[str, ...] = ()
    if config.shared_memory and dev.type == "cpu" and backend == "gloo":
        from reshard.transport.shm import host_id

        shm_host = config.shm_host or host_id()
    if dev.type == "cuda":
        from reshard.transport.ipc import gpu_uuid, visible_gpus

        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        gpu, gpus = gpu_uuid(dev), visible_gpus()
        if config.shared_memory:
            from reshard.transport.shm import host_id

            ipc_host = config.shm_host or host_id()
    hello = wire.Hello(
        rank=rank,
        role=role,
        domain=domain,
        host=socket.gethostname(),
        pid=os.getpid(),
        device=str(dev),
        checksums=config.checksums,
        num_sources=config.num_sources,
        num_destinations=config.num_destinations,
        budget_bytes=budget_bytes,
        round_bytes=round_bytes,
        big_bytes=big_bytes,
        shm_host=shm_host,
        gpu=gpu,
        gpus=gpus,
        ipc_host=ipc_host,
        delta=config.delta,
        process=PROCESS,
        backend=backend,
    )
    return hello, dev


def claim(ns: Any, rank: int) -> int:
    """Claim this rank's slot in the job's current epoch; move the job to the
    next epoch when the slot is taken (see :mod:`reshard.transport.group`)."""
    while True:
        epoch = int(ns.get("epoch"))
        if ns.add(f"slot/e{epoch}/{rank}", 1) == 1:
            return epoch
        ns.compare_set("epoch", str(epoch), str(epoch + 1))


def check_hellos(hellos: Mapping[int, wire.Hello], config: GroupConfig, rank: int) -> None:
    """Settings every rank must share, compared before any process group
    exists: each rank reads the same hellos, so all refuse alike."""

    def differ(what: str, value) -> None:
        by_value: dict[object, list[int]] = {}
        for r, h in sorted(hellos.items()):
            by_value.setdefault(value(h), []).append(r)
        if len(by_value) > 1:
            text = f"ranks disagree on {what}: " + "; ".join(f"{v} on rank(s) {span(rs)}" for v, rs in by_value.items())
            raise RefitError("join", {rank: text}, agreed=True)

    differ(
        "the group's role split (GroupConfig num_sources, num_destinations)",
        lambda h: f"{h.num_sources} sources + {h.num_destinations} destinations" if h.num_sources else "(not said)",
    )
    differ(
        "the refit group's backend (every rank's buffers on GPUs for nccl, in host memory for gloo: a trainer "
        "whose parameters are offloaded to the host passes Sender(device=...) or GroupConfig(backend=...))",
        lambda h: f"{h.backend} ({h.device.split(':')[0]} tensors)" if h.backend else "(not said)",
    )
    differ("GroupConfig.checksums", lambda h: "on" if h.checksums else "off")
    differ("GroupConfig.delta", lambda h: "on" if h.delta else "off")
    for r, h in hellos.items():
        expect = "source" if r < config.num_sources else "destination"
        if h.role != expect:
            raise RefitError(
                "join", {rank: f"rank {r} joined as a {h.role}; refit rank {r} is a {expect}"}, agreed=True
            )


def shared_gpus(hellos: Mapping[int, wire.Hello]) -> str:
    """Ranks whose hellos name the same GPU, said as why no NCCL
    communicator can span the group (empty: every rank has its own)."""
    by_gpu: dict[str, list[int]] = {}
    for r, h in sorted(hellos.items()):
        if h.gpu:
            by_gpu.setdefault(h.gpu, []).append(r)
    shared = [(g, rs) for g, rs in by_gpu.items() if len(rs) > 1]
    if not shared:
        return ""
    pairs = "; ".join(f"ranks {span(rs)} on GPU {g} ({hellos[rs[0]].host})" for g, rs in shared[:3])
    more = f" and {len(shared) - 3} more GPUs" if len(shared) > 3 else ""
    return (
        f"{pairs}{more} share a GPU, and NCCL refuses two ranks of one communicator on one GPU, so every "
        "byte must move by CUDA IPC (GroupConfig(shared_memory=True) on every rank, receivers on the "
        "senders' host)"
    )


def make_pg(
    store: Any,
    config: GroupConfig,
    rank: int,
    backend: str,
    dev: torch.device,
    timeout: datetime.timedelta,
    *,
    ranks: tuple[int, ...] | None = None,
) -> Any:
    """The group's process group, built on its epoch's store (never the
    default group): gloo for CPU tensors, one NCCL communicator for CUDA.
    ``ranks``: the refit ranks it spans (default: all), in their order."""
    from torch.distributed import PrefixStore

    pg_store = PrefixStore("pg", store)
    world = config.world_size if ranks is None else len(ranks)
    pg_rank = rank if ranks is None else ranks.index(rank)
    env = config.pg_env() if config.pg_env is not None else contextlib.nullcontext()
    try:
        with env:
            if backend == "gloo":
                from torch.distributed import ProcessGroupGloo

                opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                opts._timeout = timeout
                opts._devices = gloo_devices(config)
                return ProcessGroupGloo(pg_store, pg_rank, world, opts)
            return nccl_pg(pg_store, pg_rank, world, dev, timeout)
    except Exception as e:
        raise RefitError("join", {rank: f"building the {backend} process group failed: {e}"}) from e


def gloo_devices(config: GroupConfig) -> list[Any]:
    """The gloo devices (the address this rank listens on and advertises to
    its peers) of the refit group: the interfaces in ``$GLOO_SOCKET_IFNAME``
    when set (as torch's own groups read it); else, for a store on another
    host, the local address this host reaches the store from; else torch's
    default (the hostname's address, or the loopback when it resolves to
    none this host can bind). torch's default alone fails across hosts
    whose hostname does not resolve to the interface that joins them (a
    container, a network namespace, a host with several networks): the rank
    advertises 127.0.0.1 or an address its peers cannot reach, and its peers
    hang until the timeout."""
    from torch.distributed import ProcessGroupGloo

    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    if names:
        return [ProcessGroupGloo.create_device(interface=n) for n in names]
    local = route_source(config.host, config.port)
    if local is not None:
        return [ProcessGroupGloo.create_device(hostname=local)]
    return [ProcessGroupGloo.create_default_device()]


def route_source(host: str, port: int) -> str | None:
    """The address this host sends from to reach ``host`` (no packet
    leaves: a UDP socket is only connected); ``None`` when ``host`` is this
    host's loopback or cannot be resolved."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(addr)
                local = str(s.getsockname()[0])
        except OSError:
            continue
        import ipaddress

        ip = ipaddress.ip_address(local.split("%", maxsplit=1)[0])
        return None if ip.is_loopback else local
    return None


NCCL_ERROR_HANDLING = "2"
"""``TORCH_NCCL_ASYNC_ERROR_HANDLING`` for the refit group's communicators:
``CleanUpOnly`` (abort the communicator on an error or timeout, keep the
process). torch's default, ``SkipCleanUp`` (3), tears the process down: a
peer that dies without posting an abort would make the watchdog kill every
engine worker it fed (and the reverse) before reshard's own deadline and
abort run, so the engines that could have kept serving their old weights
die instead, and the next refit has nobody to rejoin."""

NCCL_TIMEOUT_MARGIN_S = 60.0
"""How much later than reshard's own deadline (``GroupConfig.timeout_s``)
NCCL's watchdog times a refit group's work out: reshard's executor, which
polls the abort key and the clock, names the late peer first; the watchdog
stays a last resort for a process whose Python no longer runs."""


def nccl_timeout(timeout: datetime.timedelta) -> datetime.timedelta:
    """The NCCL watchdog's timeout for a refit group whose own deadline is ``timeout``."""
    return timeout + datetime.timedelta(seconds=NCCL_TIMEOUT_MARGIN_S)


@contextlib.contextmanager
def nccl_error_handling():
    """``TORCH_NCCL_ASYNC_ERROR_HANDLING`` set to :data:`NCCL_ERROR_HANDLING`
    while a ``ProcessGroupNCCL`` is built (each reads it in its
    constructor), then put back: the trainer's and the engine's own groups
    keep their settings."""
    key = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    before = os.environ.get(key)
    os.environ[key] = NCCL_ERROR_HANDLING
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def nccl_pg(store: Any, rank: int, world: int, dev: torch.device, timeout: datetime.timedelta) -> Any:
    """A ``ProcessGroupNCCL`` of the refit group (or of the baseline's
    broadcasts) on ``store``: its error handling and timeout leave failures
    to reshard (:data:`NCCL_ERROR_HANDLING`, :func:`nccl_timeout`), and its
    one communicator is connected now (not one per pair of ranks, lazily)."""
    from torch.distributed import ProcessGroupNCCL

    nopts = ProcessGroupNCCL.Options()
    nopts._timeout = nccl_timeout(timeout)
    with nccl_error_handling():
        pg = ProcessGroupNCCL(store, rank, world, nopts)
    pg.eager_connect_single_device(dev)
    return pg
