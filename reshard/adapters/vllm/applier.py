"""The thread a refit's per-round engine work runs on (:class:`Applier`),
and how it is set up: the caller's torch thread state, and on CPU an idle
priority (:func:`idle_priority`), so the work never holds up the receive.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Applier", "idle_priority"]


class Applier:
    """Runs a refit's per-round engine work (processing the layers whose last
    round landed) on a thread of its own, so the executor's thread goes
    straight back to the wire instead of holding up the next receive.

    ``released(i, *args)`` is the executor's ``after_round`` (``args`` are
    taken on its thread, e.g. a snapshot of the tensors that changed);
    ``work(i, *args)`` runs on the applier's thread (work for round ``i``
    covers every earlier round, so rounds released while it was busy are
    folded into the newest). ``drain()`` (the executor's
    ``after_transfer``) waits for the work to finish and raises its error;
    leaving the ``with`` block on an error waits for the work in progress
    and skips the rest, so the caller can put back what was not processed.

    ``pool``: the thread, kept by the caller from one refit to the next.
    It must be the same thread each time: the memory the engine's
    processing allocates (repacked weights) comes from that thread's malloc
    arena, and a fresh thread would fault in fresh pages at every refit.

    ``idle``: the work runs at idle priority while the transfer lasts
    (:func:`idle_priority`), so that it only takes what the receive leaves.
    Once the transfer is over (``drain``) there is nothing left to yield to,
    and at idle priority a busy neighbour (a trainer on the same cores)
    would starve the rest of the work: the thread gets normal priority back,
    or, where the system refuses that (lowering a thread's nice needs
    ``CAP_SYS_NICE``), the work not yet started runs on the caller's thread
    instead; only the work in progress finishes at idle priority."""

    def __init__(self, work: Callable[..., None], pool: cf.ThreadPoolExecutor, *, idle: bool = False) -> None:
        self.work = work
        self.pool = pool
        self.idle = idle
        self._tid: int | None = None
        self._pending: tuple[int, tuple] | None = None
        self._future: cf.Future | None = None
        self._running = False
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._stopped = False
        self._enter = _thread_context()
        self.busy_seconds = 0.0
        """Time the applier's thread spent working."""

    def __enter__(self) -> Applier:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            self._stopped = True
        self._wait()

    def released(self, index: int, *args: Any) -> None:
        if self._error is not None:
            raise self._error
        with self._lock:
            self._pending = (index, args)
            if not self._running:
                self._running = True
                self._future = self.pool.submit(self._run)

    def drain(self) -> None:
        with self._lock:
            # An idle thread that has not started yet (no id) takes nothing more.
            item = None
            if not self._lift():
                item, self._pending = self._pending, None
        self._wait()
        if item is not None and self._error is None and not self._stopped:
            self._do(item)
        if self._error is not None:
            raise self._error

    def _lift(self) -> bool:
        """Normal priority for the applier's thread (the transfer is over);
        ``False`` where the system refuses it."""
        if not self.idle:
            return True
        if self._tid is None:
            return False
        try:
            os.sched_setscheduler(self._tid, os.SCHED_OTHER, os.sched_param(0))
        except (OSError, AttributeError):
            return False
        return True

    def _wait(self) -> None:
        # Only the executor's thread releases work, and it is the one waiting.
        while True:
            with self._lock:
                future, running = self._future, self._running
            if future is None or (not running and future.done()):
                if future is not None:
                    future.result()
                return
            future.result()

    def _run(self) -> None:
        with self._lock:
            # Idle until a drain lifts it (at every refit: the thread is kept).
            if self.idle:
                idle_priority()
            self._tid = threading.get_native_id()
        with self._enter():
            while True:
                with self._lock:
                    item, self._pending = self._pending, None
                    if item is None or self._stopped or self._error is not None:
                        self._running = False
                        return
                self._do(item)

    def _do(self, item: tuple[int, tuple]) -> None:
        t0 = time.perf_counter()
        try:
            self.work(item[0], *item[1])
        except BaseException as e:
            self._error = e
        finally:
            self.busy_seconds += time.perf_counter() - t0


def idle_priority() -> None:
    """Run the calling thread only when its CPU has nothing else to run
    (Linux ``SCHED_IDLE``; elsewhere, or where refused, nothing changes).

    On CPU, an engine worker's receive and its :class:`Applier` share the
    worker's core (vLLM binds each worker to its own), and the trainer ranks
    run on the same cores. At equal priority the scheduler splits the core
    between the two, so every receive waits for a repack slice and the whole
    refit takes their sum plus the switching (measured: a layer's processing
    took twice as long beside the receive as alone). At idle priority the
    repack runs while the receive waits for bytes, and at full speed once
    the transfer landed (:meth:`Applier.drain` gives the thread its normal
    priority back then)."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        return
    with contextlib.suppress(OSError):
        os.sched_setscheduler(0, policy, os.sched_param(0))


def _thread_context() -> Callable[[], contextlib.AbstractContextManager]:
    """What a thread needs to run engine code as the calling thread would:
    torch keeps the grad mode, inference mode, default device, current CUDA
    device, current CUDA stream and intra-op thread count (OpenMP's, which a
    new thread would take from the number of cores) per thread. The stream
    matters: the layers a round released are processed from buffers the
    executor's stream wrote, and a thread of its own would otherwise run on
    its device's default stream, unordered with the caller's (a two-phase
    stage receives on a side stream of its own)."""
    import torch

    threads = torch.get_num_threads()
    grad = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    default = torch.get_default_device()
    cuda = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    stream = torch.cuda.current_stream(cuda) if cuda is not None else None

    @contextlib.contextmanager
    def enter() -> Iterator[None]:
        torch.set_num_threads(threads)
        if cuda is not None:
            torch.cuda.set_device(cuda)
        with contextlib.ExitStack() as stack:
            if stream is not None:
                stack.enter_context(torch.cuda.stream(stream))
            stack.enter_context(torch.inference_mode() if inference else torch.set_grad_enabled(grad))
            if default.type != "cpu":
                stack.enter_context(default)
            yield

    return enter
