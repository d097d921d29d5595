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
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from reshard.errors import RefitError, span
from reshard.transport import wire
from reshard.transport.config import GroupConfig

if TYPE_CHECKING:
    import torch

__all__ = ["check_hellos", "claim", "hello_for", "make_pg", "shared_gpus"]


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
    store: Any, config: GroupConfig, rank: int, backend: str, dev: torch.device, timeout: datetime.timedelta
) -> Any:
    """The group's process group, built on its epoch's store (never the
    default group): gloo for CPU tensors, one NCCL communicator for CUDA."""
    from torch.distributed import PrefixStore

    pg_store = PrefixStore("pg", store)
    world = config.world_size
    env = config.pg_env() if config.pg_env is not None else contextlib.nullcontext()
    try:
        with env:
            if backend == "gloo":
                from torch.distributed import ProcessGroupGloo

                opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                opts._timeout = timeout
                opts._devices = [ProcessGroupGloo.create_default_device()]
                return ProcessGroupGloo(pg_store, rank, world, opts)
            from torch.distributed import ProcessGroupNCCL

            nopts = ProcessGroupNCCL.Options()
            nopts._timeout = timeout
            pg = ProcessGroupNCCL(pg_store, rank, world, nopts)
            # One communicator for the whole group (not one per pair of
            # ranks), built now, inside ``pg_env``.
            pg.eager_connect_single_device(dev)
            return pg
    except Exception as e:
        raise RefitError("join", {rank: f"building the {backend} process group failed: {e}"}) from e
