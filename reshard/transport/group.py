"""The refit group: one process group spanning every trainer rank and every
engine worker, created from a TCPStore, never touching the default group.

Rendezvous is one address (``host:port``) plus a job name: every key lives
under ``PrefixStore("reshard/<job>", TCPStore(host, port))``. Trainer ranks
take refit ranks ``0 .. S-1``, engine workers ``S .. S+D-1``; ranks join in
any order within the timeout. The process group is a c10d
``ProcessGroupGloo`` (CPU tensors) or ``ProcessGroupNCCL`` (CUDA tensors)
built directly on that store: engines and trainers keep their own default
groups untouched.

Call order (every rank):

1. :meth:`RefitGroup.join` - connect, announce, wait for all ranks, build the
   process group. A rank that never joins makes every other rank raise
   :class:`RefitError` (step ``join``) naming it, within the timeout.
2. :meth:`RefitGroup.agree` for each step of each refit: every rank posts its
   :class:`Status` and reads everyone's, so one rank's error reaches all.
3. :meth:`RefitGroup.close` when done, or after a failed transfer (the group
   cannot be reused then; join a new one, with a new ``generation``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reshard.errors import RefitError
from reshard.transport import wire

if TYPE_CHECKING:
    import torch

__all__ = ["GroupConfig", "RefitGroup"]

_POLL_MAX_S = 0.02


@dataclass(kw_only=True, slots=True)
class GroupConfig:
    """How to reach the other ranks of a refit."""

    address: str
    """``host:port`` of the TCPStore (hosted by refit rank 0 unless ``host_store`` says otherwise)."""
    num_sources: int
    """Trainer ranks in the refit (refit ranks ``0 .. num_sources - 1``)."""
    num_destinations: int
    """Engine worker ranks (refit ranks ``num_sources ..``)."""
    job: str = "reshard"
    """Name that keeps this job's keys apart from other users of the store."""
    generation: int = 0
    """Bumped to rebuild the group after a failure (fresh keys, fresh connections)."""
    timeout_s: float = 300.0
    """Bound on every wait: joining, agreeing on a step, each transfer round."""
    backend: str = "auto"
    """``gloo``, ``nccl``, or ``auto`` (NCCL for CUDA tensors, gloo otherwise)."""
    host_store: bool | None = None
    """Host the TCPStore in this process; ``None``: refit rank 0 hosts it."""
    domain: str | None = None
    """This rank's fast-fabric domain label; ``None``: ``$RESHARD_DOMAIN``, else the hostname."""

    def __post_init__(self) -> None:
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"refit address {self.address!r} is not host:port")
        if self.num_sources < 1 or self.num_destinations < 1:
            raise ValueError(
                f"a refit needs at least one source and one destination rank, got "
                f"{self.num_sources} and {self.num_destinations}"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be auto, gloo or nccl, got {self.backend!r}")
        if not self.job or "/" in self.job:
            raise ValueError(f"job name {self.job!r} must be non-empty and contain no '/'")

    @property
    def world_size(self) -> int:
        return self.num_sources + self.num_destinations

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])


@dataclass(slots=True)
class RefitGroup:
    """A joined refit group (see the module docstring for the call order)."""

    config: GroupConfig
    rank: int
    role: str
    store: Any
    pg: Any
    backend: str
    hellos: dict[int, wire.Hello] = field(default_factory=dict)
    _tcp_store: Any = None

    # -- joining -------------------------------------------------------------

    @classmethod
    def join(cls, config: GroupConfig, *, rank: int, device: torch.device | str = "cpu") -> RefitGroup:
        import torch
        from torch.distributed import PrefixStore, TCPStore

        if not 0 <= rank < config.world_size:
            raise ValueError(f"refit rank {rank} outside 0..{config.world_size - 1}")
        role = "source" if rank < config.num_sources else "destination"
        dev = torch.device(device)
        backend = config.backend
        if backend == "auto":
            backend = "nccl" if dev.type == "cuda" else "gloo"
        host_store = config.host_store if config.host_store is not None else rank == 0
        timeout = datetime.timedelta(seconds=config.timeout_s)
        try:
            tcp = TCPStore(
                config.host, config.port, None, host_store, timeout=timeout, wait_for_workers=False, use_libuv=True
            )
        except Exception as e:
            raise RefitError(
                "join", {rank: f"cannot reach the refit store at {config.address} within {config.timeout_s}s: {e}"}
            ) from e
        store = PrefixStore(f"reshard/{config.job}/g{config.generation}", tcp)
        domain = config.domain or os.environ.get("RESHARD_DOMAIN") or socket.gethostname()
        hello = wire.Hello(
            rank=rank, role=role, domain=domain, host=socket.gethostname(), pid=os.getpid(), device=str(dev)
        )
        store.set(f"hello/{rank}", wire.encode(hello))  # type: ignore[arg-type]
        group = cls(config=config, rank=rank, role=role, store=store, pg=None, backend=backend, _tcp_store=tcp)
        keys = [f"hello/{r}" for r in range(config.world_size)]
        missing = group._wait_keys(keys, time.monotonic() + config.timeout_s)
        if missing:
            ranks = [int(k.split("/")[1]) for k in missing]
            raise RefitError(
                "join",
                {rank: f"rank(s) {ranks} did not join the refit group {config.job!r} within {config.timeout_s}s"},
            )
        for k, v in zip(keys, store.multi_get(keys), strict=True):
            h = wire.decode(v, wire.Hello)
            assert isinstance(h, wire.Hello)
            group.hellos[int(k.split("/")[1])] = h
        group.pg = group._make_pg(dev, timeout)
        return group

    def _make_pg(self, dev: torch.device, timeout: datetime.timedelta) -> Any:
        from torch.distributed import PrefixStore

        pg_store = PrefixStore("pg", self.store)
        world = self.config.world_size
        try:
            if self.backend == "gloo":
                from torch.distributed import ProcessGroupGloo

                opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                opts._timeout = timeout
                opts._devices = [ProcessGroupGloo.create_default_device()]
                return ProcessGroupGloo(pg_store, self.rank, world, opts)
            from torch.distributed import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = ProcessGroupNCCL(pg_store, self.rank, world, opts)
            # One communicator for the whole group (not one per pair of ranks).
            pg.eager_connect_single_device(dev)
            return pg
        except Exception as e:
            raise RefitError("join", {self.rank: f"building the {self.backend} process group failed: {e}"}) from e

    # -- the store -----------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def domain_of(self) -> dict[int, int]:
        """Domain index per rank (labels numbered in sorted order)."""
        labels = sorted({h.domain for h in self.hellos.values()})
        index = {lab: i for i, lab in enumerate(labels)}
        return {r: index[h.domain] for r, h in self.hellos.items()}

    def _wait_keys(self, keys: list[str], deadline: float, abort_key: str | None = None) -> list[str]:
        """Wait until every key exists; return the missing ones at the deadline.

        Raises :class:`RefitError` at once if ``abort_key`` appears.
        """
        store = self.store
        pause = 0.001
        while True:
            if store.check(keys):
                return []
            if abort_key is not None and store.check([abort_key]):
                raise self._aborted(abort_key)
            if time.monotonic() >= deadline:
                return [k for k in keys if not store.check([k])]
            # Polling, not store.wait: a timed-out wait logs a warning each time.
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def _aborted(self, abort_key: str) -> RefitError:
        msg = bytes(self.store.get(abort_key)).decode(errors="replace")
        step = abort_key.rsplit("/", maxsplit=1)[-1]
        return RefitError(step, {self.rank: f"aborted by another rank: {msg}"})

    def abort_key(self, refit: int) -> str:
        return f"abort/{refit}"

    def signal_abort(self, refit: int, message: str) -> None:
        """Tell every rank that refit ``refit`` failed (first message wins)."""
        # The store may be gone; then peers time out instead.
        with contextlib.suppress(Exception):
            self.store.compare_set(self.abort_key(refit), "", f"rank {self.rank}: {message}")

    def aborted(self, refit: int) -> str | None:
        key = self.abort_key(refit)
        try:
            if self.store.check([key]):
                return bytes(self.store.get(key)).decode(errors="replace")
        except Exception as e:
            return f"the refit store is unreachable: {e}"
        return None

    def agree(self, step: str, refit: int, status: wire.Status, *, timeout_s: float | None = None) -> list[wire.Status]:
        """Post this rank's status for ``step`` and return every rank's.

        Raises :class:`RefitError` on every rank if any rank reported an error,
        or if a rank does not report within ``timeout_s`` (default: the group's
        timeout); otherwise returns all statuses (ordered by rank).
        """
        prefix = f"status/{refit}/{step}"
        self.store.set(f"{prefix}/{self.rank}", wire.encode(status))
        keys = [f"{prefix}/{r}" for r in range(self.world_size)]
        wait = self.config.timeout_s if timeout_s is None else timeout_s
        missing = self._wait_keys(keys, time.monotonic() + wait)
        present = [k for k in keys if k not in missing]
        statuses: list[wire.Status] = []
        for v in self.store.multi_get(present) if present else []:
            s = wire.decode(v, wire.Status)
            assert isinstance(s, wire.Status)
            statuses.append(s)
        errors: dict[int, str] = {}
        for s in statuses:
            if not s.ok:
                lines = [s.error] if s.error else []
                lines += [str(p) for p in s.problems]
                errors[s.rank] = "\n".join(lines)
        for k in missing:
            errors[int(k.rsplit("/", 1)[1])] = (
                f"did not report step {step!r} within {wait:g}s (dead, hung, or never started)"
            )
        if errors:
            raise RefitError(step, errors, version=refit)
        return sorted(statuses, key=lambda s: s.rank)

    def forget(self, refit: int, steps: Iterable[str]) -> None:
        """Delete this rank's status keys of an old refit (keeps the store small)."""
        for step in steps:
            with contextlib.suppress(Exception):
                self.store.delete_key(f"status/{refit}/{step}/{self.rank}")

    # -- teardown -------------------------------------------------------------

    def close(self) -> None:
        """Drop the process group: its connections close, so peers blocked on
        this rank fail at once instead of waiting for their timeout."""
        pg = self.pg
        self.pg = None
        if pg is not None and self.backend == "nccl":
            with contextlib.suppress(Exception):
                pg.abort()
        del pg
