"""The refit group: one process group spanning every trainer rank and every
engine worker, created from a TCPStore, never touching the default group.

Rendezvous is one address (``host:port``), a job name and a job token.
Every key lives under ``reshard/<job>/g<generation>/<namespace>/e<epoch>``
on ``TCPStore(host, port)``: the namespace is derived from the token
(:mod:`reshard.transport.auth`), and every value reshard writes there is
sealed (encrypted and authenticated) with keys derived from it. Trainer
ranks take refit ranks ``0 .. S-1``, engine workers ``S .. S+D-1``; ranks
join in any order within the timeout. The process group is a c10d
``ProcessGroupGloo`` (CPU tensors) or ``ProcessGroupNCCL`` (CUDA tensors)
built directly on that store: engines and trainers keep their own default
groups untouched.

**Epochs** rebuild a group after a failure without anyone choosing a new
generation. Each rank claims a slot (``store.add``) in the current epoch when
it joins; a rank that finds its slot already taken (it joined this epoch
before and the group failed since, or it is a restarted process) moves the
job to the next epoch (``compare_set``, so concurrent movers agree), and
ranks still in an older epoch follow as soon as they notice (at the start of
their next refit, or while they wait for one). A group that failed is never
reused: fresh keys, fresh connections.

Call order (every rank):

1. :meth:`RefitGroup.join` - connect, check the token, claim a slot,
   announce, wait for all ranks, build the process group. A rank that never
   joins makes every other rank raise :class:`RefitError` (step ``join``)
   naming it, within the timeout.
2. For each refit, :meth:`RefitGroup.begin`, then :meth:`RefitGroup.agree`
   for each step: every rank posts its :class:`Status` and reads everyone's,
   so one rank's error reaches all.
3. :meth:`RefitGroup.close` when done, or after a failed transfer (the next
   join rebuilds the group in a new epoch).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reshard.errors import MetadataError, RefitError, span
from reshard.transport import joining, members, wire
from reshard.transport.auth import JobKeys, job_keys
from reshard.transport.config import GroupConfig
from reshard.transport.messages import BIG_BYTES
from reshard.transport.store import STORE_CALL_BOUND_S, BoundedStore, StoreCalls, connect_store, serve_store

if TYPE_CHECKING:
    import torch

__all__ = ["ABORT_GRACE_S", "GroupConfig", "RefitGroup", "serve_store"]

log = logging.getLogger(__name__)

_POLL_MAX_S = 0.02
_POLL_FAST_S = 1.0
"""For this long a wait polls the store at least every
:func:`_fast_poll` seconds (agreements are usually that quick), then
backs off to :data:`_POLL_MAX_S`."""
_WATCH_S = 0.1
"""How often a wait also checks the abort key and the epoch."""
ABORT_GRACE_S = 10.0
"""After an abort, how long an agreement waits for the other ranks' statuses."""
_SEAL_OVERHEAD = 64


class Statuses(list):
    """The statuses an agreement read, ordered by rank: every rank's
    (``everyone``), or only the peers' the caller named."""

    def __init__(self, statuses: Iterable[wire.Status] = (), *, everyone: bool = True) -> None:
        super().__init__(statuses)
        self.everyone = everyone


class EpochMoved(RefitError):
    """Another rank rebuilt the group (a newer epoch) while this one waited."""


# -- the group -------------------------------------------------------------------


@dataclass(slots=True)
class RefitGroup:
    """A joined refit group (see the module docstring for the call order)."""

    config: GroupConfig
    rank: int
    role: str
    store: Any
    """The raw c10d store of this epoch (process groups rendezvous on it)."""
    pg: Any
    backend: str
    device: Any = None
    """This rank's ``torch.device`` for the group: its communicator's CUDA
    device (with its index), or the host. Every buffer posted on :attr:`pg`
    is on it; local tensors elsewhere are staged."""
    coalesces: bool = False
    """Whether a round's operations are posted as one group (NCCL's; see
    :mod:`reshard.transport.posting`)."""
    hellos: dict[int, wire.Hello] = field(default_factory=dict)
    keys: JobKeys | None = None
    epoch: int = 0
    seq: int = 0
    """Refits begun on this group; keys of a refit's steps carry it."""
    cancelled: Any = None
    """``() -> str | None``: why this rank's owner gave up on the refit in
    progress (another thread says so); every wait checks it."""
    _ns: Any = None
    _tcp_store: Any = None
    _channels: dict[tuple[int, int], Any] = field(default_factory=dict)
    _export_maps: Any = None
    _cuda_imports: Any = None
    no_wire: str = ""
    """Why this group has no process group, so that every byte must move
    by CUDA IPC (two ranks on one GPU); empty: it has one (or is closed)."""
    _shm_seq: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    _steps: dict[int, list[str]] = field(default_factory=dict)
    """Steps agreed on per refit (:attr:`seq`), whose keys :meth:`forget` deletes."""
    _calls: StoreCalls | None = None

    @property
    def calls(self) -> StoreCalls:
        """reshard's own calls on the store, each bounded (:class:`StoreCalls`)."""
        if self._calls is None:
            bound = min(self.config.timeout_s, STORE_CALL_BOUND_S)
            self._calls = StoreCalls(self.config.address, bound)
        return self._calls

    @property
    def kv(self) -> BoundedStore:
        """:attr:`store` for reshard's own keys: every call bounded."""
        return BoundedStore(self.store, self.calls)

    @property
    def ns_kv(self) -> BoundedStore:
        """The job's namespace (the epoch key), every call bounded."""
        return BoundedStore(self._ns, self.calls)

    members: tuple[int, ...] = ()
    """The refit ranks of this epoch's group (every rank unless
    ``GroupConfig.min_replicas`` let it form without some replicas)."""
    present: tuple[int, ...] = ()
    """The refit ranks of the refit in progress (:mod:`reshard.transport.members`)."""
    roster: wire.Roster | None = None
    """Who takes part in the refit in progress, as rank 0 decided (elastic groups)."""
    dropped: set[int] = field(default_factory=set)
    """Rank 0 of an elastic group: members left out of a refit of this epoch
    (not waited for again until they knock)."""

    # -- joining -------------------------------------------------------------

    @classmethod
    def join(
        cls,
        config: GroupConfig,
        *,
        rank: int,
        device: torch.device | str = "cpu",
        budget_bytes: int = 0,
        round_bytes: int = 0,
        big_bytes: int = 0,
        cancelled: Any = None,
    ) -> RefitGroup:
        """Join (see the module docstring). ``budget_bytes``, ``round_bytes``
        and ``big_bytes`` are this rank's planning inputs, published in its
        hello so that every rank plans from the same values
        (:meth:`plan_inputs`). ``cancelled``: see :attr:`cancelled`."""
        import torch
        from torch.distributed import PrefixStore

        if not 0 <= rank < config.world_size:
            raise ValueError(f"refit rank {rank} outside 0..{config.world_size - 1}")
        elastic = config.elastic
        role = "source" if rank < config.num_sources else "destination"
        backend, dev = group_device(config.backend, torch.device(device), rank)
        timeout = datetime.timedelta(seconds=config.timeout_s)
        keys = job_keys(config.token, config.job, config.generation)
        deadline = time.monotonic() + config.timeout_s
        tcp = connect_store(config, rank)
        hello, dev = joining.hello_for(
            config, rank, role, dev, backend, budget_bytes=budget_bytes, round_bytes=round_bytes, big_bytes=big_bytes
        )
        hello_keys = [f"hello/{r}" for r in range(config.world_size)]
        try:
            base = PrefixStore(f"reshard/{config.job}/g{config.generation}", tcp)
            # The first rank to join fixes the job's token; a rank with another
            # one is refused here instead of waiting for peers it cannot see.
            first = bytes(base.compare_set("token", "", keys.fingerprint)).decode(errors="replace")
            if first != keys.fingerprint:
                hint = "" if keys.has_token else " (this rank has none: set GroupConfig.token or $RESHARD_TOKEN)"
                raise RefitError(
                    "join",
                    {
                        rank: f"refused: job {config.job!r} generation {config.generation} on the refit store at "
                        f"{config.address} was joined with a different job token{hint}"
                    },
                )
            ns = PrefixStore(keys.namespace, base)
            ns.compare_set("epoch", "", "0")
        except RefitError:
            raise
        except Exception as e:
            raise RefitError("join", {rank: f"the refit store at {config.address} failed: {e}"}) from e
        while True:
            try:
                if elastic and role == "destination":
                    epoch, fresh = members.claim(ns, rank)
                else:
                    epoch, fresh = joining.claim(ns, rank), True
            except Exception as e:
                raise RefitError("join", {rank: f"the refit store at {config.address} failed: {e}"}) from e
            group = cls(
                config=config,
                rank=rank,
                role=role,
                store=PrefixStore(f"e{epoch}", ns),
                pg=None,
                backend=backend,
                device=dev,
                coalesces=backend == "nccl",
                keys=keys,
                epoch=epoch,
                cancelled=cancelled,
                _ns=ns,
                _tcp_store=tcp,
            )
            everyone = tuple(range(config.world_size))
            group.members = group.present = everyone
            try:
                if not fresh:
                    members.knock(group, deadline, "it was in this group before")
                group.put(f"hello/{rank}", hello, step="join")
                if elastic:
                    members.form(group, deadline)
                    hello_keys = [f"hello/{r}" for r in group.members]
                    missing = []
                else:
                    missing = group._wait_keys(hello_keys, deadline, step="join", watch_epoch=True)
            except EpochMoved:
                continue
            break
        if missing:
            ranks = [int(k.split("/")[1]) for k in missing]
            raise RefitError(
                "join",
                {rank: f"rank(s) {ranks} did not join the refit group {config.job!r} within {config.timeout_s}s"},
            )
        for r, h in zip(group.members, group.get_many(hello_keys, wire.Hello, step="join"), strict=True):
            assert isinstance(h, wire.Hello)
            if h.rank != r:
                raise RefitError("join", {rank: f"hello/{r} holds the hello of rank {h.rank}"})
            group.hellos[r] = h
        joining.check_hellos(group.hellos, config, rank)
        group.no_wire = joining.shared_gpus(group.hellos) if backend == "nccl" else ""
        if group.no_wire:
            log.info("rank %d: no NCCL process group: %s", rank, group.no_wire)
        else:
            group.pg = joining.make_pg(group.store, config, rank, backend, dev, timeout, ranks=group.members)
            if len(group.members) != config.world_size:
                group.pg = members.MemberPG(group.pg, group.members)
        return group

    def plan_inputs(self) -> tuple[int, int, dict[int, int]]:
        """``(round_bytes, big_bytes, budgets)`` every rank plans with: the
        smallest round and message sizes any rank asked for, and each rank's
        staging budget (ranks that said nothing take the defaults)."""
        rounds = [h.round_bytes for h in self.hellos.values() if h.round_bytes > 0]
        bigs = [h.big_bytes for h in self.hellos.values() if h.big_bytes > 0]
        return (
            min(rounds) if rounds else 0,
            min(bigs) if bigs else BIG_BYTES,
            {r: h.budget_bytes for r, h in self.hellos.items()},
        )

    # -- sealed values --------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def _name(self, key: str) -> str:
        return f"e{self.epoch}/{key}"

    def seal(self, key: str, msg: wire.Message) -> bytes:
        assert self.keys is not None
        return self.keys.seal(self._name(key), wire.encode(msg))

    def open(self, key: str, value: bytes, expect: type | None = None) -> wire.Message:
        """Authenticate, decrypt and decode a value read from ``key``
        (:class:`MetadataError` if anything is wrong with it)."""
        assert self.keys is not None
        limit = self.config.max_metadata_bytes
        if len(value) > limit + _SEAL_OVERHEAD:
            raise MetadataError(f"refit metadata at {key!r} of {len(value)} bytes exceeds the {limit}-byte limit")
        return wire.decode(self.keys.open(self._name(key), value), expect, limit=limit)

    def put(self, key: str, msg: wire.Message, *, step: str) -> None:
        try:
            self.kv.set(key, self.seal(key, msg))
        except Exception as e:
            raise self._store_error(step, e) from e

    def get_many(self, keys: list[str], expect: type, *, step: str) -> list[wire.Message]:
        try:
            values = self.kv.multi_get(keys) if keys else []
        except Exception as e:
            raise self._store_error(step, e) from e
        try:
            return [self.open(k, v, expect) for k, v in zip(keys, values, strict=True)]
        except MetadataError as e:
            raise RefitError(step, {self.rank: str(e)}) from e

    def publish_once(self, key: str, msg: wire.Message, *, step: str) -> None:
        """Put ``msg`` under ``key`` unless a rank already did (content-addressed
        keys: a tensor table every rank of a side shares)."""
        try:
            present = self.kv.check([key])
        except Exception as e:
            raise self._store_error(step, e) from e
        if not present:
            self.put(key, msg, step=step)

    def wait_for(self, keys: list[str], *, step: str) -> list[str]:
        """Wait, within the group's timeout, until every key exists (watching
        for a rebuilt group and a cancel); the keys still missing then."""
        return self._wait_keys(keys, time.monotonic() + self.config.timeout_s, step=step, watch_epoch=True)

    def _store_error(self, step: str, e: BaseException) -> RefitError:
        return RefitError(
            step,
            {self.rank: f"the refit store at {self.config.address} is unreachable (did its host process die?): {e}"},
        )

    # -- epochs ------------------------------------------------------------------

    def current_epoch(self) -> int:
        """The job's epoch on the store (newer than ours: the group was rebuilt)."""
        try:
            return int(self.ns_kv.get("epoch"))
        except Exception as e:
            raise self._store_error("enter", e) from e

    def domain_of(self) -> dict[int, int]:
        """Domain index per rank (labels numbered in sorted order)."""
        labels = sorted({h.domain for h in self.hellos.values()})
        index = {lab: i for i, lab in enumerate(labels)}
        return {r: index[h.domain] for r, h in self.hellos.items()}

    def shares_memory(self, peer: int) -> bool:
        """Whether this rank and ``peer`` move bytes through shared memory
        (both said so, on one host, with CPU tensors; the same on both sides)."""
        return self.direct_link(self.rank, peer) == "shm"

    def direct_link(self, src: int, dst: int) -> str:
        """How destination ``dst`` reads source ``src``'s exported tensors
        directly: ``shm`` (CPU tensors in shared memory), ``ipc`` (a GPU it
        sees, on the same host), or ``""`` (it cannot). Decided from the
        hellos alone, so both ranks decide alike."""
        s, d = self.hellos.get(src), self.hellos.get(dst)
        if s is None or d is None:
            return ""
        if s.shm_host and s.shm_host == d.shm_host:
            return "shm"
        if not (s.ipc_host and s.ipc_host == d.ipc_host and s.gpu and s.gpu in d.gpus):
            return ""
        # Across two GPUs NCCL carries the bytes over the same NVLink and no
        # receiver opens a CUDA context on a foreign GPU (a few hundred MB
        # each, which the engine never counted): CUDA IPC only within one
        # GPU, or one process, or where no NCCL communicator can exist
        # (ranks sharing a GPU).
        if s.gpu == d.gpu or (s.process and s.process == d.process) or self.no_wire:
            return "ipc"
        return ""

    def same_process(self, rank: int) -> bool:
        """Whether ``rank`` runs in this rank's process (TRL's colocate mode)."""
        mine, theirs = self.hellos.get(self.rank), self.hellos.get(rank)
        return mine is not None and theirs is not None and bool(mine.process) and mine.process == theirs.process

    def shm_seq(self, src: int, dst: int, slot_bytes: int) -> int:
        """The next round number of the channel ``src -> dst`` with slots of
        ``slot_bytes`` (counted alike on both sides, in round order; a new
        slot size means a new channel, counted from 1)."""
        size, n = self._shm_seq.get((src, dst), (slot_bytes, 0))
        n = n + 1 if size == slot_bytes else 1
        self._shm_seq[(src, dst)] = (slot_bytes, n)
        return n

    def channel(self, src: int, dst: int, slot_bytes: int, *, deadline: float, watch) -> Any:
        """The shared-memory channel ``src -> dst`` (this rank is one of them),
        created by the sender, mapped by the receiver, kept for later refits;
        a busier plan replaces it with a bigger one."""
        from reshard.transport.shm import Channel, channel_name

        ch = self._channels.get((src, dst))
        if ch is not None and ch.slot_bytes == slot_bytes:
            return ch
        if ch is not None:
            ch.close()
        assert self.keys is not None
        name = channel_name(self.keys.namespace, self.epoch, src, self.hellos[src].pid, dst, slot_bytes)
        ch = Channel(name, slot_bytes, create=src == self.rank, deadline=deadline, watch=watch)
        self._channels[(src, dst)] = ch
        return ch

    def exported(self, src: int, export: wire.Export) -> torch.Tensor:
        """Source rank ``src``'s exported tensor, mapped (or, on a GPU,
        opened) in this process once; kept for later refits, see
        :meth:`retain_exports`."""
        pid = self.hellos[src].pid
        if export.cuda is not None:
            from reshard.transport.ipc import CudaImports

            if self._cuda_imports is None:
                self._cuda_imports = CudaImports(self.rank)
            return self._cuda_imports.tensor(pid, export, local=self.same_process(src))
        from reshard.transport.shm import ExportMaps

        if self._export_maps is None:
            self._export_maps = ExportMaps()
        return self._export_maps.tensor(pid, export)

    def retain_exports(self, exports: Mapping[int, Iterable[wire.Export]]) -> None:
        """Unmap (or release) exported storages that no source rank publishes any longer."""
        exports = {r: list(es) for r, es in exports.items()}
        published = [(self.hellos[r].pid, e) for r, es in exports.items() for e in es]
        if self._export_maps is not None:
            self._export_maps.retain({(pid, e.fd, e.inode) for pid, e in published if e.cuda is None})
        if self._cuda_imports is not None:
            key = self._cuda_imports.key
            self._cuda_imports.retain(
                {
                    key(self.hellos[r].pid, e, local=self.same_process(r))
                    for r, es in exports.items()
                    for e in es
                    if e.cuda is not None
                }
            )

    def peer_alive(self, peer: int) -> bool:
        """False when ``peer`` runs on this host (shared memory, CUDA IPC) and its process is gone."""
        if not (self.direct_link(peer, self.rank) or self.direct_link(self.rank, peer)):
            return True
        try:
            os.kill(self.hellos[peer].pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True

    def _wait_keys(
        self,
        keys: list[str],
        deadline: float,
        *,
        step: str,
        abort_grace: float | None = None,
        watch_epoch: bool = False,
    ) -> list[str]:
        """Wait until every key exists; return the missing ones at the deadline
        (see :meth:`_wait`)."""
        store = self.kv
        if self._wait(lambda: store.check(keys), deadline, step=step, abort_grace=abort_grace, watch_epoch=watch_epoch):
            return []
        try:
            return [k for k in keys if not store.check([k])]
        except Exception as e:
            raise self._store_error(step, e) from e

    def _wait(
        self,
        done: Callable[[], bool],
        deadline: float,
        *,
        step: str,
        abort_grace: float | None = None,
        watch_epoch: bool = False,
    ) -> bool:
        """Poll ``done()`` (a store read) until it holds; ``False`` at the deadline.

        With ``abort_grace``, an abort of the current refit shortens the wait
        to that many seconds (the other ranks post their status right after
        it). With ``watch_epoch``, raises :class:`EpochMoved` when another rank
        rebuilt the group. A store that fails raises :class:`RefitError`.
        """
        store = self.kv
        pause = 0.0002
        started = time.monotonic()
        fast = _fast_poll(self.world_size)
        next_watch = started + _WATCH_S
        aborted = False
        try:
            while True:
                if done():
                    return True
                now = time.monotonic()
                if now >= next_watch:
                    next_watch = now + _WATCH_S
                    why = self.cancelled() if self.cancelled is not None else None
                    if why:
                        raise RefitError(step, {self.rank: f"cancelled: {why}"})
                    if abort_grace is not None and not aborted and store.check([self.abort_key()]):
                        aborted = True
                        deadline = min(deadline, now + abort_grace)
                    if watch_epoch:
                        epoch = int(self.ns_kv.get("epoch"))
                        if epoch != self.epoch and not done():
                            text = f"the refit group was rebuilt by another rank (epoch {self.epoch} -> {epoch})"
                            raise EpochMoved(step, {self.rank: text})
                if now >= deadline:
                    return False
                # Polling, not store.wait: a timed-out wait logs a warning each time.
                time.sleep(pause)
                pause = min(pause * 1.5, fast if now - started < _POLL_FAST_S else _POLL_MAX_S)
        except RefitError:
            raise
        except Exception as e:
            raise self._store_error(step, e) from e

    # -- refits -------------------------------------------------------------------

    def begin(self) -> int:
        """Start the next refit on this group: its steps' keys are fresh even
        when a refit number is reused after a rejected one."""
        self.seq += 1
        return self.seq

    def abort_key(self) -> str:
        """The abort key of the refit in progress on this group: keys follow
        :attr:`seq` (:meth:`begin`), not refit numbers, so a refit number
        reused after a rejected refit gets a fresh key."""
        return f"abort/{self.seq}"

    def signal_abort(self, message: str, *, refit: int = 0) -> None:
        """Tell every rank that the refit in progress failed (first message
        wins); ``refit``: its number, for the record."""
        # The store may be gone; then peers notice that themselves.
        with contextlib.suppress(Exception):
            key = self.abort_key()
            value = self.seal(key, wire.Status(rank=self.rank, step="abort", refit=refit, ok=False, error=message))
            self.kv.compare_set(key, "", value)

    def aborted(self) -> str | None:
        """Why the refit in progress was aborted, or ``None``."""
        key = self.abort_key()
        try:
            if not self.kv.check([key]):
                return None
            value = self.kv.get(key)
        except Exception as e:
            return f"the refit store at {self.config.address} is unreachable (did its host process die?): {e}"
        try:
            s = self.open(key, value, wire.Status)
        except MetadataError as e:
            return f"an abort that failed authentication ({e})"
        assert isinstance(s, wire.Status)
        return f"rank {s.rank}: {s.error}"

    def agree(
        self,
        step: str,
        refit: int,
        status: wire.Status,
        *,
        timeout_s: float | None = None,
        peers: Iterable[int] | None = None,
        common: bytes | None = None,
        slow: bool = False,
    ) -> Statuses:
        """Post this rank's status for ``step`` and return every rank's, or,
        when nothing needs them, only those of ``peers`` (and this rank's).

        Every rank posts its status, then counts itself in (one counter per
        step); each waits for the count to reach the world, polling that one
        key. A rank whose status is not ok, whose ``common`` (values every
        rank must hold alike) differs from the first rank's, or that asks
        for it (``slow``), marks the step before it counts in; then every
        rank reads every status, as it does when a rank does not count in in
        time. Otherwise each reads only its ``peers``' statuses (``None``:
        all), so what a rank reads and writes grows with its peers, not with
        the world. :attr:`Statuses.everyone` tells the two apart (the same on
        every rank).

        Raises :class:`RefitError` on every rank if any rank reported an error,
        or if a rank does not report within ``timeout_s`` (default: the group's
        timeout; after an abort, :data:`ABORT_GRACE_S`); otherwise returns the
        statuses read (ordered by rank). The error is ``agreed`` when every
        rank reported: all ranks raise the same error and the group stays usable.
        """
        tag = f"{self.seq}/{step}"
        prefix = f"status/{tag}"
        self._steps.setdefault(self.seq, []).append(step)
        self.put(f"{prefix}/{self.rank}", status, step=step)
        try:
            slow = slow or not status.ok
            if common is not None:
                mine = hashlib.blake2b(common, digest_size=16).hexdigest()
                first = bytes(self.kv.compare_set(f"common/{tag}", "", mine)).decode(errors="replace")
                slow = slow or first != mine
            if slow:
                self.kv.append(f"slow/{tag}", f"{self.rank},")
            self.kv.add(f"count/{tag}", 1)
        except Exception as e:
            raise self._store_error(step, e) from e
        keys = [f"{prefix}/{r}" for r in self.present]
        wait = self.config.timeout_s if timeout_s is None else timeout_s
        grace = min(self.config.timeout_s, ABORT_GRACE_S)
        counter = f"count/{tag}"
        try:
            counted = self._wait(
                lambda: int(self.kv.add(counter, 0)) >= len(self.present),
                time.monotonic() + wait,
                step=step,
                abort_grace=grace,
                watch_epoch=True,
            )
        except EpochMoved as e:
            # Say what this rank was waiting for (a dead rank, usually).
            with contextlib.suppress(Exception):
                late = [int(k.rsplit("/", 1)[1]) for k in keys if not self.kv.check([k])]
                who = f"rank {late[0]}" if len(late) == 1 else f"ranks {span(late)}"
                why = self.aborted()
                text = f"{e.errors[self.rank]} while waiting for {who} to report step {step!r}"
                e.errors[self.rank] = text + (f"; the refit was aborted by {why}" if why else "")
                e.args = (str(RefitError(step, e.errors, version=refit)),)
            raise
        try:
            everyone = not counted or peers is None or self.kv.check([f"slow/{tag}"])
            missing = [] if counted else [k for k in keys if not self.kv.check([k])]
        except Exception as e:
            raise self._store_error(step, e) from e
        wanted = keys if everyone else [f"{prefix}/{r}" for r in sorted({self.rank, *(peers or ())})]
        present = [k for k in wanted if k not in missing]
        try:
            values = self.kv.multi_get(present) if present else []
        except Exception as e:
            raise self._store_error(step, e) from e
        statuses: list[wire.Status] = []
        errors: dict[int, str] = {}
        for k, v in zip(present, values, strict=True):
            r = int(k.rsplit("/", 1)[1])
            try:
                s = self.open(k, v, wire.Status)
            except MetadataError as e:
                errors[r] = str(e)
                continue
            assert isinstance(s, wire.Status)
            statuses.append(s)
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
            raise RefitError(step, errors, version=refit, agreed=not missing)
        return Statuses(sorted(statuses, key=lambda s: s.rank), everyone=everyone)

    def forget(self, seq: int) -> None:
        """Delete this rank's status keys of refit ``seq`` on this group (keeps
        the store small); rank 0 also deletes the step counters. Call it once
        every rank is past refit ``seq`` (it entered a later one): a rank
        still waiting on a deleted counter would wait for ever."""
        for step in self._steps.pop(seq, ()):
            with contextlib.suppress(Exception):
                self.kv.delete_key(f"status/{seq}/{step}/{self.rank}")
                if self.rank == 0:
                    for kind in ("count", "common", "slow"):
                        self.kv.delete_key(f"{kind}/{seq}/{step}")

    # -- teardown -------------------------------------------------------------

    def close(self) -> None:
        """Drop the process group: its connections close, so peers blocked on
        this rank fail at once instead of waiting for their timeout."""
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()
        if self._export_maps is not None:
            self._export_maps.close()
        if self._cuda_imports is not None:
            self._cuda_imports.close()
        if self._calls is not None:
            self._calls.close()
        pg = self.pg
        self.pg = None
        if pg is not None and self.backend == "nccl":
            with contextlib.suppress(Exception):
                pg.abort()
        del pg


def group_device(backend: str, dev: torch.device, rank: int) -> tuple[str, torch.device]:
    """The process group a rank builds and the device its buffers are on,
    from ``GroupConfig.backend`` and the device its tensors are on: ``auto``
    takes NCCL for CUDA tensors, gloo otherwise; gloo posts host buffers
    (CUDA tensors are staged through host memory); NCCL posts buffers on the
    rank's current CUDA device when its tensors are in host memory (an
    offloaded trainer: its shards are staged through the device)."""
    import torch

    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "gloo":
        return backend, torch.device("cpu")
    if dev.type != "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"refit rank {rank}: GroupConfig.backend is 'nccl' but this process sees no CUDA device")
        dev = torch.device("cuda", torch.cuda.current_device())
    return backend, dev


def _fast_poll(world_size: int) -> float:
    """The longest pause of a wait's first second: 1 ms in small groups, more
    in large ones so that the store serves at most ~10k checks a second."""
    return min(_POLL_MAX_S, max(0.001, world_size * 1e-4))
