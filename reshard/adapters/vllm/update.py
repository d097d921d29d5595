"""One refit applied inside vLLM's layerwise reload lifecycle (see
:mod:`reshard.adapters.vllm.receiver` for the steps): layers are
materialized when the first byte for them arrives, processed (repacked) after
the last round that writes them, loader tensors run through vLLM's own loader
before their layers are processed, and a failed refit puts back the old
weights of every layer not yet processed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reshard.adapters.core.recording import LOADER_PREFIX, LearnedLayout
from reshard.adapters.vllm.direct import process_live
from reshard.adapters.vllm.lifecycle import (
    keep_live,
    materialize_into,
    release_held,
    repack_cpu_experts,
    reprocess,
    restore_unprocessed,
)
from reshard.errors import MixedWeightsError, ReshardError
from reshard.plan.items import RankPlan

if TYPE_CHECKING:
    import torch

__all__ = ["STEPS", "LayerwiseUpdate", "WorkerModel", "keeps_backups"]

STEPS = {
    "begin": "initialize_layerwise_reload: every layer's parameters put on the meta device, live tensors kept aside "
    "(direct layers keep theirs)",
    "backup": "old values of live tensors a refit writes in place copied aside (put back if it fails)",
    "materialize": "layers given fresh parameters of their checkpoint-loading shapes (old values kept of live ones)",
    "zero": "materialized parameters zeroed where the checkpoint leaves padding",
    "load": "staging buffers copied into materialized parameters (two-phase and delta refits)",
    "loaders": "loader tensors run through vLLM's own loaders",
    "process": "process_weights_after_loading: repacking, quantization (and CPU MoE experts packed again); "
    "for direct layers, run on the live layer",
    "copy_back": "processed values copied into the live tensors the engine reads",
    "finalize": "finalize_layerwise_reload: attention layers, untouched layers put back",
    "followers": "modules that share a tensor with an updated one processed again (a tied lm_head)",
}
"""The steps of :attr:`LayerwiseUpdate.seconds`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerModel:
    """What a refit in vLLM's layerwise lifecycle needs of its worker: the
    model, what was learned of its loaders, and the buffers loader tensors
    are received into (kept from one refit to the next)."""

    model: Any
    """The worker's ``torch.nn.Module``."""
    model_config: Any
    """vLLM's ``ModelConfig`` (``finalize_layerwise_reload`` reads it)."""
    learned: LearnedLayout
    rank: int
    """This worker's refit rank (named in errors)."""
    delta: bool = False
    """Delta refits: a loader tensor's buffer is the base the next delta patches."""
    modules: Mapping[str, Any] = field(default_factory=dict)
    """``model.named_modules()`` (empty: computed from ``model``)."""
    followers: tuple[str, ...] = ()
    """Modules that derive state from layers a refit processes, reprocessed
    after it (:func:`reshard.adapters.vllm.lifecycle.followers`)."""
    loader_buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    whole: frozenset[str] = frozenset()
    """Parameters the pieces tile exactly (:meth:`LearnedLayout.whole`):
    a refit writes every element, so they are never zeroed first."""
    direct: frozenset[str] = frozenset()
    """Layers (module names) whose bytes land in their live tensors, outside
    vLLM's lifecycle (:func:`reshard.adapters.vllm.direct.direct_layers`)."""
    pool: dict[str, torch.Tensor] | None = None
    """Where layers are materialized (parameter name -> a tensor of its
    checkpoint-loading shape, kept from one refit to the next: the
    receiver's staging buffers), or ``None``: fresh tensors each refit, as
    vLLM's own reload does. On CPU a fresh tensor is fresh pages, and the
    receive that first writes them pays a page fault per 4 KiB."""
    backups: dict[str, torch.Tensor] = field(default_factory=dict)
    """Where the old values of live tensors written in place are kept during
    a refit (kept from one refit to the next: no fresh pages each time)."""
    backup_direct: bool = True
    """Whether a direct layer's old values are copied aside before a refit
    writes them in place (:func:`keeps_backups`). Without, a refit that
    fails after it wrote a direct layer leaves the engine mixed (and says
    so), and an atomic refit writes no layer in place."""
    device: Any = None
    """Where loader tensors are received (the worker's device; ``None``: the host)."""
    prefix: str = ""
    """The prefix of this model's local names in the worker's plan (a
    drafter's, :data:`reshard.adapters.vllm.drafter.DRAFT_LOCAL`): plan
    entries without it are another model's."""

    def __post_init__(self) -> None:
        if not self.modules:
            object.__setattr__(self, "modules", dict(self.model.named_modules()))
        if not self.whole:
            object.__setattr__(self, "whole", self.learned.whole())

    def backup(self, local: str, live: torch.Tensor) -> torch.Tensor:
        """A copy of ``live``'s values, in the buffer kept for ``local``."""
        import torch

        buf = self.backups.get(local)
        if buf is None or buf.shape != live.shape or buf.dtype != live.dtype or buf.device != live.device:
            buf = self.backups[local] = torch.empty_like(live, memory_format=torch.contiguous_format)
        buf.copy_(live)
        return buf

    def loader_buffer(self, local: str) -> torch.Tensor:
        """The buffer loader tensor ``local`` is received into: the
        checkpoint tensor's shape, zero outside the region its loader reads;
        kept for the next refit."""
        buf = self.loader_buffers.get(local)
        if buf is None:
            import torch

            meta = self.learned.via_loader[local.removeprefix(LOADER_PREFIX)].tensor
            buf = self.loader_buffers[local] = torch.zeros(
                meta.shape, dtype=getattr(torch, meta.dtype), device=self.device
            )
        return buf


def keeps_backups(device: Any) -> bool:
    """Whether a worker on ``device`` copies its direct layers aside before a
    refit writes them in place. On a CPU, the engine's memory is host RAM and
    few layers are direct (oneDNN repacks most linear weights, so they
    reload through vLLM's lifecycle): the copies are small, and a failed
    refit puts every old weight back. On a GPU, an unquantized linear layer's
    processing does nothing, so almost every bf16 layer is direct: the copies
    would be a second copy of the weights, for good, in memory the KV cache
    was sized to fill (an 8B model at TP=1 needs 16 GB more), so none are
    kept: a refit that fails after it wrote a direct layer leaves the
    engine mixed, as one that fails after it processed a layer does, and
    says so (:class:`~reshard.errors.MixedWeightsError`); atomic refits
    materialize those layers instead (their documented cost)."""
    return str(device).split(":")[0] == "cpu"


@dataclass(slots=True)
class _Layer:
    name: str
    module: Any
    params: list[str]
    release_round: int = -1
    direct: bool = False
    """Written in place (see :attr:`WorkerModel.direct`)."""
    materialized: bool = False
    """Materialized, or for a direct layer, first written."""
    processed: bool = False


_NEVER = 1 << 62
"""Release round of a layer no round releases (it waits for the loaders)."""


class LayerwiseUpdate:
    """State of one refit inside vLLM's layerwise reload lifecycle."""

    def __init__(self, owner: WorkerModel, refit: int, *, atomic: bool = False) -> None:
        """``atomic``: a failed refit must leave every old weight in place, so
        layers are written in place only where their old values are copied
        aside first (:attr:`WorkerModel.backup_direct`)."""
        self.owner = owner
        self.refit = refit
        self.started = False
        self.layers: dict[str, _Layer] = {}
        self.layer_of: dict[str, _Layer] = {}
        in_place = owner.backup_direct or not atomic
        for mod_name, params in owner.learned.layers.items():
            layer = _Layer(mod_name, owner.modules[mod_name], params, direct=in_place and mod_name in owner.direct)
            self.layers[mod_name] = layer
            for p in params:
                self.layer_of[p] = layer
        self.loader_layers = {self.layer_of[p].name for p in owner.learned.loader_params if p in self.layer_of}
        """Layers a loader tensor writes into: processed once the loader ran."""
        self.n_loaded = 0
        self.loaded = False
        self.live: dict[str, torch.Tensor] = {}
        """Old values of live tensors written in place (see :meth:`param`)."""
        self.process_seconds = 0.0
        self.n_processed = 0
        self.n_direct = 0
        self.n_released = 0
        """Pool buffers the engine kept (see :func:`release_held`)."""
        """Layers whose bytes landed in their live tensors."""
        self.skipped: set[str] = set()
        """Layers :meth:`load_from` left alone (nothing of theirs changed)."""
        self.seconds: dict[str, float] = {}
        """Where the lifecycle's time went, by step (see :data:`STEPS`)."""

    def _tick(self, step: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[step] = self.seconds.get(step, 0.0) + now - since
        return now

    def begin(self, plan: RankPlan | None = None) -> None:
        """Every rank agreed to go ahead: enter vLLM's reload lifecycle."""
        from vllm.model_executor.model_loader.reload import layerwise

        t0 = time.perf_counter()
        self.release(plan)
        layerwise.initialize_layerwise_reload(self.owner.model)
        for layer in self.layers.values():
            if layer.direct:
                keep_live(layer.module)
        self.started = True
        self._tick("begin", t0)

    def release(self, plan: RankPlan | None) -> None:
        """Set each layer's release round: the last round of ``plan`` that
        writes into it or forwards from it (layers loader tensors write wait
        for the loaders)."""
        if plan is not None:
            for rnd in plan.rounds:
                touched = [t.dst.local for ts in rnd.recvs.values() for t in ts]
                touched += [t.dst.local for t in rnd.copies]
                touched += [t.src.local for ts in rnd.sends.values() for t in ts if t.kind == "fwd"]
                prefix = self.owner.prefix
                for local in touched:
                    if prefix:
                        if not local.startswith(prefix):
                            continue
                        local = local[len(prefix) :]
                    layer = self.layer_of.get(local)
                    if layer is not None:
                        layer.release_round = max(layer.release_round, rnd.index)
        for name in self.loader_layers:
            self.layers[name].release_round = _NEVER

    def release_round(self, layer: str) -> int:
        """The round after which ``layer`` is processed (see :meth:`release`)."""
        return self.layers[layer].release_round

    def to_load(self, changed: AbstractSet[str] | None) -> set[str]:
        """The layers a refit loads when ``changed`` buffers changed (``None``:
        all): those of the changed parameters, and every layer a loader
        tensor that changed writes."""
        if changed is None:
            return set(self.layers)
        names = {self.layer_of[p].name for p in changed if p in self.layer_of}
        for via in self.owner.learned.via_loader.values():
            if via.local in changed:
                names.update(self.layer_of[p].name for p in via.params if p in self.layer_of)
        return names

    def param(self, local: str, *, zero: bool = True) -> torch.Tensor:
        """The (materialized) parameter ``local`` to write into (zeroed when
        its layer is materialized, unless the pieces tile it, or
        ``zero=False``: the caller overwrites all of it)."""
        import torch
        from vllm.model_executor.model_loader.reload import layerwise

        if not self.started:
            self.begin()
        if local.startswith(LOADER_PREFIX):
            return self.owner.loader_buffer(local)
        layer = self.layer_of.get(local)
        if layer is None:
            raise KeyError(f"engine rank {self.owner.rank}: {local!r} is not a parameter this worker learned")
        if layer.processed:
            raise ReshardError(f"{local!r} written after its layer {layer.name!r} was processed")
        if layer.direct and not layer.materialized:
            # Bytes land where the engine reads them; the old values are kept
            # aside to put back if the refit fails before the layer is done
            # (on a CPU; see keeps_backups).
            if self.owner.backup_direct:
                t0 = time.perf_counter()
                with torch.no_grad():
                    for p in layer.params:
                        self.live[p] = self.owner.backup(p, _attr(self.owner.modules, p))
                self._tick("backup", t0)
            layer.materialized = True
            self.n_direct += 1
        if not layer.materialized:
            t0 = time.perf_counter()
            modules = self.owner.modules
            before = {p: _attr(modules, p) for p in layer.params}
            info = layerwise.LAYERWISE_INFO[layer.module]
            pool = self.owner.pool
            if pool is None:
                layerwise.materialize_layer(layer.module, info)
            else:
                materialize_into(layer.module, info, layer.name, pool)
            fresh = []
            with torch.no_grad():
                for p in layer.params:
                    t = _attr(modules, p)
                    if t is before[p]:
                        # vLLM keeps some tensors live through a reload (a
                        # linear layer's ``bias``, a router's
                        # ``e_score_correction_bias``): bytes land in the
                        # serving tensor itself, so keep its old values to
                        # put back if the refit fails before the layer is
                        # processed.
                        self.live[p] = self.owner.backup(p, t)
                    if zero and p not in self.owner.whole:
                        fresh.append(t)
                t0 = self._tick("materialize", t0)
                for t in fresh:
                    t.zero_()
                self._tick("zero", t0)
            layer.materialized = True
        return _attr(self.owner.modules, local).data

    def load_from(self, buffers: Mapping[str, torch.Tensor], changed: set[str] | None = None) -> None:
        """Load every layer from ``buffers`` (parameter name -> tensor of its
        checkpoint-loading shape), processing each as soon as it is loaded,
        so at most one layer is materialized besides the buffers.
        ``changed``: the buffers that changed since they were last loaded
        (a delta refit); layers none of whose buffers changed are left as
        they are, the others loaded whole, with every loader tensor that
        writes them (``None``: every layer). Layers already loaded during
        the transfer (:meth:`load_released`) are not loaded again."""
        import torch

        if not self.started:
            self.begin()
        layers = self.to_load(changed)
        deferred = []
        with torch.no_grad():
            for layer in self.layers.values():
                if layer.processed or layer.name in self.skipped:
                    continue
                if layer.name not in layers:
                    self.skipped.add(layer.name)
                    continue
                self._load_layer(layer, buffers)
                if layer.name in self.loader_layers:
                    deferred.append(layer)
                else:
                    self._process(layer)
        self.run_loaders(buffers, layers)
        for layer in deferred:
            self._process(layer)

    def load_released(self, buffers: Mapping[str, torch.Tensor], changed: AbstractSet[str], index: int) -> None:
        """A delta refit in flight, after round ``index``: load from ``buffers``
        (and process) every layer whose last round has landed and whose
        buffers changed, and leave alone those whose did not, while later
        rounds are still on the way. Layers loader tensors write wait for
        :meth:`load_from`."""
        import torch

        ready = [
            layer
            for layer in self.layers.values()
            if layer.release_round <= index
            and not layer.processed
            and not layer.materialized
            and layer.name not in self.skipped
            and layer.name not in self.loader_layers
        ]
        if not ready:
            return
        layers = self.to_load(changed)
        with torch.no_grad():
            for layer in ready:
                if layer.name not in layers:
                    self.skipped.add(layer.name)
                    continue
                self._load_layer(layer, buffers)
                self._process(layer)

    def _load_layer(self, layer: _Layer, buffers: Mapping[str, torch.Tensor]) -> None:
        """Materialize ``layer`` and copy its parameters from ``buffers``."""
        full = all(p in buffers for p in layer.params)
        for p in layer.params:
            dst = self.param(p, zero=not full)
            src = buffers.get(p)
            if src is not None and not _same(src, dst):
                t0 = time.perf_counter()
                dst.copy_(src)
                self._tick("load", t0)

    def run_loaders(self, buffers: Mapping[str, torch.Tensor] | None, layers: set[str] | None = None) -> None:
        """Run vLLM's own loader on every loader tensor (received into
        ``buffers[ViaLoader.local]``, or its buffer of this receiver), once
        the plain pieces of the layers it writes have landed; those layers
        are processed afterwards. ``layers``: only the loaders that write
        one of these."""
        import torch
        from vllm.model_executor.model_loader.reload import layerwise

        self.loaded = True
        t0 = time.perf_counter()
        for via in self.owner.learned.via_loader.values():
            if not via.params or via.region.is_empty():
                continue
            if layers is not None and not {self.layer_of[p].name for p in via.params if p in self.layer_of} & layers:
                continue
            for p in via.params:
                self.param(p)
            for layer in {self.layer_of[p].name: self.layer_of[p] for p in via.params}.values():
                for t in list(layer.module._parameters.values()) + list(layer.module._buffers.values()):
                    if t is not None and hasattr(t, "weight_loader"):
                        t.weight_loader = layerwise._get_original_loader(t)
            with torch.no_grad():
                buf = buffers[via.local] if buffers is not None else self.param(via.local)
                if self.owner.delta:
                    # The buffer is the base the next delta patches; a loader
                    # may change what it reads in place.
                    buf = buf.clone()
                self.owner.model.load_weights(iter([(via.tensor.name, buf)]))  # type: ignore[operator]
            self.n_loaded += 1
        self._tick("loaders", t0)

    def after_round(self, index: int) -> None:
        for layer in self.layers.values():
            if layer.materialized and not layer.processed and layer.release_round <= index:
                self._process(layer)

    def _process(self, layer: _Layer) -> None:
        from vllm.model_executor.model_loader.reload import layerwise

        t0 = time.perf_counter()
        if layer.direct:
            process_live(layer.module)
            layer.processed = True
            self.n_processed += 1
            self.process_seconds += time.perf_counter() - t0
            self._tick("process", t0)
            return
        copied = self.seconds.get("copy_back", 0.0)
        info = layerwise.LAYERWISE_INFO[layer.module]
        layerwise._layerwise_process(layer.module, info)
        repack_cpu_experts(layer.module)
        layer.processed = True
        self.n_processed += 1
        took = time.perf_counter() - t0
        self.process_seconds += took
        # The copy into the live tensors runs inside vLLM's processing
        # (released_kernels_adopted times it): count it apart.
        self.seconds["process"] = (
            self.seconds.get("process", 0.0) + took - (self.seconds.get("copy_back", 0.0) - copied)
        )

    def end(self) -> None:
        from vllm.model_executor.model_loader.reload import layerwise

        if self.started and not self.loaded:
            self.run_loaders(None)
        for layer in self.layers.values():
            if layer.materialized and not layer.processed:
                self._process(layer)
        missing = [
            layer.name for layer in self.layers.values() if not layer.processed and layer.name not in self.skipped
        ]
        if self.started:
            t0 = time.perf_counter()
            layerwise.finalize_layerwise_reload(self.owner.model, self.owner.model_config)
            self.started = False
            t0 = self._tick("finalize", t0)
            for name in self.owner.followers:
                reprocess(self.owner.modules[name])
            self._tick("followers", t0)
        self._release_pool()
        if missing:
            raise MixedWeightsError(
                "apply",
                {
                    self.owner.rank: f"layers {missing[:5]} received nothing in this refit and keep their old "
                    "weights; the others took the new ones"
                },
                version=self.refit,
            )

    def _release_pool(self) -> None:
        """Once the engine is out of the lifecycle (every layer it processed
        has its live tensors back): pool buffers it still holds are its own
        from now on (:func:`release_held`)."""
        if self.owner.pool is not None:
            layers = [layer for layer in self.layers.values() if layer.materialized and not layer.direct]
            names = [p for layer in layers for p in layer.params]
            self.n_released += release_held(self.owner.pool, names)

    def abort(self, error: BaseException) -> None:
        """A refit failed: put back the old weights of every layer not yet
        processed (live tensors written in place included), and leave the
        lifecycle without processing any layer again."""
        if not self.started:
            return
        import torch

        with torch.no_grad():
            for name, old in self.live.items():
                if not self.layer_of[name].processed:
                    _attr(self.owner.modules, name).copy_(old)
        restore_unprocessed(self.owner.model)
        self.started = False
        self._release_pool()
        done = sum(1 for layer in self.layers.values() if layer.processed)
        # Direct layers written in place without a copy of their old values
        # (on a GPU) cannot be put back either.
        unkept = (
            0
            if self.owner.backup_direct
            else sum(1 for layer in self.layers.values() if layer.direct and layer.materialized and not layer.processed)
        )
        if done or unkept:
            # Some layers already carry (some of) the new weights: say so loudly.
            what = f"{done} of {len(self.layers)} layers took the new weights"
            if unkept:
                what += (
                    f" and {unkept} more were written in place without a copy of their old weights (none is "
                    "kept on a GPU)"
                )
            raise MixedWeightsError(
                getattr(error, "step", "apply"),
                {
                    self.owner.rank: f"refit failed after {what}; the engine now mixes old and new weights until "
                    f"a refit succeeds ({error})"
                },
                version=self.refit,
            ) from error


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _attr(modules: Mapping[str, Any], full: str):
    mod, _, name = full.rpartition(".")
    return getattr(modules[mod], name)
