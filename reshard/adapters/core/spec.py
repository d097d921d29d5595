"""The refit group as engine workers receive it: one typed spec on the wire.

A driver (trainer rank 0) tells every engine worker which refit group to
join: over vLLM's ``collective_rpc`` (worker extension), vLLM's
weight-transfer ``init_info`` (native backend), or SGLang's custom loader.
All three carry a :class:`GroupSpec` (msgspec, JSON): the
:class:`~reshard.transport.group.GroupConfig` fields every rank shares, plus
the worker options (``engine_offset``, ``budget_bytes``, ``atomic``).
Per-rank fields stay behind (``host_store``, ``store_bind``; ``domain``
unless a driver sets one for the engine), and so does the job token unless
the driver asks (offline engines, in the driver's own process tree):
servers read ``$RESHARD_TOKEN`` from their own environment.
"""

from __future__ import annotations

from typing import Any

import msgspec

from reshard.transport.group import GroupConfig
from reshard.transport.session import DEFAULT_BUDGET_BYTES
from reshard.transport.wire import MAX_MESSAGE_BYTES

__all__ = ["GroupSpec"]


class GroupSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How one engine's workers join a refit group (see the module docstring)."""

    address: str
    num_sources: int
    num_destinations: int
    job: str = "reshard"
    generation: int = 0
    timeout_s: float = 300.0
    backend: str = "auto"
    checksums: bool = False
    max_metadata_bytes: int = MAX_MESSAGE_BYTES
    domain: str | None = None
    """The engine's domain label; ``None``: each worker's ``$RESHARD_DOMAIN``, else its hostname."""
    token: str | None = None
    """Only for engines in the driver's own process tree; never sent over HTTP."""
    engine_offset: int = 0
    """This engine's workers take refit ranks ``num_sources + engine_offset + worker index``."""
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    """Each worker's staging budget."""
    atomic: bool = False
    """vLLM: keep every old weight until every rank reported a complete transfer."""
    version: int = 1
    shared_memory: bool = False
    """Workers move bytes through shared memory with ranks on their host that say so too."""
    delta: bool = False
    """Delta refits (``GroupConfig.delta``): workers keep what they received
    and take only what changed since (``docs/delta.md``)."""

    @classmethod
    def of(
        cls,
        config: GroupConfig,
        *,
        engine_offset: int = 0,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        atomic: bool = False,
        domain: str | None = None,
        with_token: bool = False,
    ) -> GroupSpec:
        """The spec of ``config`` for one engine (per-rank fields left out;
        ``domain``: the engine's own domain label, if the driver knows it)."""
        return cls(
            address=config.address,
            num_sources=config.num_sources,
            num_destinations=config.num_destinations,
            job=config.job,
            generation=config.generation,
            timeout_s=config.timeout_s,
            backend=config.backend,
            checksums=config.checksums,
            max_metadata_bytes=config.max_metadata_bytes,
            domain=domain,
            token=config.token if with_token else None,
            engine_offset=engine_offset,
            budget_bytes=budget_bytes,
            atomic=atomic,
            shared_memory=config.shared_memory,
            delta=config.delta,
        )

    @classmethod
    def parse(cls, value: str | bytes | dict[str, Any] | GroupSpec) -> GroupSpec:
        """From JSON (the HTTP routes pass strings) or a dict; unknown keys and
        wrong types are a clear :class:`msgspec.ValidationError`."""
        if isinstance(value, GroupSpec):
            return value
        if isinstance(value, str | bytes):
            return msgspec.json.decode(value, type=cls)
        return msgspec.convert(value, cls)

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    def config(self) -> GroupConfig:
        """The :class:`GroupConfig` a worker joins with (it never hosts the store)."""
        return GroupConfig(
            address=self.address,
            num_sources=self.num_sources,
            num_destinations=self.num_destinations,
            job=self.job,
            generation=self.generation,
            timeout_s=self.timeout_s,
            backend=self.backend,
            checksums=self.checksums,
            max_metadata_bytes=self.max_metadata_bytes,
            domain=self.domain,
            token=self.token,
            host_store=False,
            shared_memory=self.shared_memory,
            delta=self.delta,
        )

    def rank_of(self, worker: int) -> int:
        """The refit rank of this engine's worker ``worker``."""
        return self.num_sources + self.engine_offset + worker
