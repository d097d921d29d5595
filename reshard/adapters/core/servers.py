"""Several engine servers as replicas of an elastic refit group
(``GroupConfig.min_replicas``): which refit ranks each server's workers take,
and which servers are down.

Server ``i`` is replica ``i``: its workers take refit ranks
``num_sources + i * replica_size ..``, so a server that is down leaves its
ranks free and the others keep theirs. Every server must then have the same
number of workers (its TP size), which is ``GroupConfig.replica_size``: the
drivers set it where the user left it ``None`` (on the rank that drives the
engines, before the group forms; the refit rank 0 decides membership from
it), and refuse servers of different sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from reshard.errors import ReshardError

if TYPE_CHECKING:
    from reshard.transport.config import GroupConfig

__all__ = ["replica_offsets", "unreachable_line"]


def replica_offsets(config: GroupConfig, sizes: Sequence[int | None], names: Sequence[str]) -> list[int]:
    """The ``engine_offset`` of each server in an elastic group, given each
    live server's worker count (``None``: down). Sets
    ``config.replica_size`` when it is ``None``; raises naming the servers
    when their sizes differ, disagree with ``replica_size``, do not add up
    to ``num_destinations``, or none is up."""
    live = {n: s for n, s in zip(names, sizes, strict=True) if s is not None}
    if not live:
        raise ReshardError(f"none of the engine servers is reachable: {', '.join(names)}")
    distinct = sorted(set(live.values()))
    if len(distinct) > 1:
        each = ", ".join(f"{n}: {s}" for n, s in live.items())
        raise ReshardError(
            "with GroupConfig.min_replicas every engine server is one replica of the same size (its TP size), "
            f"but these servers have different numbers of workers ({each})"
        )
    size = distinct[0]
    if config.replica_size is not None and config.replica_size != size:
        raise ReshardError(
            f"GroupConfig.replica_size is {config.replica_size}, but each engine server has {size} workers "
            f"({', '.join(live)}): leave replica_size None (the driver sets it) or make them agree"
        )
    if size * len(names) != config.num_destinations:
        raise ReshardError(
            f"{len(names)} engine servers of {size} workers each make {size * len(names)} refit ranks, but the "
            f"refit group expects num_destinations={config.num_destinations}"
        )
    if config.replica_size is None:
        config.replica_size = size
        if config.min_replicas is not None and config.min_replicas > config.num_replicas:
            raise ReshardError(
                f"GroupConfig.min_replicas is {config.min_replicas}, but {len(names)} engine servers make only "
                f"{config.num_replicas} replicas"
            )
    return [i * size for i in range(len(names))]


def unreachable_line(name: str, error: BaseException | str) -> str:
    """Why a server is missing from a refit, as ``missing_replicas`` says it."""
    return f"engine server {name} unreachable: {error}"
