"""The refit group as engine workers receive it: one typed spec on the wire.

A driver (trainer rank 0) tells every engine worker which refit group to
join: over vLLM's ``collective_rpc`` (worker extension), vLLM's
weight-transfer ``init_info`` (native backend), or SGLang's custom loader.
All three carry a :class:`GroupSpec` (msgspec, JSON): the
:class:`~reshard.transport.group.GroupConfig` fields of scope ``group``
(those every rank shares; :func:`reshard.transport.config.settings`), plus
the worker options (``engine_offset``, ``budget_bytes``, ``atomic``, ``draft``).
Per-rank fields stay behind (``host_store``, ``store_bind``; ``domain``
unless a driver sets one for the engine), and so does the job token unless
the driver asks (offline engines, in the driver's own process tree):
servers read ``$RESHARD_TOKEN`` from their own environment.

The spec declares its fields (it is a wire type, read by other processes);
``tests/test_group_settings.py`` pins them to ``GroupConfig``'s (names,
types, defaults), and every conversion goes through ``settings``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from reshard.transport.config import GROUP, settings
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
    replica_size: int | None = None
    """Engine worker ranks per replica (``GroupConfig.replica_size``)."""
    min_replicas: int | None = None
    """The fewest replicas a refit may run with (``GroupConfig.min_replicas``)."""
    join_timeout_s: float | None = None
    replica_timeout_s: float | None = None
    delta: bool = False
    """Delta refits (``GroupConfig.delta``): workers keep what they received
    and take only what changed since (``docs/delta.md``)."""

    draft: str = "refit"
    """vLLM with speculative decoding: ``refit``, the drafter is a
    destination of every refit beside the target (a trainer must publish
    its tensors, or the plan fails naming them); ``frozen``: it is left alone."""

    WORKER_OPTIONS: ClassVar[tuple[str, ...]] = ("engine_offset", "budget_bytes", "atomic", "draft")
    """The fields that are the engine workers' own options, not group settings."""

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
        draft: str = "refit",
    ) -> GroupSpec:
        """The spec of ``config`` for one engine (per-rank fields left out;
        ``domain``: the engine's own domain label, if the driver knows it)."""
        return cls(
            **settings(config, GROUP),
            domain=domain,
            token=config.token if with_token else None,
            engine_offset=engine_offset,
            budget_bytes=budget_bytes,
            atomic=atomic,
            draft=draft,
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

    def init_info(self) -> dict[str, Any]:
        """The spec as vLLM's ``init_weight_transfer_engine`` takes it, one
        keyword per field (reshard's native backend rebuilds the spec from
        them), but the token, which never travels there (workers read
        ``$RESHARD_TOKEN``), and the version."""
        return {k: v for k, v in msgspec.to_builtins(self).items() if k not in ("token", "version")}

    def config(self) -> GroupConfig:
        """The :class:`GroupConfig` a worker joins with (it never hosts the store)."""
        return GroupConfig(**settings(self, GROUP), domain=self.domain, token=self.token, host_store=False)

    def rank_of(self, worker: int) -> int:
        """The refit rank of this engine's worker ``worker``."""
        return self.num_sources + self.engine_offset + worker
