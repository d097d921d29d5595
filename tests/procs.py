"""Run a function on N real processes (fresh ones, as torch.distributed needs).

Processes start from a fork server that imported torch, transformers'
modeling code and reshard once (``multiprocessing``'s "forkserver" method):
a rank costs a fork instead of a fresh interpreter importing torch again
(4 ranks that import reshard: 4.6 s spawned, 0.05 s forked, on this 2-core
machine). Each process takes the test process's environment as it was when
the process was asked for, as a spawned one would.
``RESHARD_TEST_START=spawn`` spawns every process instead.

The harness passes results back through a multiprocessing queue; that is
test plumbing, not the refit path (which never pickles).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reshard.testing.ports import free_port

STARTED: set[int] = set()
"""The pids of every process this harness started (in this test process)."""

GROUP_TIMEOUT_S = 300
"""The refit group timeout of every test that expects its ranks to join and
its refits to succeed: ranks start at different times (a trainer importing
DeepSpeed and building its model while the engine already waits to join),
and on a loaded CI machine (two suites side by side, load 20-50 on 2 cores)
that took over 60 s for engines and over 120 s for DeepSpeed ranks. Long
enough that slow process starts never fail a test, a guard against hangs
rather than a measure of time. Tests of failures keep their short ones."""


def ray_init(**kwargs: Any) -> None:
    """``ray.init`` for a test, with Ray's workers at the test's own priority
    and without Ray's memory monitor (:data:`RAY_TEST_ENV`).

    Ray starts its worker processes at nice 15 (``RAY_worker_niceness``), so
    on a machine busy with other work (CI runs two lanes beside whatever else
    runs there) its actors got a few percent of a core: test_verl's setup took
    1097 s beside a busy loop against 149 s alone, most of it an actor
    importing vLLM. Ray jobs submitted through Ray's job API run at nice 0 too.
    Ray's memory monitor kills workers once the whole machine is 95% used,
    whoever uses it: with three suites side by side (22.3 of 23.6 GB used)
    it killed test_verl's actors, which needed a fraction of that.
    """
    import ray

    os.environ.update(RAY_TEST_ENV)
    ray.init(**kwargs)


RAY_TEST_ENV = {"RAY_worker_niceness": "0", "RAY_memory_monitor_refresh_ms": "0"}
"""Read by Ray's raylet and workers when they start (examples get them
through their environment): workers at nice 0, no memory monitor (0 turns
it off; the kernel still stops a process that runs the machine out of
memory)."""


class StoreServer:
    """A TCPStore server owned by the test process (ranks join as clients)."""

    def __init__(self) -> None:
        import datetime

        from torch.distributed import TCPStore

        self.port = free_port()
        self.store = TCPStore(
            "127.0.0.1", self.port, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait(self, key: str, timeout_s: float = 600) -> None:
        """Until some process sets ``key`` on this store."""
        import datetime

        self.store.wait([key], datetime.timedelta(seconds=timeout_s))


@dataclass
class Outcome:
    rank: int
    ok: bool
    value: Any = None
    error: str = ""
    exitcode: int | None = None


PRELOAD = ["torch", "torch.distributed", "transformers.modeling_utils", "reshard", "tests.procs"]
"""What the fork server imports once for every process it starts (a
trainer rank building a transformers model spent seconds importing
``modeling_utils``). Nothing here reads the environment a test sets."""


@functools.cache
def _context() -> Any:
    """The multiprocessing context of every process this harness starts."""
    if os.environ.get("RESHARD_TEST_START", "forkserver") == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _adopt(env: dict[str, str]) -> None:
    """The test process's environment, as a spawned process would inherit
    it (the fork server's is the one it had when the server started)."""
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _entry(fn: Callable, rank: int, args: tuple, q, env: dict[str, str]) -> None:
    _adopt(env)
    import torch

    torch.set_num_threads(1)
    try:
        value = fn(rank, *args)
        q.put((rank, True, value, ""))
    except BaseException as e:
        q.put((rank, False, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class Running:
    """A function running in a process of its own (see :func:`spawn`)."""

    def __init__(self, fn: Callable, rank: int, args: tuple, *, daemon: bool = True) -> None:
        ctx = _context()
        self.rank = rank
        self.queue = ctx.Queue()
        env = dict(os.environ)
        self.process = ctx.Process(target=_entry, args=(fn, rank, args, self.queue, env), daemon=daemon)
        self.process.start()
        STARTED.add(self.process.pid)
        self._outcome: Outcome | None = None

    def poll(self, timeout: float = 0.0) -> Outcome | None:
        """The outcome once the function returned or raised (``None`` before)."""
        if self._outcome is None:
            try:
                rank, ok, value, error = self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait()
                self._outcome = Outcome(rank, ok, value, error)
            except Exception:
                return None
        return self._outcome

    def outcome(self, timeout: float = 180.0) -> Outcome:
        """Wait for the outcome; a process still alive at ``timeout`` is killed
        and reported as hung, one that died without an answer as such."""
        deadline = time.monotonic() + timeout
        while self.poll(0.2) is None and time.monotonic() < deadline:
            if not self.process.is_alive() and self.poll(0.2) is None:
                break
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        out = self._outcome or Outcome(self.rank, False, error="no result (hung or killed)")
        out.exitcode = self.process.exitcode
        self._outcome = out
        return out


def spawn(fn: Callable, rank: int, *args: Any, daemon: bool = True) -> Running:
    """Start ``fn(rank, *args)`` in a fresh process of its own; ``daemon=False``
    lets it start processes of its own (an engine's workers)."""
    return Running(fn, rank, args, daemon=daemon)


def run(
    fn: Callable,
    world: int,
    *args: Any,
    timeout: float = 180.0,
    ranks: list[int] | None = None,
    daemon: bool = True,
    reuse: bool = False,
) -> list[Outcome]:
    """Run ``fn(rank, *args)`` for each rank in its own process; collect outcomes.

    Processes still alive at ``timeout`` are killed and reported as hung.
    ``daemon=False`` lets them start processes of their own. ``reuse``: run
    on long-lived processes this test session shares (one set per world
    size; process start and imports are paid once), for functions that leave
    nothing behind (every refit group closed, no default process group). A
    rank that answers reports exit code 0 (it did not die); a set in which a
    process died or hung is replaced.
    """
    if reuse and ranks is None:
        return _run_shared(fn, world, args, timeout)
    ranks = list(range(world)) if ranks is None else ranks
    running = [spawn(fn, r, *args, daemon=daemon) for r in ranks]
    deadline = time.monotonic() + timeout
    return [r.outcome(max(0.0, deadline - time.monotonic())) for r in running]


_SHARED: dict[int, Pool] = {}


def _run_shared(fn: Callable, world: int, args: tuple, timeout: float) -> list[Outcome]:
    pool = _SHARED.get(world)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close()
        pool = _SHARED[world] = Pool(world)
    pool.submit(fn, *args)
    out = pool.wait(timeout)
    for o, p in zip(out, pool.procs, strict=True):
        if p.is_alive() and (o.ok or (o.error and "no answer" not in o.error)):
            o.exitcode = 0
    if not all(o.exitcode == 0 for o in out):
        # A process died or hung: never hand this set out again.
        for p in pool.procs:
            if p.is_alive():
                p.kill()
        pool.close()
        del _SHARED[world]
    return out


def close_shared() -> None:
    """Stop the shared processes (``tests/conftest.py`` does it after each
    module, so idle ones never hold memory the engine tests need)."""
    for pool in _SHARED.values():
        pool.close()
    _SHARED.clear()


def check(outcomes: list[Outcome]) -> list[Any]:
    bad = [o for o in outcomes if not o.ok]
    if bad:
        raise AssertionError("\n".join(f"rank {o.rank} (exit {o.exitcode}): {o.error}" for o in bad))
    return [o.value for o in outcomes]


def _serve(rank: int, inbox, outbox, env: dict[str, str]) -> None:
    """A pool process: run ``fn(rank, *args)`` for every ``(fn, args)`` received
    until ``None`` arrives; answer ``(ok, value or error)``."""
    _adopt(env)
    import torch

    torch.set_num_threads(1)
    while True:
        job = inbox.get()
        if job is None:
            return
        fn, args = job
        try:
            outbox.put((True, fn(rank, *args)))
        except BaseException as e:
            outbox.put((False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class Pool:
    """``world`` long-lived processes (spawned once) that run functions on
    request: a trainer's ranks across many refits, or an engine host across
    many engines, without paying process start and imports each time.
    ``submit`` posts ``fn(rank, *args)`` to every rank; ``wait`` collects the
    outcomes of the last submission."""

    def __init__(self, world: int, *, daemon: bool = True) -> None:
        ctx = _context()
        env = dict(os.environ)
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.outboxes = [ctx.Queue() for _ in range(world)]
        self.procs = [
            ctx.Process(target=_serve, args=(r, self.inboxes[r], self.outboxes[r], env), daemon=daemon)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
            STARTED.add(p.pid)

    def submit(self, fn: Callable, *args: Any) -> None:
        for q in self.inboxes:
            q.put((fn, args))

    def wait(self, timeout: float = 300.0) -> list[Outcome]:
        deadline = time.monotonic() + timeout
        out = []
        for r, q in enumerate(self.outboxes):
            while True:
                try:
                    ok, value = q.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
                    out.append(Outcome(r, ok, value if ok else None, "" if ok else value))
                    break
                except Exception:
                    if not self.procs[r].is_alive():
                        out.append(Outcome(r, False, error="died", exitcode=self.procs[r].exitcode))
                        break
                    if time.monotonic() >= deadline:
                        out.append(Outcome(r, False, error=f"no answer within {timeout}s"))
                        break
        return out

    def call(self, fn: Callable, *args: Any, timeout: float = 300.0) -> list[Any]:
        self.submit(fn, *args)
        return check(self.wait(timeout))

    def close(self) -> None:
        for q in self.inboxes:
            with contextlib.suppress(Exception):
                q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
