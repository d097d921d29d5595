"""Driving the worker extension from an RL driver, raising one clear error
when any worker failed.

- :func:`init_workers` / :func:`pull_workers`: one engine, anything with
  ``collective_rpc`` (an offline ``LLM``, or :class:`HttpEngine`);
  :func:`stage_workers` / :func:`commit_workers`: the two phases of a
  two-phase refit.
- :class:`HttpEngine` (:mod:`reshard.adapters.vllm.http`, re-exported here):
  a ``vllm serve`` endpoint in dev mode.
- :class:`VllmEngines`: several engines driven as one, for
  ``Sender.push(n, engines=VllmEngines([...]))``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from reshard.adapters.core.fanout import fan_out
from reshard.adapters.core.replies import WorkerReply, raise_for_replies
from reshard.adapters.core.servers import replica_offsets, unreachable_line
from reshard.adapters.core.spec import GroupSpec
from reshard.adapters.vllm.http import HttpEngine
from reshard.errors import MixedWeightsError, ReshardError, ServerUnreachable
from reshard.transport.group import GroupConfig
from reshard.transport.session import DEFAULT_BUDGET_BYTES

__all__ = [
    "HttpEngine",
    "VllmEngines",
    "commit_workers",
    "engine_state",
    "flush_prefix_cache",
    "init_workers",
    "pause_mode_for",
    "pull_workers",
    "quiet_replies",
    "stage_workers",
]

log = logging.getLogger("reshard")


def init_workers(engine, spec: GroupSpec | dict[str, Any]) -> list[WorkerReply]:
    """``reshard_init`` on every worker of ``engine``; returns their replies
    (``stats``: pieces, kept bytes, ...)."""
    spec = GroupSpec.parse(spec)
    replies = [WorkerReply.parse(r) for r in engine.collective_rpc("reshard_init", args=(spec.to_json(),))]
    raise_for_replies(replies, "reshard_init")
    return replies


def pull_workers(engine, refit: int, *, method: str = "reshard", atomic: bool | None = None) -> list[WorkerReply]:
    """``reshard_pull`` on every worker (trainer ranks push at the same time);
    raises one error if any worker failed."""
    replies = _pull_replies(engine, refit, method, atomic)
    raise_for_replies(replies, "reshard_pull", version=refit)
    return replies


def _pull_replies(engine, refit: int, method: str, atomic: bool | None) -> list[WorkerReply]:
    return _replies(engine, "reshard_pull", str(refit), method, "" if atomic is None else str(atomic).lower())


def stage_workers(engine, refit: int, *, method: str = "reshard", poll_s: float = 0.02) -> list[WorkerReply]:
    """Phase 1 of a two-phase refit: every worker receives refit ``refit``
    into staging buffers while the engine keeps serving (trainer ranks push at
    the same time); returns once every worker staged it. Each call into the
    engine is short (start, then polls), so a server keeps generating in
    between. A failure raises one error and leaves the live weights untouched."""
    replies = _replies(engine, "reshard_stage", str(refit), method)
    raise_for_replies(replies, "reshard_stage", version=refit)
    wait = poll_s / 4
    while True:
        replies = _replies(engine, "reshard_staged", str(refit))
        raise_for_replies(replies, "reshard_stage", version=refit)
        if all(r.stats.get("staged") for r in replies):
            return replies
        time.sleep(wait)
        wait = min(poll_s, wait * 2)


def commit_workers(engine, refit: int) -> list[WorkerReply]:
    """Phase 2 of a two-phase refit: every worker applies staged refit
    ``refit`` to its live weights (pause generation around it)."""
    replies = _replies(engine, "reshard_commit", str(refit))
    raise_for_replies(replies, "reshard_commit", version=refit)
    return replies


def engine_state(engine, *, probe: bool = True) -> list[dict[str, str]]:
    """Per worker of ``engine`` (an offline ``LLM`` or :class:`HttpEngine`), a
    digest of every tensor its forward pass may read, by module path
    (:func:`reshard.adapters.core.state.model_state`). Compare a refit
    engine's with one freshly loaded from the same weights with
    :func:`reshard.adapters.core.state.compare_states`: the first path it
    returns is where to look."""
    return [dict(r) for r in engine.collective_rpc("reshard_state", args=(str(probe).lower(),))]


_LONG_CALLS = frozenset({"reshard_pull", "reshard_commit"})
"""Worker methods that run as long as a refit (or its apply)."""


def _replies(engine, method: str, *args: str) -> list[WorkerReply]:
    with quiet_replies(engine) if method in _LONG_CALLS else contextlib.nullcontext():
        return [WorkerReply.parse(r) for r in engine.collective_rpc(method, args=args)]


@contextlib.contextmanager
def quiet_replies(engine: Any) -> Iterator[None]:
    """For the length of the block, an offline ``LLM`` (its executor in this
    process) waits for its workers' replies asleep instead of spinning.

    vLLM 0.32's multiprocess executor reads each worker's reply from shared
    memory, and for a second after its last read it polls in a loop of
    ``sched_yield`` calls (its ``SpinCondition``, ``busy_loop_s = 1``)
    rather than waiting on the notification its workers send. Between two
    calls in quick succession that saves a wake-up; for a call as long as a
    refit it keeps a core busy the whole time, which on a host with few
    cores is taken from the refit itself (the workers and the trainer ranks
    on the same cores). With ``busy_loop_s = 0`` the reader blocks on the
    notification socket until the reply is there. Other engines (servers,
    an engine core in its own process) are left as they are."""
    conditions = []
    executor = _attr_path(engine, "llm_engine", "engine_core", "engine_core", "model_executor")
    for mq in getattr(executor, "response_mqs", None) or ():
        cond = getattr(mq, "_spin_condition", None)
        if cond is not None and isinstance(getattr(cond, "busy_loop_s", None), (int, float)):
            conditions.append((cond, cond.busy_loop_s))
            cond.busy_loop_s = 0
    try:
        yield
    finally:
        for cond, busy in conditions:
            cond.busy_loop_s = busy


def _attr_path(obj: Any, *names: str) -> Any:
    for n in names:
        obj = getattr(obj, n, None)
    return obj


def pause_mode_for(version: str | None) -> str:
    """The ``/pause`` mode that never fails a user's request because of a
    refit, on vLLM ``version`` (``None``: unknown):

    - 0.32 and older: ``wait``. Requests in flight finish on the old weights;
      requests that arrive during the pause are queued and run on the new
      ones.
    - 0.33 and newer: ``keep``. Since 0.33 ``wait`` (and ``abort``) reject
      requests that arrive during the pause with HTTP 503 (``Generation is
      paused``, retryable); ``keep`` still queues them. Requests in flight are
      frozen, their KV cache dropped with the prefix cache, and recomputed on
      the new weights when the server resumes: their tokens so far came from
      the old weights, the rest from the new.
    """
    if version is None:
        return "keep"
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            return "keep"
        parts.append(int(digits))
    if len(parts) < 2:
        return "keep"
    return "wait" if tuple(parts) < (0, 33) else "keep"


class VllmEngines:
    """Several vLLM engines (offline ``LLM`` objects, :class:`HttpEngine` or
    URLs) refit as one: engine ``i``'s workers take the refit ranks after
    engine ``i - 1``'s. Implements :class:`reshard.sender.engines.Engines`.

    ``pause_mode``: how requests in flight are handled around a swap on
    servers (``wait``, ``keep`` or ``abort``; offline engines generate only
    when their owner calls them). ``None``: per server, the mode that never
    fails a request because of a refit on its vLLM version
    (:func:`pause_mode_for`: ``wait`` on 0.32, ``keep`` from 0.33 on). ``budget_bytes`` caps each worker's
    staging. ``atomic``: every worker keeps all its old weights when a refit
    fails, at the cost of one materialized copy of its weights during the
    refit (see :meth:`reshard.adapters.vllm.receiver.VllmReceiver.pull`).

    ``two_phase``: workers receive each refit into staging buffers while
    the engine keeps generating on its old weights; generation is paused only
    to apply them (a copy and a repack per layer). A transfer that fails
    leaves the serving weights untouched. It costs one more copy of what each
    worker keeps; an engine whose workers keep more than
    ``stage_budget_bytes`` each is refit in place instead (``staged: false``
    in its replies). Every reply's stats say ``paused_seconds``.

    A job token (``GroupConfig.token``) is handed to offline engines; servers
    read ``$RESHARD_TOKEN`` from their own environment instead.

    ``sleeping``: the engines sleep between refits (colocated with the
    trainer, put to sleep with vLLM's ``sleep(level=1|2)`` while it trains).
    An engine found asleep is woken in two steps: its weights before the
    refit (after a level-2 sleep they hold nothing; the refit writes every
    one), its KV cache once the refit succeeded, which also resumes
    scheduling. ``wake_kv_cache=False`` leaves the KV cache asleep for the
    caller to wake; a refit that fails leaves it asleep too. Asleep engines
    are refit in place (never two-phase: they serve nothing). vLLM cannot
    tell a sleeping engine from a paused one (``is_sleeping`` covers both),
    so only set ``sleeping`` for engines that sleep rather than pause.

    Without ``atomic``, a refit that fails after some layers took their new
    weights leaves a worker *mixed*; a server with such a worker stays
    paused (it queues requests and generates nothing) until a refit
    succeeds, and :class:`reshard.errors.MixedWeightsError` names the engine.
    :attr:`mixed` lists them.

    Several servers in an elastic group (``GroupConfig.min_replicas`` set):
    server ``i`` is replica ``i`` (``replica_size``, set here from the
    servers' TP size when left ``None``; every server must have the same).
    A server that cannot be reached (connection refused, timed out) does not
    fail the push: the live servers are refit and :attr:`unreachable` names
    it (replica index -> URL and error), which ``Sender.push`` adds to its
    stats' ``missing_replicas``. A server found down stays out of this
    object's refits. Without ``min_replicas`` a server that is down fails
    the push, naming its URL.

    ``draft``: engines with a speculative drafter refit it beside the target
    (``"refit"``: the trainer publishes its tensors, under the drafter's
    names, or the plan fails naming them) or leave it alone (``"frozen"``;
    :mod:`reshard.adapters.vllm.drafter`)."""

    def __init__(
        self,
        engines: Sequence[Any],
        *,
        pause_mode: str | None = None,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        atomic: bool = False,
        two_phase: bool = False,
        stage_budget_bytes: int | None = None,
        sleeping: bool = False,
        wake_kv_cache: bool = True,
        draft: str = "refit",
    ) -> None:
        if pause_mode not in (None, "wait", "keep", "abort"):
            raise ValueError(f"pause_mode {pause_mode!r}: use 'wait', 'keep', 'abort' or None")
        self.engines = [HttpEngine(e) if isinstance(e, str) else e for e in engines]
        if not self.engines:
            raise ValueError("VllmEngines needs at least one engine")
        self.pause_mode = pause_mode
        self.budget_bytes = budget_bytes
        self.atomic = atomic
        self.two_phase = two_phase
        self.stage_budget_bytes = stage_budget_bytes
        self.sleeping = sleeping
        self.wake_kv_cache = wake_kv_cache
        self.draft = draft
        self.mixed: list[Any] = []
        self.workers: list[list[WorkerReply]] = []
        self.config: GroupConfig | None = None
        self.unreachable: dict[int, str] = {}
        """Elastic groups: the servers found down (replica index -> URL and error)."""
        self._kept: dict[int, int] = {}

    def _pause_mode(self, engine: Any) -> str:
        """The ``/pause`` mode for ``engine`` (a server)."""
        if self.pause_mode is not None:
            return self.pause_mode
        return pause_mode_for(engine.version() if isinstance(engine, HttpEngine) else None)

    def _can_stage(self, engine: Any) -> bool:
        """Whether each of ``engine``'s workers may stage what it keeps."""
        return self.stage_budget_bytes is None or self._kept.get(id(engine), 0) <= self.stage_budget_bytes

    def init(self, config: GroupConfig) -> None:
        self.workers = []
        self.unreachable = {}
        if config.min_replicas is not None:
            self._init_elastic(config)
            return
        offset = 0
        for e in self.engines:
            replies = init_workers(e, self._spec(config, e, offset))
            self.workers.append(replies)
            self._kept[id(e)] = max(int(r.stats.get("kept_bytes", 0)) for r in replies)
            offset += len(replies)
        if offset != config.num_destinations:
            raise ReshardError(
                f"the engines have {offset} workers ({', '.join(str(len(w)) for w in self.workers)} per engine) "
                f"but the refit group expects num_destinations={config.num_destinations}"
            )
        self.config = config

    def _spec(self, config: GroupConfig, e: Any, offset: int) -> GroupSpec:
        return GroupSpec.of(
            config,
            engine_offset=offset,
            budget_bytes=self.budget_bytes,
            atomic=self.atomic,
            draft=self.draft,
            # The job token never travels over HTTP: servers read
            # $RESHARD_TOKEN from their own environment.
            with_token=not isinstance(e, HttpEngine),
        )

    def _init_elastic(self, config: GroupConfig) -> None:
        """Servers as replicas of one size; those down are named, not fatal."""

        def size(i: int) -> int | None:
            e = self.engines[i]
            try:
                return e.workers() if isinstance(e, HttpEngine) else len(e.collective_rpc("reshard_status"))
            except ServerUnreachable as err:
                self.unreachable[i] = unreachable_line(e.url, err)
                return None

        sizes = fan_out(range(len(self.engines)), size, name="reshard-probe")
        offsets = replica_offsets(config, sizes, [repr(e) for e in self.engines])
        self.workers = [[] for _ in self.engines]
        for i, e in enumerate(self.engines):
            if i in self.unreachable:
                continue
            try:
                replies = init_workers(e, self._spec(config, e, offsets[i]))
            except ServerUnreachable as err:
                self.unreachable[i] = unreachable_line(e.url, err)
                continue
            self.workers[i] = replies
            self._kept[id(e)] = max(int(r.stats.get("kept_bytes", 0)) for r in replies)
        for why in self.unreachable.values():
            log.warning("refit group %r: %s; the other servers are refit without it", config.job, why)
        self.config = config

    def refit(self, refit: int, *, method: str = "reshard") -> list[WorkerReply]:
        if self.config is None:
            raise RuntimeError("VllmEngines.init must run before a refit")
        mixed: list[Any] = []
        elastic = self.config.min_replicas is not None

        def one(e: Any) -> list[WorkerReply]:
            server = isinstance(e, HttpEngine)
            t0 = time.perf_counter()
            # Asleep: wake the weights only (vLLM keeps scheduling paused
            # until the KV cache is awake too).
            kv_asleep = self.sleeping and _is_sleeping(e) and not e.wake_up(["weights"])
            staged = self.two_phase and self._can_stage(e) and not kv_asleep
            if staged:
                # The engine keeps serving while its workers receive; a failure
                # here leaves its weights untouched and raises.
                stage_workers(e, refit, method=method)
            t_pause = time.perf_counter()
            mode = self._pause_mode(e) if server else ""
            if server and not kv_asleep:
                e.pause(mode)
            replies: list[WorkerReply] = []
            try:
                if staged:
                    replies = _replies(e, "reshard_commit", str(refit))
                else:
                    replies = _pull_replies(e, refit, method, None)
                # Cached prefixes were computed with the old weights (and, after a
                # failed refit, the engine kept those weights: flushing is harmless).
                flush_prefix_cache(e, running=mode == "keep")
            finally:
                if any(r.mixed for r in replies):
                    mixed.append(e)
                elif kv_asleep:
                    if self.wake_kv_cache and replies and all(r.ok for r in replies):
                        e.wake_up(["kv_cache"])
                elif server:
                    # A server whose weights are half old, half new stays paused.
                    e.resume()
            t_end = time.perf_counter()
            for r in replies:
                r.stats.update(paused_seconds=t_end - t_pause, staged=staged, engine_seconds=t_end - t0)
            if all(r.ok for r in replies):
                _log_refit(e, refit, method, replies, t_end - t0, t_end - t_pause, staged)
            try:
                raise_for_replies(replies, "reshard_pull", version=refit)
            except MixedWeightsError as err:
                err.paused = server
                err.args = (
                    f"{err.args[0]}\nengine {e!r} mixes old and new weights"
                    + (" and stays paused until a refit succeeds" if server else ""),
                )
                raise
            return replies

        def guarded(i: int) -> list[WorkerReply]:
            try:
                return one(self.engines[i])
            except ServerUnreachable as err:
                if not elastic:
                    raise
                self.unreachable[i] = unreachable_line(self.engines[i].url, err)
                log.warning("refit %d: %s; the other servers are refit without it", refit, self.unreachable[i])
                return []

        live = [i for i in range(len(self.engines)) if i not in self.unreachable]
        try:
            return [r for replies in fan_out(live, guarded, name="reshard-pull") for r in replies]
        finally:
            self.mixed = mixed


def flush_prefix_cache(engine: Any, *, running: bool = False, timeout_s: float = 60.0) -> None:
    """Drop every prefix ``engine`` (an offline ``LLM`` or :class:`HttpEngine`)
    cached with its old weights, or raise. vLLM refuses while a request holds
    KV blocks (it answers ``false``, and a prefix computed with the old
    weights would be served again), so this retries until the blocks are
    free. ``running``: preempt requests that hold blocks (a server paused in
    ``keep`` mode): they are recomputed on the new weights when they resume."""
    deadline = time.monotonic() + timeout_s
    wait = 0.01
    while True:
        if engine.reset_prefix_cache(running) is not False:
            return
        if time.monotonic() >= deadline:
            raise ReshardError(
                f"engine {engine!r} still holds KV blocks after {timeout_s:.0f} s, so it cannot drop the prefixes "
                "it cached with the old weights (requests still running?): its next requests could reuse them"
            )
        time.sleep(wait)
        wait = min(0.5, wait * 2)


def _is_sleeping(engine: Any) -> bool:
    """Whether ``engine`` (an offline ``LLM`` or :class:`HttpEngine`) sleeps at any level."""
    if isinstance(engine, HttpEngine):
        return engine.is_sleeping()
    inner = getattr(engine, "llm_engine", None)
    return bool(inner.is_sleeping()) if inner is not None and hasattr(inner, "is_sleeping") else False


def _log_refit(
    engine: Any, refit: int, method: str, replies: list[WorkerReply], seconds: float, paused: float, staged: bool
) -> None:
    """One INFO line per engine and refit."""
    got = sum(int(r.stats.get("bytes_received", 0)) for r in replies)
    mode = f"{method}, two-phase" if staged else method
    log.info(
        "refit %d (%s) into %r: %d workers received %.1f MB in %.3f s (%.2f GB/s), generation paused %.3f s",
        refit,
        mode,
        engine,
        len(replies),
        got / 1e6,
        seconds,
        got / max(seconds, 1e-9) / 1e9,
        paused,
    )
