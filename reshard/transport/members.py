"""Who takes part in a refit when engine replicas come and go
(``GroupConfig.min_replicas``).

Trainer ranks are fixed for a job; engine replicas (one engine's whole
TP/EP group, ``GroupConfig.replica_size`` refit ranks) are whoever is
present. Refit rank 0 (a trainer rank, always present) decides, and writes
its decision on the store as a :class:`~reshard.transport.wire.Roster`;
every other rank reads it, so every rank acts on the same one:

- **joining** (:func:`form`): the group of an epoch is every trainer rank and
  the replicas whose every rank said hello within ``join_timeout_s``; its
  process group spans those ranks only (:class:`MemberPG` maps refit ranks
  onto it). Fewer than ``min_replicas``: every rank raises at step ``join``.
- **each refit** (:func:`roll_call`, step ``enter``): the replicas of the
  group that report within ``replica_timeout_s`` are refit; one that does
  not (dead, stopped) is named missing and left out of this epoch's later
  refits too; the plan is made over the ranks present.
- **coming back** (:func:`knock`): a replica that was left out, restarted
  or started later knocks; at its next refit's ``enter`` step rank 0 moves
  the job to a new epoch, every rank rejoins, and the newcomer is planned
  in (a dense refit of the full current version: its delta base is stale).
  A rank left out is told so by a :class:`RefitError` naming the refit it
  missed and the one it still serves; nothing was written into it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from reshard.errors import RefitError, span
from reshard.transport import wire

if TYPE_CHECKING:
    from reshard.transport.config import GroupConfig

Group = Any
"""A :class:`reshard.transport.group.RefitGroup` (which calls this module: named
here only in words, so that the two modules do not import each other)."""

__all__ = ["MemberPG", "claim", "form", "knock", "replica_of", "replica_ranks", "roll_call", "summary"]

MEMBERS = "members"
"""The key of an epoch's membership (under the epoch's prefix)."""
KNOCK = "knock"
"""The key a rank that wants in sets in the current epoch."""


def replica_of(config: GroupConfig, rank: int) -> int:
    """The replica index of destination ``rank``."""
    return (rank - config.num_sources) // config.replica_width


def replica_ranks(config: GroupConfig, replica: int) -> range:
    """The refit ranks of replica ``replica``."""
    first = config.num_sources + replica * config.replica_width
    return range(first, first + config.replica_width)


def _complete(config: GroupConfig, ranks: Iterable[int]) -> tuple[list[int], list[int]]:
    """``(replicas whose every rank is in ranks, the others)``."""
    have = set(ranks)
    full: list[int] = []
    partial: list[int] = []
    for i in range(config.num_replicas):
        (full if all(r in have for r in replica_ranks(config, i)) else partial).append(i)
    return full, partial


def summary(group: Group) -> tuple[tuple[int, ...], dict[int, str]]:
    """``(replicas refit, missing replicas and why)`` of the refit in progress."""
    roster = group.roster
    if roster is None:
        return tuple(range(group.config.num_replicas)), {}
    full, _ = _complete(group.config, roster.present)
    return tuple(full), dict(roster.missing)


# -- joining ----------------------------------------------------------------------


def claim(ns: Any, rank: int) -> tuple[int, bool]:
    """An elastic destination's slot in the current epoch: ``(epoch, fresh)``.
    Unlike :func:`reshard.transport.joining.claim` a taken slot (this rank was
    in the epoch before) does not move the job on (that would fail the
    refit the others run now): the rank :func:`knock` s instead."""
    epoch = int(ns.get("epoch"))
    return epoch, ns.add(f"slot/e{epoch}/{rank}", 1) == 1


def knock(group: Group, deadline: float, why: str) -> None:
    """Ask to be let in, and wait for the next epoch (raises
    :class:`~reshard.transport.group.EpochMoved` once the trainer's rank 0
    moved the job on at its next refit; :class:`RefitError` at the deadline)."""
    try:
        group.kv.set(KNOCK, str(group.rank))
    except Exception as e:
        raise group._store_error("join", e) from e
    group._wait(lambda: False, deadline, step="join", watch_epoch=True)
    raise RefitError(
        "join",
        {
            group.rank: f"rank {group.rank} ({why}) knocked to join refit group {group.config.job!r} but no refit "
            f"began within {group.config.timeout_s:g}s to let it in"
        },
    )


def form(group: Group, deadline: float) -> None:
    """Decide (rank 0) or read (the others) the epoch's members, set
    :attr:`RefitGroup.members` and :attr:`RefitGroup.roster`; a rank left out
    knocks (see the module docstring)."""
    cfg = group.config
    if group.rank == 0:
        sources = [f"hello/{r}" for r in range(cfg.num_sources)]
        late = group._wait_keys(sources, deadline, step="join", watch_epoch=True)
        if late:
            ranks = [int(k.split("/")[1]) for k in late]
            raise RefitError(
                "join",
                {0: f"trainer rank(s) {ranks} did not join the refit group {cfg.job!r} within {cfg.timeout_s}s"},
            )
        wait_s = cfg.join_timeout_s if cfg.join_timeout_s is not None else cfg.timeout_s
        dests = [f"hello/{r}" for r in range(cfg.num_sources, cfg.world_size)]
        absent = set(group._wait_keys(dests, min(deadline, time.monotonic() + wait_s), step="join", watch_epoch=True))
        here = [r for r in range(cfg.num_sources, cfg.world_size) if f"hello/{r}" not in absent]
        full, partial = _complete(cfg, here)
        missing = {i: f"not joined within {wait_s:g}s (join_timeout_s)" for i in partial}
        error = ""
        if len(full) < (cfg.min_replicas or cfg.num_replicas):
            error = _too_few(cfg, full, missing, "join")
        present = tuple(range(cfg.num_sources)) + tuple(r for i in full for r in replica_ranks(cfg, i))
        roster = wire.Roster(present=() if error else present, missing=missing, error=error)
        group.put(MEMBERS, roster, step="join")
    else:
        if group._wait_keys([MEMBERS], deadline, step="join", watch_epoch=True):
            raise RefitError(
                "join", {group.rank: f"refit rank 0 did not form the refit group {cfg.job!r} within {cfg.timeout_s}s"}
            )
        (got,) = group.get_many([MEMBERS], wire.Roster, step="join")
        assert isinstance(got, wire.Roster)
        roster = got
    if roster.error:
        raise RefitError("join", {group.rank: roster.error}, agreed=True)
    if group.rank not in roster.present:
        knock(group, deadline, "its replica was not present when the group formed")
    group.members = roster.present
    group.present = roster.present
    group.roster = roster


def _too_few(cfg: GroupConfig, full: list[int], missing: dict[int, str], step: str) -> str:
    lines = "; ".join(f"replica {i} (ranks {span(list(replica_ranks(cfg, i)))}): {w}" for i, w in missing.items())
    return (
        f"only {len(full)} of {cfg.num_replicas} engine replicas are present at step {step!r}, and "
        f"GroupConfig.min_replicas is {cfg.min_replicas}: {lines}"
    )


class MemberPG:
    """The process group of an epoch's members, addressed by refit rank."""

    def __init__(self, pg: Any, members: tuple[int, ...]) -> None:
        self._pg = pg
        self._index = {r: i for i, r in enumerate(members)}

    def send(self, tensors: Any, peer: int, tag: int) -> Any:
        return self._pg.send(tensors, self._index[peer], tag)

    def recv(self, tensors: Any, peer: int, tag: int) -> Any:
        return self._pg.recv(tensors, self._index[peer], tag)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pg, name)


# -- each refit -------------------------------------------------------------------


def roll_call(group: Group, refit: int, status: wire.Status) -> list[wire.Status] | None:
    """Step ``enter`` of an elastic group: post this rank's status; rank 0
    decides who is present, or moves the job to a new epoch for a rank that
    knocked (then it returns ``None``: the caller rejoins, and the others
    follow as their waits see the epoch move); every rank returns the
    statuses of the ranks present and sets :attr:`RefitGroup.present`.
    Raises :class:`RefitError` on a rank left out (naming the refit it
    missed) and, with too few replicas, on all."""
    cfg = group.config
    tag = f"{group.seq}/enter"
    group._steps.setdefault(group.seq, []).append("enter")
    group.put(f"status/{tag}/{group.rank}", status, step="enter")
    start = time.monotonic()
    key = f"roster/{group.seq}"
    if group.rank == 0:
        try:
            knocked = group.kv.check([KNOCK])
            if knocked:
                epoch = group.epoch
                group.ns_kv.compare_set("epoch", str(epoch), str(epoch + 1))
        except Exception as e:
            raise group._store_error("enter", e) from e
        if knocked:
            return None
        sources = [f"status/{tag}/{r}" for r in range(cfg.num_sources)]
        late = group._wait_keys(sources, start + cfg.timeout_s, step="enter", watch_epoch=True)
        if late:
            ranks = [int(k.rsplit("/", 1)[1]) for k in late]
            text = f"trainer rank(s) {span(ranks)} did not report step 'enter' within {cfg.timeout_s:g}s"
            group.put(key, wire.Roster(refit=refit, error=text), step="enter")
            raise RefitError("enter", {r: text for r in ranks}, version=refit)
        wait_s = cfg.replica_timeout_s if cfg.replica_timeout_s is not None else cfg.timeout_s
        expect = [r for r in group.members if r >= cfg.num_sources and r not in group.dropped]
        keys = [f"status/{tag}/{r}" for r in expect]
        silent_keys = set(group._wait_keys(keys, start + wait_s, step="enter", watch_epoch=True))
        here = [r for r in expect if f"status/{tag}/{r}" not in silent_keys]
        full, partial = _complete(cfg, here)
        missing: dict[int, str] = {}
        prior = group.roster.missing if group.roster is not None else {}
        for i in partial:
            rs = replica_ranks(cfg, i)
            if rs[0] not in group.members:
                missing[i] = prior.get(i, "not a member of the group (absent when it formed)")
            elif any(r in group.dropped for r in rs):
                missing[i] = prior.get(i, "left out of an earlier refit")
            else:
                silent = [r for r in rs if f"status/{tag}/{r}" in silent_keys]
                missing[i] = (
                    f"rank(s) {span(silent)} did not report step 'enter' of refit {refit} within {wait_s:g}s "
                    "(replica_timeout_s: dead or hung)"
                )
                group.dropped.update(rs)
        error = ""
        if len(full) < (cfg.min_replicas or cfg.num_replicas):
            error = _too_few(cfg, full, missing, "enter")
        present = tuple(range(cfg.num_sources)) + tuple(r for i in full for r in replica_ranks(cfg, i))
        roster = wire.Roster(refit=refit, present=() if error else present, missing=missing, error=error)
        group.put(key, roster, step="enter")
    else:
        # Rank 0 waits for the trainer ranks, then the replicas: wait for both.
        wait_s = cfg.timeout_s + (cfg.replica_timeout_s or cfg.timeout_s)
        if group._wait_keys([key], start + wait_s, step="enter", watch_epoch=True):
            raise RefitError(
                "enter", {group.rank: f"refit rank 0 did not say who takes part in refit {refit} within {wait_s:g}s"}
            )
        (got,) = group.get_many([key], wire.Roster, step="enter")
        assert isinstance(got, wire.Roster)
        roster = got
    group.roster = roster
    if roster.error:
        raise RefitError("enter", {group.rank: roster.error}, version=refit)
    if group.rank not in roster.present:
        i = replica_of(cfg, group.rank)
        why = roster.missing.get(i, "left out")
        raise RefitError(
            "enter",
            {
                group.rank: f"rank {group.rank} (replica {i}) missed refit {refit}: {why}; it still serves refit "
                f"{status.last_refit} (nothing was written into it) and rejoins at the next refit"
            },
            version=refit,
        )
    group.present = roster.present
    keys = [f"status/{tag}/{r}" for r in roster.present]
    statuses = [s for s in group.get_many(keys, wire.Status, step="enter") if isinstance(s, wire.Status)]
    errors = {s.rank: s.error for s in statuses if not s.ok}
    if errors:
        raise RefitError("enter", errors, version=refit, agreed=True)
    return statuses
