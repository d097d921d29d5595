"""One rank's side of refits: join, publish its layout, plan, agree, execute.

Shared by :class:`reshard.Sender` (trainer ranks) and
:class:`reshard.Receiver` (engine workers). Call order on every rank:

1. ``connect()`` - join the group, publish this rank's layout, read every
   rank's layout (tables are stored once per distinct table), check and
   index them.
2. ``refit(n)`` for refits ``n = 1, 2, ...`` (strictly increasing):
   0. agree on step ``enter``: every rank runs the same refit number, newer
      than the last one that succeeded on any rank; otherwise every rank
      raises :class:`RefitError` (step ``version``) before any byte moves.
      A rank that cannot take the refit (``LocalTensors.refusal``: an engine out of room
      for it) makes every rank raise :class:`RefitError` (step ``enter``)
      with its reason, before any byte moves.
      A rank whose group another rank rebuilt (a newer epoch) rejoins first.
      The ``enter`` statuses carry every rank's layout digest: a rank whose
      layout changed since the others last read it (:meth:`set_layout`)
      publishes it again and every rank reads it before planning.
   a. plan this rank and check what the plan touches. Plans are cached by
      the digests of every rank's layout, the domains and the round sizes, so
      a refit whose inputs were planned before (the next refit, a group
      rebuilt after a failure, layouts that changed back) does not replan;
   b. agree on step ``plan``: every rank's problems reach every rank, which
      all raise :class:`RefitError` before any byte moves; if a rank's
      busiest round needs more staging than the budget, every rank replans
      with smaller rounds (a deterministic, global decision);
   c. execute the rounds;
   d. agree on step ``transfer``: every rank learns whether all ranks finished.
   A refit that fails at a step where ranks may have been left mid-way drops
   the group; the next ``refit`` joins a rebuilt one (a new epoch), so the
   same session (an engine worker, say) refits again without a restart.
3. ``close()``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from reshard.errors import MetadataError, PlanError, Problem, RefitError, span
from reshard.plan.checks import check_locals
from reshard.plan.index import LayoutSet, gc_paused
from reshard.plan.items import RankPlan
from reshard.plan.layout import Layout, TensorMeta, layout_digest, table_digest
from reshard.plan.planner import Planner
from reshard.plan.rounds import DEFAULT_ROUND_BYTES
from reshard.transport import members, wire
from reshard.transport.baseline import gather_broadcast
from reshard.transport.delta import DeltaRun, DeltaState, capable_pairs, pair_reason
from reshard.transport.execute import Executor
from reshard.transport.exports import SessionExports
from reshard.transport.group import ABORT_GRACE_S, EpochMoved, GroupConfig, RefitGroup, Statuses
from reshard.transport.links import no_wire_problems
from reshard.transport.locals import LocalTensors, local_tensors
from reshard.transport.messages import (
    BIG_BYTES,
    DEFAULT_BUDGET_BYTES,
    check_links,
    link_problem,
    link_summary,
    staging_bound,
)
from reshard.transport.posting import off_device_locals, on_device
from reshard.transport.progress import Progress, wants_progress
from reshard.transport.stats import ExecStats, RefitStats

if TYPE_CHECKING:
    import torch

__all__ = ["ABORT_GRACE_S", "DEFAULT_BUDGET_BYTES", "RefitSession", "RefitStats"]

log = logging.getLogger(__name__)

_PLAN_ATTEMPTS = 8
"""Times a refit shrinks its rounds to fit every rank's staging budget."""
_REJOINS = 4
"""Rebuilds a refit follows before giving up (each is another rank's rejoin)."""
_PLANS_KEPT = 4
"""Plans a session keeps, keyed by what they were planned from."""


class RefitSession:
    def __init__(
        self,
        config: GroupConfig,
        *,
        rank: int,
        layout: Layout,
        tensors: Mapping[str, torch.Tensor] | LocalTensors,
        device: torch.device | str = "cpu",
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        round_bytes: int | None = None,
        big_bytes: int = BIG_BYTES,
        progress: bool | None = None,
    ) -> None:
        """``tensors``: this rank's local tensors (:class:`LocalTensors`, or a
        mapping). ``progress``: draw a progress line for long refits
        (:mod:`reshard.transport.progress`; ``None``: on refit rank 0 when
        its stderr is a terminal)."""
        if layout.rank != rank:
            raise ValueError(f"layout is for rank {layout.rank}, session for rank {rank}")
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        if round_bytes is not None and round_bytes <= 0:
            raise ValueError(f"round_bytes must be positive, got {round_bytes}")
        if big_bytes <= 0:
            raise ValueError(f"big_bytes must be positive, got {big_bytes}")
        self.config = config
        self.rank = rank
        self.layout = layout
        self.tensors = local_tensors(tensors)
        self.device = device
        self.budget_bytes = budget_bytes
        self._asked = (round_bytes or max(1, min(DEFAULT_ROUND_BYTES, budget_bytes // 2)), big_bytes)
        """Round and message sizes this rank asks for; the group plans with the
        smallest any rank asked for (see :meth:`RefitGroup.plan_inputs`)."""
        self.round_bytes, self.big_bytes = self._asked
        self.progress = progress
        self._cancelled: str | None = None
        self.budgets: dict[int, int] = {}
        """Every rank's staging budget, as published when it joined."""
        self.group: RefitGroup | None = None
        self.planner: Planner | None = None
        self._plan: RankPlan | None = None
        self.last_refit = 0
        """The last refit that succeeded on this rank."""
        self._digest = layout_digest(layout)
        self._layouts: dict[int, Layout] = {}
        self._read: dict[int, str] = {}
        """The digest of every rank's layout as this rank last read it."""
        self._sets: tuple[tuple[tuple[int, str], ...], LayoutSet, LayoutSet] | None = None
        self._plans: OrderedDict[tuple, _Planned] = OrderedDict()
        self.plans_made = 0
        """Plans this session computed (the others came from its cache)."""
        self.broadcast_groups: dict[int, object] = {}
        """The baseline's broadcast groups (one per root), as long as the refit group lives."""
        self.exports = SessionExports(rank, is_source=self.is_source)
        """What this rank publishes (a source) or reads (a destination) for direct reads."""
        self.delta = DeltaState(budget_bytes=config.delta_budget_bytes)
        self._arena: torch.Tensor | None = None
        """The host staging arena of the last refit, reused by the next."""
        """Delta refits (``GroupConfig.delta``): what this rank's snapshot or
        tensors hold, and since when (:mod:`reshard.transport.delta`)."""
        self._newest = 0
        """The group's last successful refit, as the ``enter`` step found it."""
        self._missed_after: int | None = None
        """The refit this rank served when it came back after missing later ones
        (``None``: it missed none), as the ``enter`` step found it."""

    @property
    def is_source(self) -> bool:
        return self.rank < self.config.num_sources

    def set_layout(self, layout: Layout, tensors: Mapping[str, torch.Tensor] | LocalTensors | None = None) -> bool:
        """Refit with ``layout`` (and ``tensors``, when given) from the next
        refit on; returns whether the layout changed. Every rank notices the
        change at that refit's ``enter`` step and reads this rank's layout
        again before planning (one rank's call is enough; nothing is sent on
        the old plan)."""
        if layout.rank != self.rank:
            raise ValueError(f"layout is for rank {layout.rank}, session for rank {self.rank}")
        if tensors is not None:
            self.tensors = local_tensors(tensors)
        digest = layout_digest(layout)
        if digest == self._digest:
            return False
        self.layout = layout
        self._digest = digest
        self.delta.void("its layout changed")
        return True

    # -- 1. connect ----------------------------------------------------------

    def connect(self) -> None:
        """Join the group (a rebuilt one after a failure) and read every layout."""
        for _ in range(_REJOINS):
            if self.group is not None:
                return
            try:
                self._connect()
                return
            except EpochMoved:
                self._drop()
        raise RefitError("layout", {self.rank: f"the refit group was rebuilt {_REJOINS} times while joining"})

    def _connect(self) -> None:
        group = RefitGroup.join(
            self.config,
            rank=self.rank,
            device=self.device,
            budget_bytes=self.budget_bytes,
            round_bytes=self._asked[0],
            big_bytes=self._asked[1],
            cancelled=lambda: self._cancelled,
        )
        self.group = group
        round_bytes, self.big_bytes, self.budgets = group.plan_inputs()
        self.round_bytes = round_bytes or self._asked[0]
        try:
            self._layouts, self._read = self._exchange_layouts(group, "join", list(group.members))
        except BaseException:
            self._drop()
            raise

    def _exchange_layouts(
        self, group: RefitGroup, tag: str, ranks: range | list[int], expect: Mapping[int, str] | None = None
    ) -> tuple[dict[int, Layout], dict[int, str]]:
        """Publish this rank's layout (when it is one of ``ranks``) under
        ``layout/<tag>/`` and read those of ``ranks``, with their digests
        (which must equal ``expect``'s, when given)."""
        cfg = self.config
        lay = self.layout
        if self.rank in ranks:
            digest = table_digest(lay.tensors)
            group.publish_once(f"table/{digest}", wire.Table(tensors=lay.tensors), step="layout")
            msg = wire.RankLayout(rank=lay.rank, table=digest, locals=lay.locals, pieces=lay.pieces, grids=lay.grids)
            group.put(f"layout/{tag}/{self.rank}", msg, step="layout")
        keys = [f"layout/{tag}/{r}" for r in ranks]
        missing = group.wait_for(keys, step="layout")
        if missing:
            raise RefitError("layout", {self.rank: f"no layout from {missing} within {cfg.timeout_s}s"})
        tables: dict[str, tuple[TensorMeta, ...]] = {}
        layouts: dict[int, Layout] = {}
        digests: dict[int, str] = {}
        try:
            with gc_paused():
                for r, rl in zip(ranks, group.get_many(keys, wire.RankLayout, step="layout"), strict=True):
                    assert isinstance(rl, wire.RankLayout)
                    if rl.rank != r:
                        raise MetadataError(f"layout/{tag}/{r} holds the layout of rank {rl.rank}")
                    if rl.table not in tables:
                        (t,) = group.get_many([f"table/{rl.table}"], wire.Table, step="layout")
                        assert isinstance(t, wire.Table)
                        if table_digest(t.tensors) != rl.table:
                            raise MetadataError(f"table {rl.table} does not match its digest")
                        tables[rl.table] = t.tensors
                    layouts[r] = Layout(
                        rank=r, tensors=tables[rl.table], locals=rl.locals, pieces=rl.pieces, grids=rl.grids
                    )
                    side = range(cfg.num_sources) if r < cfg.num_sources else range(cfg.num_sources, cfg.world_size)
                    wire.check_layout(layouts[r], ranks=side)
                    digests[r] = layout_digest(layouts[r], table=rl.table)
                    if expect is not None and digests[r] != expect[r]:
                        raise MetadataError(f"rank {r} announced layout {expect[r]} but published layout {digests[r]}")
        except (MetadataError, RefitError) as e:
            # Every rank reads the same layouts, so every rank raises this too.
            text = e.errors.get(self.rank, str(e)) if isinstance(e, RefitError) else str(e)
            raise RefitError("layout", {self.rank: f"cannot read the layouts: {text}"}) from e
        return layouts, digests

    def _reread_layouts(self, group: RefitGroup, statuses: list[wire.Status]) -> None:
        """Step ``enter``, continued: read again the layouts of the ranks
        whose digest changed since this rank last read them (every rank
        decides alike, from the same statuses)."""
        changed = {s.rank: s.layout for s in statuses if s.layout != self._read.get(s.rank)}
        if not changed:
            return
        ranks = sorted(changed)
        layouts, digests = self._exchange_layouts(group, f"s{group.seq}", ranks, expect=changed)
        self._layouts.update(layouts)
        self._read.update(digests)
        self.planner = None
        self._plan = None
        log.info(
            "refit rank %d: the layouts of rank(s) %s changed; planning from the new layouts", self.rank, span(ranks)
        )

    def _plan_key(self, round_bytes: int) -> tuple:
        assert self.group is not None
        layouts = tuple((r, self._read[r]) for r in self.group.present)
        return (layouts, tuple(sorted(self.group.domain_of().items())), round_bytes, self.big_bytes)

    def _layout_sets(self) -> tuple[LayoutSet, LayoutSet]:
        assert self.group is not None
        key = tuple((r, self._read[r]) for r in self.group.present)
        if self._sets is None or self._sets[0] != key:
            s = self.config.num_sources
            with gc_paused():
                sources = LayoutSet.from_layouts(
                    "source", [self._layouts[r] for r in range(s)], check_ranks=(self.rank,)
                )
                dests = LayoutSet.from_layouts(
                    "destination",
                    [self._layouts[r] for r in self.group.present if r >= s],
                    check_ranks=(self.rank,),
                )
            self._sets = (key, sources, dests)
        return self._sets[1], self._sets[2]

    def _cached(self) -> _Planned:
        """The planner (and this rank's plan, once made) for the current
        layouts, domains and round sizes, from the cache when planned before."""
        key = self._plan_key(self.round_bytes)
        entry = self._plans.get(key)
        if entry is None:
            assert self.group is not None
            sources, dests = self._layout_sets()
            planner = Planner(sources, dests, domain_of=self.group.domain_of(), round_bytes=self.round_bytes)
            entry = self._plans[key] = _Planned(planner)
            while len(self._plans) > _PLANS_KEPT:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return entry

    def _planner(self) -> Planner:
        if self.planner is None:
            self.planner = self._cached().planner
        return self.planner

    def _planned(self) -> tuple[RankPlan, tuple[dict, dict]]:
        """This rank's plan and its per-peer message summary (see :func:`link_summary`)."""
        if self._plan is None:
            entry = self._cached()
            self.planner = entry.planner
            if entry.plan is None:
                entry.plan = entry.planner.plan_for(self.rank)
                entry.links = link_summary(entry.plan, self.big_bytes)
                entry.peers = tuple(sorted({p for rnd in entry.plan.rounds for p in (*rnd.sends, *rnd.recvs)}))
                self.plans_made += 1
            self._plan, self._links = entry.plan, entry.links
        return self._plan, self._links

    def _replan(self, round_bytes: int) -> None:
        self.round_bytes = round_bytes
        self.planner = None
        self._plan = None

    # -- 2. refit --------------------------------------------------------------

    def _enter(self, refit: int, refuse: str = "") -> RefitGroup:
        """Step 0 (see the module docstring): returns the group to run on.
        ``refuse``: why this rank cannot take the refit (every rank raises it)."""
        for _ in range(_REJOINS):
            if self.group is None:
                self.connect()
            group = self.group
            assert group is not None
            try:
                if group.current_epoch() != group.epoch:
                    raise EpochMoved("enter", {self.rank: "the refit group was rebuilt by another rank"})
                group.begin()
                status = wire.Status(
                    rank=self.rank,
                    step="enter",
                    refit=refit,
                    ok=not refuse,
                    error=refuse or "",
                    last_refit=self.last_refit,
                    layout=self._digest,
                )
                if self.config.elastic:
                    called = members.roll_call(group, refit, status)
                    if called is None:
                        raise EpochMoved("enter", {self.rank: "a replica asked to join: the group is rebuilt with it"})
                    statuses = Statuses(called, everyone=True)
                    # The ranks present may differ from the last refit's: plan
                    # from the cache keyed by them.
                    self.planner = None
                    self._plan = None
                else:
                    statuses = group.agree("enter", refit, status, peers=(), common=self._enter_common(refit))
                break
            except EpochMoved:
                self._drop()
        else:
            raise RefitError("enter", {self.rank: f"the refit group was rebuilt {_REJOINS} times while entering"})
        # Every rank is past the previous refit on this group: its keys can go.
        group.forget(group.seq - 1)
        if not statuses.everyone:
            # Every rank holds this rank's refit number, last refit and view of
            # every layout (the agreement compared them): no layout changed.
            self._newest = self.last_refit
            if refit <= self.last_refit:
                raise self._stale(refit, self.last_refit, list(range(self.config.world_size)))
            return group
        numbers: dict[int, list[int]] = {}
        for s in statuses:
            numbers.setdefault(s.refit, []).append(s.rank)
        if len(numbers) > 1:
            text = "ranks disagree on the refit number: " + "; ".join(
                f"refit {n} on rank(s) {span(rs)}" for n, rs in sorted(numbers.items())
            )
            raise RefitError("version", dict.fromkeys(range(self.config.world_size), text), agreed=True)
        newest = max(s.last_refit for s in statuses)
        self._newest = newest
        self._missed_after = self.last_refit if self.config.elastic and refit > newest > self.last_refit else None
        if self._missed_after is not None:
            log.warning(
                "refit rank %d missed refit(s) %d..%d (it served refit %d): refit %d brings it the full version",
                self.rank,
                self.last_refit + 1,
                newest,
                self.last_refit,
                refit,
            )
        if refit <= newest:
            raise self._stale(refit, newest, [s.rank for s in statuses if s.last_refit == newest])
        self._reread_layouts(group, statuses)
        return group

    def _enter_common(self, refit: int) -> bytes:
        """What every rank must hold alike to enter ``refit`` without reading
        the others' statuses: the refit number, the last refit that
        succeeded, and every rank's layout digest (this rank's own current one)."""
        view = [self._read.get(r, "") for r in range(self.config.world_size)]
        view[self.rank] = self._digest
        return msgspec.msgpack.encode((refit, self.last_refit, view))

    @staticmethod
    def _stale(refit: int, newest: int, holders: list[int]) -> RefitError:
        text = (
            f"refit {refit} is stale or replayed: refit {newest} already succeeded on rank(s) {span(holders)}; "
            "refit numbers must strictly increase (nothing was sent)"
        )
        return RefitError("version", dict.fromkeys(holders, text), version=refit, agreed=True)

    def refit(self, refit: int, *, into: Mapping[str, torch.Tensor] | LocalTensors | None = None) -> RefitStats:
        """Run refit number ``refit`` (see the module docstring). ``into``:
        the tensors this refit writes (a destination) or reads (a source),
        with their own lifecycle (:class:`LocalTensors`: begun once the plan
        is agreed, told of every round that landed, finished before the
        outcome is agreed, where its failure fails the refit on every rank);
        default: the session's own. They must match this rank's layout."""
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        started_at = time.time()
        tensors = self._refit_tensors(into)
        with self._attempt(refit):
            group = self._enter(refit, tensors.refusal(refit))
            with on_device(group.device):
                enter_s = time.perf_counter() - t0
                exports = self.exports.publish(group, self.config, tensors, group.device, lambda: self._planned()[0])
                plan, statuses, agree_s = self._agree_plan(group, refit, tensors, exports)
                plan_s = time.perf_counter() - t0 - enter_s - agree_s
                delta = self._delta_run(group, plan, statuses) if group.config.delta else None
                exported = self.exports.needed(group, statuses, exports[0])
                ex_stats, error = self._execute(group, plan, refit, tensors, delta, exported)
                agree_s += enter_s + self._agree_outcome(group, refit, error)
                self.last_refit = refit
                assert ex_stats is not None
                if group.config.delta:
                    self._delta_done(group, plan, refit, tensors)
                    if self.is_source and self.delta.snapshots is not None:
                        self.delta.speeds.saw(ex_stats, group.device)
                return RefitStats(
                    refit=refit,
                    rank=self.rank,
                    exec=ex_stats,
                    plan_seconds=plan_s,
                    agree_seconds=agree_s,
                    total_seconds=time.perf_counter() - t0,
                    cpu_seconds=time.process_time() - cpu0,
                    round_bytes=self.round_bytes,
                    started_at=started_at,
                    finished_at=time.time(),
                    touched=frozenset(delta.touched) if delta is not None and not self.is_source else None,
                    **self._membership(group, refit),
                )

    def _membership(self, group: RefitGroup, refit: int) -> dict:
        """The replicas this refit reached and those it missed (:class:`RefitStats`)."""
        refit_replicas, missing = members.summary(group)
        return {"replicas": refit_replicas, "missing_replicas": missing, "missed_after": self._missed_after}

    @contextlib.contextmanager
    def _attempt(self, refit: int) -> Iterator[None]:
        """One refit's failure handling, the same for every method: a failed
        refit voids the delta fencing of this rank (its snapshot or base no
        longer follows its peers'), and drops the group unless every rank
        rejected the refit alike before any byte moved (then the group is
        clean and stays); a cancel holds for one refit."""
        try:
            yield
        except RefitError as e:
            self.delta.void(f"refit {refit} failed here at step {e.step!r}")
            if e.step == "transfer" or not e.agreed:
                # The group may be half-used (or a peer is gone): never reuse it.
                self._drop()
            raise
        except BaseException as e:
            self.delta.void(f"refit {refit} failed here ({type(e).__name__})")
            self._drop()
            raise
        finally:
            self._cancelled = None

    def _local_problems(self, tensors: LocalTensors) -> list[Problem]:
        """What is wrong with the local tensors of this refit (see :func:`check_locals`).
        Tensors that materialize on demand (``lazy``: an engine's parameters)
        are checked tensor by tensor as the executor first touches them instead."""
        if tensors.lazy:
            return []
        return check_locals(self.layout, tensors, role="source" if self.is_source else "destination")

    def _agree_plan(
        self,
        group: RefitGroup,
        refit: int,
        tensors: LocalTensors,
        exports: tuple[tuple[wire.Export, ...], str],
    ) -> tuple[RankPlan, list[wire.Status], float]:
        """Steps a/b: plan this rank and agree on the plan with every rank,
        shrinking rounds until every rank's staging fits its budget (``exports``:
        what this rank exports, and its digest). Returns the plan, every
        rank's status and the time spent agreeing."""
        local = self._local_problems(tensors)
        agree_s = 0.0
        for attempt in range(_PLAN_ATTEMPTS):
            step = "plan" if attempt == 0 else f"plan.{attempt}"
            status = self._plan_status(group, refit, step, local, exports, tensors)
            ta = time.perf_counter()
            # Over its budget, a rank makes every rank read every status: the
            # smaller rounds are one decision from every rank's need.
            over_budget = status.staging_need > self._budget(self.rank)
            peers = self._cached().peers if status.ok else ()
            statuses = group.agree(step, refit, status, peers=peers, slow=over_budget)
            agree_s += time.perf_counter() - ta
            over = {s.rank: s.staging_need for s in statuses if s.staging_need > self._budget(s.rank)}
            if not over:
                break
            # One global decision from agreed inputs: every rank knows every
            # rank's need (the statuses) and budget (the hellos).
            shrunk = min(self.round_bytes * self._budget(r) * 9 // (need * 10) for r, need in over.items())
            if shrunk >= self.round_bytes:
                shrunk = self.round_bytes // 2
            if shrunk < 1 or attempt == _PLAN_ATTEMPTS - 1:
                text = f"staging does not fit the budget even with rounds of {self.round_bytes} bytes: " + (
                    "; ".join(f"rank {r} needs {n} bytes, its budget is {self._budget(r)}" for r, n in over.items())
                )
                raise RefitError("plan", dict.fromkeys(over, text), version=refit, agreed=True)
            self._replan(shrunk)
        if statuses.everyone:
            check_links(statuses, refit)
        else:
            # This rank checks its own pairs with its peers' statuses; every
            # rank learns the outcome in one more (counted) agreement.
            ta = time.perf_counter()
            bad = link_problem(statuses, refit, self.rank)
            status = wire.Status(rank=self.rank, step="links", refit=refit, ok=not bad, error=bad)
            try:
                group.agree("links", refit, status, peers=())
            except RefitError as e:
                raise RefitError("plan", e.errors, version=refit, agreed=e.agreed) from e
            agree_s += time.perf_counter() - ta
        return self._planned()[0], statuses, agree_s

    def _plan_status(
        self,
        group: RefitGroup,
        refit: int,
        step: str,
        local: list[Problem],
        exports: tuple[tuple[wire.Export, ...], str],
        tensors: LocalTensors,
    ) -> wire.Status:
        """This rank's status for plan step ``step``: its problems, or its
        staging need, per-peer message summary and delta fields. A planning
        failure that is no plan problem is reported to every rank, then raised."""
        problems: tuple[Problem, ...] = tuple(local)
        need = 0
        links: tuple[dict, dict] = ({}, {})
        delta_fields: dict = {}
        try:
            plan, links = self._planned()
            capable = capable_pairs(group, plan)
            off = off_device_locals(tensors, group.device)
            need = staging_bound(plan, self.big_bytes, frozenset(capable), off)
            if off and group.config.delta and self.is_source:
                problems += (self._off_device_delta(group, off),)
            if group.config.delta:
                delta_fields = self._delta_status(group, plan, tensors)
            if group.no_wire:
                problems += no_wire_problems(group, plan, exports[0], self.exports.refused)
        except PlanError as e:
            problems += tuple(e.problems)
        except Exception as e:
            failed = wire.Status(rank=self.rank, step=step, refit=refit, ok=False, error=f"planning: {e}")
            group.agree(step, refit, failed)
            raise
        return wire.Status(
            rank=self.rank,
            step=step,
            refit=refit,
            ok=not problems,
            problems=problems,
            staging_need=need,
            sends=links[0],
            recvs=links[1],
            exports=exports[1],
            **delta_fields,
        )

    def _refit_tensors(self, into: Mapping[str, torch.Tensor] | LocalTensors | None) -> LocalTensors:
        """The local tensors a refit reads or writes on this rank."""
        return self.tensors if into is None else local_tensors(into)

    def _off_device_delta(self, group: RefitGroup, off: frozenset[str]) -> Problem:
        """Why a delta sender cannot send from tensors off the group's device."""
        names = sorted(off)
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        return Problem(
            kind="device",
            tensor=names[0],
            ranks=(self.rank,),
            message=f"source rank {self.rank}: delta refits compare a sender's tensors with its snapshot on the refit "
            f"group's device ({group.device}), and local tensors {names[:3]}{more} are not on it (offloaded?): "
            "refit them dense (GroupConfig(delta=False)) or keep them on the device",
        )

    def _execute(
        self,
        group: RefitGroup,
        plan: RankPlan,
        refit: int,
        tensors: LocalTensors,
        delta: DeltaRun | None,
        exported: Mapping[int, Mapping[str, wire.Export]],
    ) -> tuple[ExecStats | None, str]:
        """Step c: begin ``tensors``' refit, run this rank's rounds
        (``exported``: the colocated senders' exports it reads), finish it.
        Returns its stats, or the error that stopped it (every rank is told
        at once, so peers stop waiting on it)."""
        progress = Progress(refit, plan) if wants_progress(self.progress, self.rank) else None
        try:
            tensors.begin(plan)
            ex = Executor(
                group,
                plan,
                sources=tensors if self.is_source else None,
                destinations=None if self.is_source else tensors,
                budget_bytes=self.budget_bytes,
                big_bytes=self.big_bytes,
                device=group.device,
                after_round=progress,
                refit=refit,
                checksums=self.config.checksums,
                exports=exported,
                delta=delta,
                arena=self._arena,
            )
            if ex.arena is not None and ex.arena.device.type == "cpu":
                # Kept for the next refit on the host: a fresh one would fault
                # in every page again (on a GPU, torch's allocator caches it).
                self._arena = ex.arena
            stats = ex.run()
            t0 = time.perf_counter()
            tensors.finish()
            stats.timed("after_transfer", time.perf_counter() - t0)
            return stats, ""
        except RefitError as e:
            error = e.errors.get(self.rank, str(e))
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        finally:
            if progress is not None:
                progress.close()
        group.signal_abort(error, refit=refit)
        return None, error

    def _agree_outcome(self, group: RefitGroup, refit: int, error: str) -> float:
        """Step d: every rank learns whether all finished (raises on every rank
        if one did not). After an abort every live rank reaches this point
        within a few polls, so ranks still missing are dead: wait less.
        Returns the time it took."""
        ta = time.perf_counter()
        grace = min(self.config.timeout_s, ABORT_GRACE_S) if error else None
        status = wire.Status(rank=self.rank, step="transfer", refit=refit, ok=not error, error=error)
        group.agree("transfer", refit, status, timeout_s=grace, peers=())
        return time.perf_counter() - ta

    def _delta_done(self, group: RefitGroup, plan: RankPlan, refit: int, tensors: LocalTensors) -> None:
        """A refit succeeded on every rank: it is the base of the next delta,
        and the digests of what this rank sent (or holds, where only reshard
        writes it) are taken now, in the background, for the next plan step."""
        self.delta.base, self.delta.note = refit, ""
        if self.delta.snapshots is not None:
            self.delta.snapshots.digest_later()
        elif tensors.private and (base := self._delta_base(tensors)) is not None:
            self.delta.digest_later(group, plan, base)

    def _delta_base(self, tensors: LocalTensors) -> LocalTensors | None:
        """A destination's base: the tensors this refit writes (``None``: a
        source, or tensors that materialize during the refit)."""
        return None if self.is_source or tensors.lazy else tensors

    def _delta_status(self, group: RefitGroup, plan: RankPlan, tensors: LocalTensors) -> dict:
        """This rank's delta fields of its plan status (see :mod:`reshard.transport.delta`)."""
        base, note, digests, notes = self.delta.status(group, plan, self._delta_base(tensors))
        return {"delta_base": base, "delta_note": note, "delta_digests": digests, "delta_notes": notes}

    def _delta_run(self, group: RefitGroup, plan: RankPlan, statuses: list[wire.Status]) -> DeltaRun:
        """Which of this rank's pairs move deltas this refit: the same decision
        on both ranks of every pair, from the agreed statuses."""
        by_rank = {s.rank: s for s in statuses}
        peers: set[int] = set()
        dense: dict[int, str] = {}
        for peer in capable_pairs(group, plan):
            src, dst = (self.rank, peer) if self.is_source else (peer, self.rank)
            why = pair_reason(by_rank, src, dst, self._newest)
            if why:
                dense[peer] = why
            else:
                peers.add(peer)
        if dense:
            log.info(
                "refit rank %d: dense refit with rank(s) %s: %s",
                self.rank,
                span(sorted(dense)),
                next(iter(dense.values())),
            )
        if not self.is_source:
            return DeltaRun(frozenset(peers), dense)
        speeds = self.delta.speeds.speeds(group.device) if peers else None
        return DeltaRun(frozenset(peers), dense, self.delta.snapshots, speeds)

    def cancel(self, reason: str | None) -> None:
        """Make the refit in progress (or the next one) fail at once on this
        rank, and abort it for every rank of the group if joined; ``None``
        clears it. Safe from another thread (a driver whose engines failed
        before they joined would otherwise leave this rank waiting for them
        until the timeout)."""
        self._cancelled = reason
        group = self.group
        if reason and group is not None:
            group.signal_abort(f"rank {self.rank} cancelled the refit: {reason}")

    def _budget(self, rank: int) -> int:
        return self.budgets.get(rank) or DEFAULT_BUDGET_BYTES

    def refit_baseline(
        self,
        refit: int,
        *,
        into: Mapping[str, torch.Tensor] | LocalTensors | None = None,
        bucket_bytes: int | None = None,
    ) -> RefitStats:
        """Refit ``refit`` by gather-and-broadcast (see :mod:`reshard.transport.baseline`);
        ``into`` as for :meth:`refit` (begun with no plan of reshard's, and
        told of no round: the baseline has none)."""
        if self.config.elastic:
            raise ValueError("gather_broadcast needs every replica: it does not run with GroupConfig.min_replicas")
        tensors = self._refit_tensors(into)
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        started_at = time.time()
        # Gather-and-broadcast leaves snapshots behind what receivers hold.
        self.delta.void(f"refit {refit} is a gather-and-broadcast")
        with self._attempt(refit):
            group = self._enter(refit, tensors.refusal(refit))
            # Buckets must cut alike on every rank: the smallest budget of any rank.
            bucket_bytes = bucket_bytes or min(self.budgets.values(), default=0) or self.budget_bytes
            with on_device(group.device):
                tensors.begin(None)
                ex = gather_broadcast(
                    group,
                    self._planner(),
                    refit,
                    tensors=tensors,
                    device=group.device,
                    broadcast_groups=self.broadcast_groups,
                    bucket_bytes=bucket_bytes,
                )
                tensors.finish()
        self.last_refit = refit
        return RefitStats(
            refit=refit,
            rank=self.rank,
            exec=ex,
            plan_seconds=0.0,
            agree_seconds=0.0,
            total_seconds=time.perf_counter() - t0,
            cpu_seconds=time.process_time() - cpu0,
            round_bytes=bucket_bytes,
            started_at=started_at,
            finished_at=time.time(),
        )

    # -- 3. close ---------------------------------------------------------------

    def _drop(self) -> None:
        """Forget the group and everything planned on it; the next refit joins
        a rebuilt group (its layouts and domains are read again)."""
        self.broadcast_groups.clear()
        # A failed refit may leave receives posted into it.
        self._arena = None
        if self.group is not None:
            self.group.close()
            self.group = None
        self.planner = None
        self._plan = None
        self.round_bytes, self.big_bytes = self._asked

    def close(self) -> None:
        self._drop()


@dataclass(slots=True)
class _Planned:
    """A cached planner and, once made, this rank's plan from it."""

    planner: Planner
    plan: RankPlan | None = None
    links: tuple[dict, dict] = ({}, {})
    peers: tuple[int, ...] = ()
    """The ranks this rank's plan sends to or receives from."""
