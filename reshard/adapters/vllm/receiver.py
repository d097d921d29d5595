"""The receiver inside one vLLM worker: learned layout + vLLM's reload lifecycle.

One refit (``VllmReceiver.pull``):

1. every rank agrees on the plan (problems raise on every rank; the model is
   untouched);
2. ``initialize_layerwise_reload``: parameters become meta tensors of their
   checkpoint-loading shape, the live (possibly repacked) tensors are kept
   aside;
3. the first time a round writes into a layer, the layer is materialized
   and zeroed (vocab padding stays zero, as vLLM's loader leaves it); bytes
   land straight in its parameters, which have their checkpoint-loading
   shapes, so no full copy of anything is ever built;
4. after the last round that writes into a layer (or forwards from it), the
   layer is processed (``process_weights_after_loading``: on CPU, repacked
   for oneDNN; on GPU, quantized) and copied into the live tensors, one layer
   at a time, as vLLM's own layerwise reload does;
5. ``finalize_layerwise_reload`` puts back layers that were not touched and
   processes attention layers.

A two-phase refit (``VllmReceiver.stage``, then ``commit``) splits this in
two: the worker first receives everything into staging buffers of the
checkpoint-loading shapes, in a thread of its own, while the engine keeps
serving its live weights; the driver then pauses generation, ``commit``
runs steps 2-5 from the staging buffers (a memory copy and a repack per
layer, no network) and generation resumes. Staging costs one copy of what
the worker keeps (:attr:`VllmReceiver.kept_bytes`), kept for the next refit.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from reshard.adapters.core.recording import LearnedLayout
from reshard.adapters.vllm.destination import LayerwiseRefit
from reshard.adapters.vllm.direct import direct_layers
from reshard.adapters.vllm.drafter import (
    DRAFT_MODES,
    Drafter,
    LearnedDrafter,
    WithDrafter,
    drafter_worker,
    learn_drafter,
)
from reshard.adapters.vllm.layout import learn_layout
from reshard.adapters.vllm.lifecycle import (
    followers,
    released_kernels_adopted,
)
from reshard.adapters.vllm.staging import TwoPhaseStaging
from reshard.adapters.vllm.update import LayerwiseUpdate, WorkerModel, keeps_backups
from reshard.errors import MixedWeightsError, ReshardError
from reshard.plan.layout import Layout, TensorMeta
from reshard.plan.specs import build_layout
from reshard.receiver import EngineReceiver, Receiver
from reshard.transport.group import GroupConfig
from reshard.transport.locals import Tensors
from reshard.transport.posting import on_device
from reshard.transport.session import DEFAULT_BUDGET_BYTES, RefitStats
from reshard.transport.stats import EngineStats

if TYPE_CHECKING:
    import torch

__all__ = ["VllmReceiver", "canonical_tensors_of", "vllm_pg_env"]


def canonical_tensors_of(model_config, vllm_config=None) -> list[TensorMeta]:
    """Checkpoint names, shapes and dtypes of the model this engine serves,
    from transformers (see :func:`reshard.models.canonical_tensors`).

    vLLM's Transformers modeling backend decorates the transformers model
    classes it serves (Olmo2, Starcoder2, ...) for torch.compile, for the
    whole process: building one afterwards needs the current vLLM config.
    The table is built inside ``vllm_config`` with compilation switched off
    for those classes (the throwaway meta model is never run)."""
    from reshard.models import canonical_tensors

    dtype = str(model_config.dtype).removeprefix("torch.")
    with vllm_context(vllm_config), _compile_ignored():
        return canonical_tensors(model_config.hf_config.to_dict(), dtype=dtype)


def vllm_pg_env():
    """vLLM's ``unpinned_nccl_env`` (``None`` where this vLLM has none): the
    context vLLM creates communicators shared with other processes in, so the
    NCCL settings it pins in its workers (``VLLM_BATCH_INVARIANT``) do not
    apply to them (see :attr:`reshard.transport.group.GroupConfig.pg_env`)."""
    try:
        from vllm.utils.nccl import unpinned_nccl_env
    except ImportError:
        return None
    return unpinned_nccl_env


@contextlib.contextmanager
def vllm_context(vllm_config) -> Iterator[None]:
    """``set_current_vllm_config(vllm_config)`` unless one is current (or none is given)."""
    from vllm.config import get_current_vllm_config_or_none, set_current_vllm_config

    if vllm_config is None or get_current_vllm_config_or_none() is not None:
        yield
        return
    with set_current_vllm_config(vllm_config):
        yield


@contextlib.contextmanager
def _compile_ignored() -> Iterator[None]:
    """Mark every class vLLM decorated for torch.compile as not to compile, for a while."""
    from vllm.compilation.decorators import IGNORE_COMPILE_KEY
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    touched = []
    stack = list(TorchCompileWithNoGuardsWrapper.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if IGNORE_COMPILE_KEY in cls.__dict__:
            touched.append((cls, cls.__dict__[IGNORE_COMPILE_KEY]))
            setattr(cls, IGNORE_COMPILE_KEY, True)
    try:
        yield
    finally:
        for cls, value in touched:
            setattr(cls, IGNORE_COMPILE_KEY, value)


class VllmReceiver(TwoPhaseStaging, EngineReceiver):
    """Learns this worker's layout once, then pulls refits into the live engine."""

    def __init__(
        self,
        model: torch.nn.Module,
        model_config,
        *,
        config: GroupConfig,
        rank: int,
        device: torch.device | str = "cpu",
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        tensors: list[TensorMeta] | None = None,
        atomic: bool = False,
        vllm_config=None,
        drafter: Drafter | None = None,
        draft: str = "refit",
        draft_tensors: list[TensorMeta] | None = None,
    ) -> None:
        """``atomic``: the default for :meth:`pull` (see there).
        ``vllm_config``: the worker's config, current while this receiver
        builds its layout and pulls (as during vLLM's own weight loading).
        ``drafter``: the worker's speculative drafter, refit with the target
        (``draft="refit"``: its tensors join the layout, see
        :mod:`reshard.adapters.vllm.drafter`; ``draft_tensors``: its
        checkpoint's, by default read from its headers) or left alone
        (``draft="frozen"``)."""
        if draft not in DRAFT_MODES:
            raise ReshardError(f"draft={draft!r}: expected one of {DRAFT_MODES}")
        self.model = model
        self.atomic = atomic
        self.mixed = False
        self.model_config = model_config
        self.vllm_config = vllm_config
        t0 = time.perf_counter()
        with vllm_context(vllm_config):
            metas = tensors if tensors is not None else canonical_tensors_of(model_config, vllm_config)
            self.learned: LearnedLayout = learn_layout(model, metas)
        self.learn_seconds = time.perf_counter() - t0
        problems = self.learned.problems()
        if problems:
            raise ReshardError(
                f"engine rank {rank}: the layout learned from vLLM's loaders is incomplete, so refits would "
                "leave stale weights:\n  " + "\n  ".join(problems[:20])
            )
        self.draft_mode = draft if drafter is not None else ""
        self._drafter_source = drafter
        self._draft_tensors = draft_tensors
        self.drafter: LearnedDrafter | None = None
        self.draft_worker: WorkerModel | None = None
        self.draft_layout: Layout | None = None
        """The drafter's pieces alone: the layout of a draft session's refit."""
        self.rank = rank
        self.device = device
        self._cpu = str(device).split(":")[0] == "cpu"
        self._delta = config.delta
        if drafter is not None and draft == "refit":
            self._learn_drafter()
        self.layout = build_layout(
            rank, self.learned.pieces + (self.drafter.pieces if self.drafter and draft == "refit" else [])
        )
        modules = dict(model.named_modules())
        self._buffers: dict[str, torch.Tensor] | None = None
        self._stage_stream: Any = None
        """The CUDA stream two-phase stages receive on (beside the engine's)."""
        self._base_tensors: Tensors | None = None
        with vllm_context(vllm_config):
            direct = direct_layers(modules, self.learned, self.learned.whole())
        if config.pg_env is None:
            config = dataclasses.replace(config, pg_env=vllm_pg_env())
        self.worker = WorkerModel(
            model=model,
            model_config=model_config,
            learned=self.learned,
            rank=rank,
            delta=config.delta,
            modules=modules,
            followers=tuple(followers(modules, set(self.learned.layers))),
            direct=direct,
            # On CPU, layers are materialized in the staging buffers (see WorkerModel.pool);
            # with deltas those are the base the next delta patches: never processed in place.
            pool=self._staging_buffers() if self._cpu and not config.delta else None,
            backup_direct=keeps_backups(device),
            device=None if self._cpu else device,
        )
        # Every pull says which tensors it lands in (its ``into``).
        self.receiver = Receiver(
            {}, config=config, rank=rank, layout=self.layout, device=device, budget_bytes=budget_bytes
        )
        self.last_stats = EngineStats()
        """This worker's account of its last refit."""
        # Layers are processed on this thread while later rounds arrive (see
        # Applier); on CPU it yields to the receive (see idle_priority).
        self._apply_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="reshard-apply")
        self._staging = None

    def _learn_drafter(self) -> LearnedDrafter:
        """Learn the drafter from its own loaders (once), and its layout alone
        (a draft session's)."""
        if self.drafter is not None:
            return self.drafter
        drafter = self._drafter_source
        if drafter is None:
            raise ReshardError(f"engine rank {self.rank}: this engine has no drafter (no speculative decoding)")
        with vllm_context(self.vllm_config):
            learned = learn_drafter(drafter, self.model, self._draft_tensors, rank=self.rank)
            self.draft_worker = drafter_worker(learned, rank=self.rank, device=self.device, delta=self._delta)
        self.draft_layout = build_layout(self.rank, learned.pieces)
        self.drafter = learned
        return learned

    @property
    def timeout_s(self) -> float:
        """The refit group's timeout (how long a commit waits for its stage)."""
        return self.receiver.config.timeout_s

    @property
    def kept_bytes(self) -> int:
        """Bytes of checkpoint tensors this worker keeps, in the dtypes it keeps them."""
        target = sum(p.box.numel * _itemsize(p.local_dtype or p.tensor.dtype) for p in self.learned.pieces)
        return target + (self.drafter_kept_bytes if self.draft_mode == "refit" else 0)

    @property
    def drafter_kept_bytes(self) -> int:
        """What the drafter keeps of its own (0: no drafter, or not learned:
        one that is not refit)."""
        if self.drafter is None:
            return 0
        return sum(p.box.numel * _itemsize(p.local_dtype or p.tensor.dtype) for p in self.drafter.pieces)

    def pull(self, refit: int, *, method: str = "reshard", atomic: bool | None = None) -> EngineStats:
        """Receive refit ``refit`` into the live model (collective with every refit rank).

        Default: each layer is processed (repacked) after the last round that
        writes it, so only the layers in flight are materialized. If the
        refit then fails, layers not yet processed get their old weights
        back; layers already processed keep the new ones, the worker is
        marked :attr:`mixed` and the error says so. ``atomic=True``: no
        layer is processed before every rank reported a complete transfer,
        so a failed refit leaves every old weight in place; it costs one
        materialized copy of everything this worker keeps
        (:attr:`kept_bytes`) for the length of the refit.

        With delta refits (``GroupConfig.delta``) the bytes land in the
        staging buffers (the base the deltas patch) and the layers whose
        buffers changed are applied from them, as a commit does: each as
        soon as its last round landed, or (``atomic``) once every rank
        reported a complete transfer."""
        with vllm_context(self.vllm_config), on_device(self.device):
            return self._pull(refit, method, self.atomic if atomic is None else atomic)

    def _pull(self, refit: int, method: str, atomic: bool) -> EngineStats:
        self._wait_staging()
        if self.receiver.layout is not self.layout:
            self.receiver.set_layout(self.layout)
        t0 = time.perf_counter()
        if self.delta and atomic:
            stats = self.receiver.pull(refit, method=method, into=self._base())
            received = time.perf_counter() - t0
            applied = self._apply(refit, stats.touched)
            return self._account(stats, applied, t0, atomic=True, stage_seconds=received)
        buffers = self._staging_buffers() if self.delta else None
        update = self._update(refit, atomic)
        try:
            with (
                self._applying(update),
                LayerwiseRefit(update, self._apply_pool, idle=self._cpu, buffers=buffers, atomic=atomic) as into,
            ):
                stats = self.receiver.pull(refit, method=method, into=into)
                received = time.perf_counter() - t0
                if buffers is not None:
                    update.load_from(buffers, None if stats.touched is None else set(stats.touched))
                # (The baseline has no rounds of ours: its first write starts the lifecycle.)
                update.end()
        except BaseException as e:
            if buffers is not None:
                self.receiver.forget_base(f"applying refit {refit} failed on this engine ({type(e).__name__})")
            raise
        if buffers is None:
            return self._account(stats, update, t0, atomic=atomic)
        return self._account(stats, update, t0, atomic=atomic, stage_seconds=received)

    def _update(self, refit: int, atomic: bool) -> LayerwiseUpdate | WithDrafter:
        """One refit in vLLM's layerwise lifecycle: the target's, and its drafter's beside it."""
        update = LayerwiseUpdate(self.worker, refit, atomic=atomic)
        if self.draft_worker is None or self.drafter is None:
            return update
        drafter = LayerwiseUpdate(self.draft_worker, refit, atomic=atomic)
        return WithDrafter(update, drafter, self.drafter.shared_modules)

    def _account(self, stats: RefitStats, update: LayerwiseUpdate | WithDrafter, t0: float, **more: Any) -> EngineStats:
        """This worker's account of a refit (:attr:`last_stats`), built here alone."""
        fields: dict[str, Any] = dict(
            apply_seconds=update.process_seconds,
            refit_seconds=time.perf_counter() - t0,
            kept_bytes=self.kept_bytes,
            layers_processed=update.n_processed,
            layers_direct=update.n_direct,
            buffers_kept_by_engine=update.n_released,
            lifecycle_seconds=dict(update.seconds),
            loader_tensors=update.n_loaded,
            layers_skipped=len(update.skipped),
            delta=self.delta,
            staging_bytes=self.staging_bytes,
            drafter=self.draft_mode,
            drafter_kept_bytes=self.drafter_kept_bytes if self.draft_mode == "refit" else 0,
        )
        fields.update(more)
        self.last_stats = EngineStats.of_refit(stats, **fields)
        return self.last_stats

    # -- the drafter's own refits ----------------------------------------------------

    def pull_drafter(self, refit: int, *, method: str = "reshard") -> EngineStats:
        """Receive refit ``refit`` into the drafter alone (vLLM's draft
        session, ``start_draft_weight_update``): a refit whose layout is the
        drafter's pieces (trainer ranks publish its tensors only), each
        layer in the drafter's layerwise reload. Tensors it shares with the
        target are the target's and left alone. Refused for a drafter
        declared ``frozen``."""
        with vllm_context(self.vllm_config), on_device(self.device):
            self._wait_staging()
            if self.draft_mode == "frozen":
                raise ReshardError(f"engine rank {self.rank}: the drafter was declared frozen (draft='frozen')")
            learned = self._learn_drafter()
            assert self.draft_worker is not None and self.draft_layout is not None
            t0 = time.perf_counter()
            self.receiver.set_layout(self.draft_layout)
            update = WithDrafter(None, LayerwiseUpdate(self.draft_worker, refit), learned.shared_modules)
            with (
                self._applying(update),
                LayerwiseRefit(update, self._apply_pool, idle=self._cpu) as into,
            ):
                stats = self.receiver.pull(refit, method=method, into=into)
                update.end()
            return self._account(
                stats,
                update,
                t0,
                drafter="refit",
                kept_bytes=self.drafter_kept_bytes,
                drafter_kept_bytes=self.drafter_kept_bytes,
            )

    # -- delta refits ----------------------------------------------------------

    @property
    def delta(self) -> bool:
        """Delta refits (``GroupConfig.delta``): the staging buffers are this
        worker's base, patched by every refit and applied from, layers whose
        buffers changed only."""
        return self.receiver.config.delta

    def _apply(self, refit: int, changed: frozenset[str] | None) -> LayerwiseUpdate | WithDrafter:
        """vLLM's layerwise reload from the staging buffers: the layers whose
        buffers changed (``changed``; ``None``: all), the drafter's beside
        the target's. If it fails, the engine's weights no longer follow the
        buffers, so the next delta refit is dense and applies every layer."""
        assert self._buffers is not None
        update = self._update(refit, atomic=False)
        try:
            with self._applying(update):
                update.load_from(self._buffers, None if changed is None else set(changed))
                update.end()
        except BaseException as e:
            self.receiver.forget_base(f"applying refit {refit} failed on this engine ({type(e).__name__})")
            raise
        return update

    # -- two-phase refits ------------------------------------------------------

    def commit(self, refit: int, *, wait_s: float = 0.0) -> EngineStats:
        """Phase 2 of a two-phase refit: apply staged refit ``refit`` to the
        live model (vLLM's layerwise reload from the staging buffers: a copy
        and a repack per layer). Run it with generation paused. ``wait_s``:
        how long to wait for staging to finish first."""
        job = self._staging
        if job is not None and job.refit == refit and job.thread is not None:
            job.thread.join(timeout=wait_s)
        if not self.staging_state(refit):
            raise ReshardError(f"engine rank {self.rank}: refit {refit} is still being staged")
        assert job is not None and self._buffers is not None
        with vllm_context(self.vllm_config), on_device(self.device):
            t0 = time.perf_counter()
            update = self._apply(refit, job.stats.touched)
        self._staging = None
        stats = self._account(job.stats, update, t0, atomic=True, two_phase=True, stage_seconds=job.seconds)
        # The whole refit: the stage (while the engine served) and the apply.
        stats.refit_seconds += job.seconds
        return stats

    @contextlib.contextmanager
    def _applying(self, update: LayerwiseUpdate | WithDrafter) -> Iterator[None]:
        """Run ``update`` (live tensors released after loading take the new
        values, see :func:`reshard.adapters.vllm.lifecycle.adopt_released_kernels`);
        if it fails, put back the old weights of every layer not yet processed
        and record whether this worker is now mixed."""
        try:
            with released_kernels_adopted(update.seconds):
                yield
        except BaseException as e:
            try:
                update.abort(e)
            except MixedWeightsError:
                self.mixed = True
                raise
            self.mixed = isinstance(e, MixedWeightsError)
            raise
        self.mixed = False

    def close(self) -> None:
        job = self._staging
        self.receiver.close()
        self._apply_pool.shutdown(wait=True)
        if job is not None and job.thread is not None:
            job.thread.join(timeout=5)
        self._staging = None
        self._buffers = None


def _itemsize(dtype: str) -> int:
    from reshard.plan.layout import dtype_size

    return dtype_size(dtype)
