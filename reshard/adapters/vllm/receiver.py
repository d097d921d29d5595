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

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reshard.adapters.core.recording import LearnedLayout
from reshard.adapters.vllm.layout import learn_layout
from reshard.errors import MixedWeightsError, ReshardError
from reshard.plan.items import RankPlan
from reshard.plan.layout import TensorMeta
from reshard.plan.specs import build_layout
from reshard.receiver import Receiver
from reshard.transport.group import GroupConfig
from reshard.transport.session import DEFAULT_BUDGET_BYTES

if TYPE_CHECKING:
    import torch

__all__ = ["VllmReceiver", "canonical_tensors_of"]


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


@dataclass(slots=True)
class _Layer:
    name: str
    module: Any
    params: list[str]
    release_round: int = -1
    materialized: bool = False
    processed: bool = False


class VllmReceiver:
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
    ) -> None:
        """``atomic``: the default for :meth:`pull` (see there).
        ``vllm_config``: the worker's config, current while this receiver
        builds its layout and pulls (as during vLLM's own weight loading)."""
        self.model = model
        self.atomic = atomic
        self.mixed = False
        self.model_config = model_config
        self.vllm_config = vllm_config
        t0 = time.perf_counter()
        with vllm_context(vllm_config):
            metas = tensors if tensors is not None else canonical_tensors_of(model_config, vllm_config)
            self.learned: LearnedLayout = learn_layout(model, model_config, metas)
        self.learn_seconds = time.perf_counter() - t0
        problems = self.learned.problems()
        if problems:
            raise ReshardError(
                f"engine rank {rank}: the layout learned from vLLM's loaders is incomplete, so refits would "
                "leave stale weights:\n  " + "\n  ".join(problems[:20])
            )
        self.layout = build_layout(rank, self.learned.pieces)
        self.modules = dict(model.named_modules())
        self.followers = _followers(self.modules, set(self.learned.layers))
        self.rank = rank
        self.receiver = Receiver(
            {},
            config=config,
            rank=rank,
            layout=self.layout,
            device=device,
            budget_bytes=budget_bytes,
            check_tensors=False,
        )
        self.last_stats: dict[str, Any] = {}
        self._staging: _Staging | None = None
        self._buffers: dict[str, torch.Tensor] | None = None

    @property
    def kept_bytes(self) -> int:
        """Bytes of checkpoint tensors this worker keeps, in the dtypes it keeps them."""
        return sum(p.box.numel * _itemsize(p.local_dtype or p.tensor.dtype) for p in self.learned.pieces)

    def pull(self, refit: int, *, method: str = "reshard", atomic: bool | None = None) -> dict[str, Any]:
        """Receive refit ``refit`` into the live model (collective with every refit rank).

        Default: each layer is processed (repacked) after the last round that
        writes it, so only the layers in flight are materialized. If the
        refit then fails, layers not yet processed get their old weights
        back; layers already processed keep the new ones, the worker is
        marked :attr:`mixed` and the error says so. ``atomic=True``: no
        layer is processed before every rank reported a complete transfer,
        so a failed refit leaves every old weight in place; it costs one
        materialized copy of everything this worker keeps
        (:attr:`kept_bytes`) for the length of the refit."""
        with vllm_context(self.vllm_config):
            return self._pull(refit, method, self.atomic if atomic is None else atomic)

    def _pull(self, refit: int, method: str, atomic: bool) -> dict[str, Any]:
        self._wait_staging()
        update = _Update(self, refit)
        t0 = time.perf_counter()
        with self._applying(update):
            stats = self.receiver.pull(
                refit,
                method=method,
                destinations=update.tensors,
                before_transfer=update.begin,
                after_round=None if atomic else update.after_round,
            )
            # (The baseline has no rounds of ours: its first write starts the lifecycle.)
            update.end()
        self.last_stats = {
            **stats.as_dict(),
            "apply_seconds": update.process_seconds,
            "refit_seconds": time.perf_counter() - t0,
            "kept_bytes": self.kept_bytes,
            "layers_processed": update.n_processed,
            "atomic": atomic,
        }
        return self.last_stats

    # -- two-phase refits ------------------------------------------------------

    @property
    def staging_bytes(self) -> int:
        """Bytes of staging buffers this worker holds (0 until its first :meth:`stage`)."""
        return sum(t.nbytes for t in (self._buffers or {}).values())

    def _staging_buffers(self) -> dict[str, torch.Tensor]:
        """One zeroed buffer per parameter, of its checkpoint-loading shape and
        dtype; kept for the next refit (regions no piece writes, such as
        vocabulary padding, stay zero, as vLLM's loader leaves them)."""
        import torch

        if self._buffers is None:
            dtypes: dict[str, str] = {}
            for p in self.learned.pieces:
                dtypes.setdefault(p.local, p.local_dtype or p.tensor.dtype)
            self._buffers = {
                name: torch.zeros(shape, dtype=getattr(torch, dtypes.get(name, _model_dtype(self.model_config))))
                for name, shape in self.learned.local_shapes.items()
            }
        return self._buffers

    def stage(self, refit: int, *, method: str = "reshard") -> None:
        """Phase 1 of a two-phase refit: start receiving refit ``refit`` into
        staging buffers, in a thread of its own, and return at once. The live
        weights are untouched, so the engine keeps serving; if the transfer
        fails, nothing changed. :meth:`staging_state` says when it is done,
        :meth:`commit` applies it (with generation paused)."""
        self._wait_staging()
        buffers = self._staging_buffers()
        job = _Staging(refit, method)

        def run() -> None:
            t0 = time.perf_counter()
            try:
                job.stats = self.receiver.pull(refit, method=method, destinations=buffers)
            except BaseException as e:  # reported by staging_state / commit
                job.error = e
            job.seconds = time.perf_counter() - t0

        job.thread = threading.Thread(target=run, name=f"reshard-stage-{refit}", daemon=True)
        self._staging = job
        job.thread.start()

    def _wait_staging(self) -> None:
        """Let a staging thread still running (a failed refit winding down on
        this rank) finish before the next refit starts."""
        job = self._staging
        if job is None or job.thread is None or job.done:
            return
        job.thread.join(timeout=self.receiver.session.config.timeout_s)
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

    def commit(self, refit: int, *, wait_s: float = 0.0) -> dict[str, Any]:
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
        with vllm_context(self.vllm_config):
            update = _Update(self, refit)
            t0 = time.perf_counter()
            with self._applying(update):
                update.load_from(self._buffers)
                update.end()
        self._staging = None
        apply_s = time.perf_counter() - t0
        self.last_stats = {
            **job.stats.as_dict(),
            "apply_seconds": apply_s,
            "stage_seconds": job.seconds,
            "refit_seconds": job.seconds + apply_s,
            "kept_bytes": self.kept_bytes,
            "staging_bytes": self.staging_bytes,
            "layers_processed": update.n_processed,
            "atomic": True,
            "two_phase": True,
        }
        return self.last_stats

    @contextlib.contextmanager
    def _applying(self, update: _Update) -> Iterator[None]:
        """Run ``update``; if it fails, put back the old weights of every layer
        not yet processed and record whether this worker is now mixed."""
        try:
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
        if job is not None and job.thread is not None:
            job.thread.join(timeout=5)
        self._staging = None
        self._buffers = None


def _model_dtype(model_config) -> str:
    return str(model_config.dtype).removeprefix("torch.")


def _itemsize(dtype: str) -> int:
    from reshard.plan.layout import dtype_size

    return dtype_size(dtype)


class _Update:
    """State of one refit inside vLLM's layerwise reload lifecycle."""

    def __init__(self, owner: VllmReceiver, refit: int) -> None:
        self.owner = owner
        self.refit = refit
        self.started = False
        self.layers: dict[str, _Layer] = {}
        self.layer_of: dict[str, _Layer] = {}
        for mod_name, params in owner.learned.layers.items():
            layer = _Layer(mod_name, owner.modules[mod_name], params)
            self.layers[mod_name] = layer
            for p in params:
                self.layer_of[p] = layer
        self.tensors = _LazyParams(self)
        self.process_seconds = 0.0
        self.n_processed = 0

    def begin(self, plan: RankPlan | None = None) -> None:
        """Every rank agreed to go ahead: enter vLLM's reload lifecycle."""
        from vllm.model_executor.model_loader.reload import layerwise

        if plan is not None:
            for rnd in plan.rounds:
                touched = [t.dst.local for ts in rnd.recvs.values() for t in ts]
                touched += [t.dst.local for t in rnd.copies]
                touched += [t.src.local for ts in rnd.sends.values() for t in ts if t.kind == "fwd"]
                for local in touched:
                    layer = self.layer_of.get(local)
                    if layer is not None:
                        layer.release_round = max(layer.release_round, rnd.index)
        layerwise.initialize_layerwise_reload(self.owner.model)
        self.started = True

    def param(self, local: str, *, zero: bool = True) -> torch.Tensor:
        """The (materialized) parameter ``local`` to write into (zeroed when
        its layer is materialized, unless ``zero=False``: the caller
        overwrites all of it)."""
        import torch
        from vllm.model_executor.model_loader.reload import layerwise

        if not self.started:
            self.begin()
        layer = self.layer_of.get(local)
        if layer is None:
            raise KeyError(f"engine rank {self.owner.rank}: {local!r} is not a parameter this worker learned")
        if layer.processed:
            raise ReshardError(f"{local!r} written after its layer {layer.name!r} was processed")
        if not layer.materialized:
            info = layerwise.LAYERWISE_INFO[layer.module]
            layerwise.materialize_layer(layer.module, info)
            if zero:
                with torch.no_grad():
                    for p in layer.params:
                        _attr(self.owner.modules, p).zero_()
            layer.materialized = True
        return _attr(self.owner.modules, local).data

    def load_from(self, buffers: Mapping[str, torch.Tensor]) -> None:
        """Load every layer from ``buffers`` (parameter name -> tensor of its
        checkpoint-loading shape), processing each as soon as it is loaded,
        so at most one layer is materialized besides the buffers."""
        import torch

        self.begin()
        with torch.no_grad():
            for layer in self.layers.values():
                full = all(p in buffers for p in layer.params)
                for p in layer.params:
                    dst = self.param(p, zero=not full)
                    src = buffers.get(p)
                    if src is not None:
                        dst.copy_(src)
                self._process(layer)

    def after_round(self, index: int) -> None:
        for layer in self.layers.values():
            if layer.materialized and not layer.processed and layer.release_round <= index:
                self._process(layer)

    def _process(self, layer: _Layer) -> None:
        from vllm.model_executor.model_loader.reload import layerwise

        t0 = time.perf_counter()
        info = layerwise.LAYERWISE_INFO[layer.module]
        layerwise._layerwise_process(layer.module, info)
        _repack_cpu_experts(layer.module)
        layer.processed = True
        self.n_processed += 1
        self.process_seconds += time.perf_counter() - t0

    def end(self) -> None:
        from vllm.model_executor.model_loader.reload import layerwise

        for layer in self.layers.values():
            if layer.materialized and not layer.processed:
                self._process(layer)
        missing = [layer.name for layer in self.layers.values() if not layer.processed]
        if self.started:
            layerwise.finalize_layerwise_reload(self.owner.model, self.owner.model_config)
            self.started = False
            for name in self.owner.followers:
                _reprocess(self.owner.modules[name])
        if missing:
            raise MixedWeightsError(
                "apply",
                {
                    self.owner.rank: f"layers {missing[:5]} received nothing in this refit and keep their old "
                    "weights; the others took the new ones"
                },
                version=self.refit,
            )

    def abort(self, error: BaseException) -> None:
        """A refit failed: put back the old weights of every layer not yet processed."""
        if not self.started:
            return
        from vllm.model_executor.model_loader.reload import layerwise

        for layer in self.layers.values():
            if not layer.processed:
                info = layerwise.LAYERWISE_INFO[layer.module]
                if info.kernel_tensors is not None:
                    layerwise._place_kernel_tensors(layer.module, info)
                info.reset()
        layerwise.finalize_layerwise_reload(self.owner.model, self.owner.model_config)
        self.started = False
        done = sum(1 for layer in self.layers.values() if layer.processed)
        if done:
            # Some layers already carry the new weights: say so loudly.
            raise MixedWeightsError(
                getattr(error, "step", "apply"),
                {
                    self.owner.rank: f"refit failed after {done} of {len(self.layers)} layers took the new "
                    f"weights; the engine now mixes old and new weights until a refit succeeds ({error})"
                },
                version=self.refit,
            ) from error


def _followers(modules: dict[str, Any], updated: set[str]) -> list[str]:
    """Modules that share a live tensor with a module we update but load
    nothing themselves (a tied ``lm_head``). vLLM's reload never processes
    them again, so whatever they derived from the shared weight (the CPU
    ``lm_head`` packs its own copy for its matmul) goes stale."""
    owners: dict[int, set[str]] = {}
    for name, mod in modules.items():
        for t in list(mod._parameters.values()) + list(mod._buffers.values()):
            if t is not None and t.numel() and not t.is_meta:
                owners.setdefault(t.untyped_storage().data_ptr(), set()).add(name)
    out = set()
    for names in owners.values():
        if names & updated:
            out |= {n for n in names - updated if getattr(modules[n], "quant_method", None) is not None}
    return sorted(out)


def _reprocess(module) -> None:
    qm = getattr(module, "quant_method", None)
    if qm is not None and hasattr(qm, "process_weights_after_loading"):
        qm.process_weights_after_loading(module)


def _repack_cpu_experts(module) -> None:
    """vLLM 0.32 on CPU prepacks MoE expert weights into its grouped-GEMM
    layout only on the first load; on a weight update it copies the
    checkpoint-layout weights over the packed ones, and its own reload then
    serves garbage. Pack again, as the first load does."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is not None and type(experts).__module__.endswith("cpu_moe"):
        experts.process_weights_after_loading(module)


def _attr(modules: dict[str, Any], full: str):
    mod, _, name = full.rpartition(".")
    return getattr(modules[mod], name)


class _LazyParams(Mapping):
    """Local name -> parameter data, materializing layers on first use."""

    reshard_lazy = True
    """Checked tensor by tensor as a refit touches them (materializing them
    all up front would defeat the layerwise reload)."""

    def __init__(self, update: _Update) -> None:
        self.update = update

    def __getitem__(self, key: str):
        return self.update.param(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.update.layer_of)

    def __len__(self) -> int:
        return len(self.update.layer_of)
