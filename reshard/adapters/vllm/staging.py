"""Phase 1 of a two-phase refit in a vLLM worker (:class:`TwoPhaseStaging`,
a part of :class:`reshard.adapters.vllm.receiver.VllmReceiver`): the worker
receives everything it keeps, the drafter's share included, into staging
buffers of the checkpoint-loading shapes, in a thread of its own, while the
engine keeps serving its live weights; the receiver's ``commit`` then
applies them (vLLM's layerwise reload from the buffers, target and drafter).
With delta refits the same buffers are the base each delta patches.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reshard.adapters.vllm.drafter import DRAFT_LOCAL, LearnedDrafter
from reshard.errors import ReshardError
from reshard.transport.locals import Tensors
from reshard.transport.posting import on_device

if TYPE_CHECKING:
    import torch

    from reshard.adapters.core.recording import LearnedLayout
    from reshard.plan.layout import Layout
    from reshard.receiver import Receiver

__all__ = ["TwoPhaseStaging"]


@contextlib.contextmanager
def _on_stream(stream: Any) -> Iterator[None]:
    """``stream`` current for the block (nothing for ``None``)."""
    if stream is None:
        yield
        return
    import torch

    with torch.cuda.stream(stream):
        yield


@dataclass(slots=True)
class _Staging:
    """Phase 1 of a two-phase refit, running in a thread of its own."""

    refit: int
    method: str
    thread: threading.Thread | None = None
    stats: Any = None
    error: BaseException | None = None
    seconds: float = 0.0

    @property
    def done(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()


class TwoPhaseStaging:
    """Staging buffers and phase 1 of a two-phase refit (see the module
    docstring), for a receiver that has these attributes."""

    learned: LearnedLayout
    drafter: LearnedDrafter | None
    draft_mode: str
    layout: Layout
    receiver: Receiver
    rank: int
    device: Any
    _cpu: bool
    _buffers: dict[str, torch.Tensor] | None
    _base_tensors: Tensors | None
    _stage_stream: Any
    _staging: _Staging | None

    @property
    def staging_bytes(self) -> int:
        """Bytes of staging buffers this worker holds (0 until its first :meth:`stage`)."""
        return sum(t.nbytes for t in (self._buffers or {}).values())

    def _staging_buffers(self) -> dict[str, torch.Tensor]:
        """One zeroed buffer per parameter, of its checkpoint-loading shape and
        dtype; kept for the next refit (regions no piece writes, such as
        vocabulary padding, stay zero, as vLLM's loader leaves them).

        On a GPU worker they are pinned host memory, on purpose: they hold a
        copy of everything the worker keeps, and GPU memory has no room for
        a second copy of the weights (the KV cache was sized to fill it). The
        executor receives into its staging arena on the device and copies
        each slice out (:func:`reshard.transport.posting.off_device_locals`);
        a commit copies each layer back in (host-to-device, pinned)."""
        import torch

        if self._buffers is None:
            dtypes: dict[str, str] = {}
            for p in self.learned.pieces:
                dtypes.setdefault(p.local, p.local_dtype or p.tensor.dtype)
            shapes = dict(self.learned.local_shapes)
            if self.drafter is not None and self.draft_mode == "refit":
                # The drafter's (under its local names), staged and committed with the target's.
                for p in self.drafter.pieces:
                    dtypes.setdefault(p.local, p.local_dtype or p.tensor.dtype)
                shapes.update({DRAFT_LOCAL + k: v for k, v in self.drafter.learned.local_shapes.items()})
            pinned = not self._cpu and torch.cuda.is_available()
            # Parameters only a loader tensor writes need no buffer: the
            # loader runs on the staged loader tensor.
            self._buffers = {
                name: torch.zeros(shape, dtype=getattr(torch, dtypes[name]), device="cpu", pin_memory=pinned)
                for name, shape in shapes.items()
                if name in dtypes
            }
        return self._buffers

    def _base(self) -> Tensors:
        """The staging buffers as the tensors a refit lands in: written by
        reshard alone (a delta's base is digested after a refit, in a
        thread); one object from one refit to the next."""
        if self._base_tensors is None:
            self._base_tensors = Tensors(self._staging_buffers(), private=True)
        return self._base_tensors

    def stage(self, refit: int, *, method: str = "reshard") -> None:
        """Phase 1 of a two-phase refit: start receiving refit ``refit`` into
        staging buffers, in a thread of its own, and return at once. The live
        weights are untouched, so the engine keeps serving; if the transfer
        fails, nothing changed. :meth:`staging_state` says when it is done,
        :meth:`commit` applies it (with generation paused)."""
        self._wait_staging()
        if self.receiver.layout is not self.layout:
            self.receiver.set_layout(self.layout)
        into = self._base()
        job = _Staging(refit, method)

        stream = self._side_stream()

        def run() -> None:
            t0 = time.perf_counter()
            try:
                # On a GPU, on a stream of its own: the engine keeps serving on
                # its own streams meanwhile, and neither waits for the other.
                with on_device(self.device), _on_stream(stream):
                    job.stats = self.receiver.pull(refit, method=method, into=into)
            except BaseException as e:  # reported by staging_state / commit
                job.error = e
            job.seconds = time.perf_counter() - t0

        job.thread = threading.Thread(target=run, name=f"reshard-stage-{refit}", daemon=True)
        self._staging = job
        job.thread.start()

    def _side_stream(self) -> Any:
        """The CUDA stream two-phase stages receive on (``None`` on a CPU)."""
        if self._cpu:
            return None
        import torch

        if self._stage_stream is None:
            self._stage_stream = torch.cuda.Stream(device=self.device)
        return self._stage_stream

    def _wait_staging(self) -> None:
        """Let a staging thread still running (a failed refit winding down on
        this rank) finish before the next refit starts."""
        job = self._staging
        if job is None or job.thread is None or job.done:
            return
        job.thread.join(timeout=self.receiver.config.timeout_s)
        if not job.done:
            raise ReshardError(f"engine rank {self.rank}: refit {job.refit} is still being staged")

    def staging_state(self, refit: int) -> bool:
        """Whether refit ``refit`` is fully staged (``False``: still receiving);
        raises the staging error if it failed (the live weights are untouched)."""
        job = self._staging
        if job is None or job.refit != refit:
            raise ReshardError(
                f"engine rank {self.rank}: refit {refit} was never staged"
                + (f" (refit {job.refit} was)" if job is not None else "")
            )
        if not job.done:
            return False
        if job.error is not None:
            raise job.error
        return True
