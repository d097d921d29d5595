"""How to reach the other ranks of a refit: :class:`GroupConfig`.

It is the one list of group settings. Each field says who shares it (its
``scope``): ``group`` settings are the same on every rank of a refit and
travel from the trainer to engine workers (``GroupSpec``, vLLM's init
infos); ``trainer`` settings concern source ranks only and travel in the
trainer's init info; the others are each rank's own (where it listens, its
domain, its token). :func:`settings` reads a scope's fields off a config,
so no caller lists them again.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from reshard.transport import wire

__all__ = ["GROUP", "TRAINER", "GroupConfig", "format_address", "parse_address", "scope_fields", "settings"]

GROUP = "group"
"""Scope of the settings every rank of a refit shares (engines receive them)."""
TRAINER = "trainer"
"""Scope of the settings of source (trainer) ranks only."""


def _shared(scope: str, default: Any = dataclasses.MISSING) -> Any:
    return field(default=default, metadata={"scope": scope})


def parse_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` or ``[ipv6-host]:port`` (the host
    without brackets, as sockets and ``TCPStore`` take it)."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 host must be bracketed: which colon ends it is ambiguous
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"refit address {address!r} is not host:port (an IPv6 host in brackets: [::1]:29600)")
    return host, int(port)


def format_address(host: str, port: int) -> str:
    """The address of ``host`` (a name, an IPv4 or an IPv6 address, bracketed
    or not) and ``port``, as :attr:`GroupConfig.address` reads it."""
    host = host.strip("[]")
    return f"[{host}]:{int(port)}" if ":" in host else f"{host}:{int(port)}"


def scope_fields(*scopes: str) -> tuple[str, ...]:
    """Names of the :class:`GroupConfig` fields of these scopes, in order."""
    return tuple(f.name for f in dataclasses.fields(GroupConfig) if f.metadata.get("scope") in scopes)


def settings(config: Any, *scopes: str, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The fields of ``config`` (a :class:`GroupConfig`, or anything with
    attributes of the same names) of these scopes, by name."""
    skip = set(exclude)
    return {name: getattr(config, name) for name in scope_fields(*scopes) if name not in skip}


@dataclass(kw_only=True, slots=True)
class GroupConfig:
    """How to reach the other ranks of a refit."""

    address: str = _shared(GROUP)
    """``host:port`` of the TCPStore (hosted by refit rank 0 unless
    ``host_store`` says otherwise); an IPv6 host in brackets, ``[::1]:29600``."""
    num_sources: int = _shared(GROUP)
    """Trainer ranks in the refit (refit ranks ``0 .. num_sources - 1``)."""
    num_destinations: int = _shared(GROUP)
    """Engine worker ranks (refit ranks ``num_sources ..``)."""
    job: str = _shared(GROUP, "reshard")
    """Name that keeps this job's keys apart from other users of the store."""
    generation: int = _shared(GROUP, 0)
    """A fresh namespace on the store; groups are also rebuilt automatically
    after a failure (epochs), so bumping it is never required."""
    timeout_s: float = _shared(GROUP, 300.0)
    """Bound on every wait: joining, agreeing on a step, each transfer round."""
    backend: str = _shared(GROUP, "auto")
    """``gloo``, ``nccl``, or ``auto`` (NCCL for CUDA tensors, gloo otherwise)."""
    host_store: bool | None = None
    """Host the TCPStore in this process; ``None``: refit rank 0 hosts it."""
    domain: str | None = None
    """This rank's fast-fabric domain label; ``None``: ``$RESHARD_DOMAIN``, else the hostname."""
    token: str | None = field(default=None, repr=False)
    """Shared secret of the job; ``None``: ``$RESHARD_TOKEN``, else no token.
    Ranks with different tokens refuse each other (see ``docs/security.md``)."""
    checksums: bool = _shared(GROUP, False)
    """Verify every message of a refit with a checksum (every rank must agree)."""
    store_bind: str | None = None
    """Address the store hosted by this process listens on. ``None``: the
    host of ``address``; ``"0.0.0.0"`` or ``"::"``: every interface."""
    max_metadata_bytes: int = _shared(GROUP, wire.MAX_MESSAGE_BYTES)
    """Largest metadata message (layout, table, status) a rank accepts."""
    shared_memory: bool = _shared(GROUP, False)
    """Move bytes through shared memory (``/dev/shm``) to and from ranks on
    the same host that say so too, when both hold CPU tensors; other peers
    keep the process group (:mod:`reshard.transport.shm`). With CUDA
    tensors: receivers on the same host that see a sender's GPU read its
    tensors directly by CUDA IPC (:mod:`reshard.transport.ipc`)."""
    shm_host: str | None = None
    """This rank's host label for shared-memory links; ``None``: the machine
    and its ``/dev/shm`` mount (:func:`reshard.transport.shm.host_id`).
    Ranks with different labels never share memory."""
    export_sources: bool = _shared(TRAINER, False)
    """A source rank with ``shared_memory``: move its CPU source tensors'
    storage into shared memory once (in place) so that colocated receivers
    copy their slices straight out of it, one copy per byte instead of two
    (:mod:`reshard.transport.shm`). The trainer's tensors stay where they
    are as Python objects; only their bytes live in ``/dev/shm`` from then on.
    (CUDA tensors need no move: ``shared_memory`` alone exports them.)"""
    pg_env: Callable[[], AbstractContextManager[Any]] | None = field(default=None, repr=False, compare=False)
    """A context the refit group's process groups are built in. Inside a
    vLLM worker the adapter passes vLLM's ``unpinned_nccl_env``, so NCCL
    communicators shared with the trainer are created with the launch-time
    NCCL settings, as vLLM's own trainer communicators are (vLLM pins NCCL
    settings in its workers for batch invariance; a communicator whose peers
    disagree on them can hang)."""

    replica_size: int | None = _shared(GROUP, None)
    """Engine worker ranks per engine replica (one engine's whole TP/EP
    group, the unit that joins and leaves a refit): replica ``i`` is refit
    ranks ``num_sources + i * replica_size ..``. Must divide ``num_destinations``.
    ``None``: 1 (each worker rank is a replica)."""
    min_replicas: int | None = _shared(GROUP, None)
    """The fewest engine replicas a refit may run with (``None``: every
    replica, as a fixed group). Fewer: the replicas present at a refit's
    ``enter`` step are refit, the others are named missing
    (:mod:`reshard.transport.members`)."""
    join_timeout_s: float | None = _shared(GROUP, None)
    """With ``min_replicas``: how long joining waits for late replicas before
    the group forms without them (``None``: ``timeout_s``)."""
    replica_timeout_s: float | None = _shared(GROUP, None)
    """With ``min_replicas``: how long a refit waits for a replica that does
    not report (hung or dead) before it goes on without it (``None``:
    ``timeout_s``)."""

    delta: bool = _shared(GROUP, False)
    """Delta refits: each pair of ranks moves only the elements that changed
    since the last refit, in sparse encodings, where both ranks prove the
    receiver holds what the sender sent last (every rank must agree;
    ``docs/delta.md``). Off: every refit is dense."""
    delta_budget_bytes: int | None = _shared(TRAINER, None)
    """A sender's snapshot of what it sent last (one copy of the slices it
    sends, in the engines' dtypes) stays under this many bytes; receivers
    whose slices do not fit get dense refits, and the sender says so once.
    ``None``: no bound."""

    def __post_init__(self) -> None:
        parse_address(self.address)
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
        if self.export_sources and not self.shared_memory:
            raise ValueError("export_sources needs shared_memory=True")
        if self.generation < 0:
            raise ValueError(f"generation must be >= 0, got {self.generation}")
        if self.token is None:
            self.token = os.environ.get("RESHARD_TOKEN") or None
        elif not isinstance(self.token, str) or not self.token:
            raise ValueError("token must be a non-empty string, or None to read $RESHARD_TOKEN")
        if self.max_metadata_bytes <= 0:
            raise ValueError(f"max_metadata_bytes must be positive, got {self.max_metadata_bytes}")
        if self.replica_width < 1 or self.num_destinations % self.replica_width:
            raise ValueError(
                f"replica_size {self.replica_size} must be >= 1 and divide num_destinations {self.num_destinations}"
            )
        if self.min_replicas is not None and not 1 <= self.min_replicas <= self.num_replicas:
            raise ValueError(f"min_replicas must be in 1..{self.num_replicas} or None, got {self.min_replicas}")
        for name in ("join_timeout_s", "replica_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None, got {value}")
        if self.delta_budget_bytes is not None and self.delta_budget_bytes < 0:
            raise ValueError(f"delta_budget_bytes must be >= 0 or None, got {self.delta_budget_bytes}")

    @property
    def world_size(self) -> int:
        return self.num_sources + self.num_destinations

    @property
    def replica_width(self) -> int:
        """Refit ranks per engine replica (``replica_size``, default 1)."""
        return 1 if self.replica_size is None else self.replica_size

    @property
    def num_replicas(self) -> int:
        """Engine replicas the group expects (``num_destinations / replica_size``)."""
        return self.num_destinations // self.replica_width

    @property
    def elastic(self) -> bool:
        """Whether refits may run without some replicas (``min_replicas`` below all)."""
        return self.min_replicas is not None and self.min_replicas < self.num_replicas

    @property
    def host(self) -> str:
        """The store's host, without brackets."""
        return parse_address(self.address)[0]

    @property
    def port(self) -> int:
        return parse_address(self.address)[1]
