"""One refit applied inside vLLM's layerwise reload lifecycle (see
:mod:`reshard.adapters.vllm.receiver` for the steps): layers are
materialized when the first byte for them arrives, processed (repacked) after
the last round that writes them, loader tensors run through vLLM's own loader
before their layers are processed, and a failed refit puts back the old
weights of every layer not yet processed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reshard.adapters.core.recording import LOADER_PREFIX, LearnedLayout
from reshard.adapters.vllm.lifecycle import repack_cpu_experts, reprocess, restore_unprocessed
from reshard.errors import MixedWeightsError, ReshardError
from reshard.plan.items import RankPlan

if TYPE_CHECKING:
    import torch

__all__ = ["LayerwiseUpdate", "WorkerModel"]


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

    def __post_init__(self) -> None:
        if not self.modules:
            object.__setattr__(self, "modules", dict(self.model.named_modules()))

    def loader_buffer(self, local: str) -> torch.Tensor:
        """The buffer loader tensor ``local`` is received into: the
        checkpoint tensor's shape, zero outside the region its loader reads;
        kept for the next refit."""
        buf = self.loader_buffers.get(local)
        if buf is None:
            import torch

            meta = self.learned.via_loader[local.removeprefix(LOADER_PREFIX)].tensor
            buf = self.loader_buffers[local] = torch.zeros(meta.shape, dtype=getattr(torch, meta.dtype))
        return buf


@dataclass(slots=True)
class _Layer:
    name: str
    module: Any
    params: list[str]
    release_round: int = -1
    materialized: bool = False
    processed: bool = False


_NEVER = 1 << 62
"""Release round of a layer no round releases (it waits for the loaders)."""


class LayerwiseUpdate:
    """State of one refit inside vLLM's layerwise reload lifecycle."""

    def __init__(self, owner: WorkerModel, refit: int) -> None:
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
        self.loader_layers = {self.layer_of[p].name for p in owner.learned.loader_params if p in self.layer_of}
        """Layers a loader tensor writes into: processed once the loader ran."""
        self.n_loaded = 0
        self.loaded = False
        self.live: dict[str, torch.Tensor] = {}
        """Old values of live tensors written in place (see :meth:`param`)."""
        self.process_seconds = 0.0
        self.n_processed = 0
        self.skipped: set[str] = set()
        """Layers :meth:`load_from` left alone (nothing of theirs changed)."""

    def begin(self, plan: RankPlan | None = None) -> None:
        """Every rank agreed to go ahead: enter vLLM's reload lifecycle."""
        from vllm.model_executor.model_loader.reload import layerwise

        self.release(plan)
        layerwise.initialize_layerwise_reload(self.owner.model)
        self.started = True

    def release(self, plan: RankPlan | None) -> None:
        """Set each layer's release round: the last round of ``plan`` that
        writes into it or forwards from it (layers loader tensors write wait
        for the loaders)."""
        if plan is not None:
            for rnd in plan.rounds:
                touched = [t.dst.local for ts in rnd.recvs.values() for t in ts]
                touched += [t.dst.local for t in rnd.copies]
                touched += [t.src.local for ts in rnd.sends.values() for t in ts if t.kind == "fwd"]
                for local in touched:
                    layer = self.layer_of.get(local)
                    if layer is not None:
                        layer.release_round = max(layer.release_round, rnd.index)
        for name in self.loader_layers:
            self.layers[name].release_round = _NEVER

    def release_round(self, layer: str) -> int:
        """The round after which ``layer`` is processed (see :meth:`release`)."""
        return self.layers[layer].release_round

    def to_load(self, changed: set[str] | None) -> set[str]:
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
        its layer is materialized, unless ``zero=False``: the caller
        overwrites all of it)."""
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
        if not layer.materialized:
            modules = self.owner.modules
            before = {p: _attr(modules, p) for p in layer.params}
            info = layerwise.LAYERWISE_INFO[layer.module]
            layerwise.materialize_layer(layer.module, info)
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
                        self.live[p] = t.detach().clone()
                    if zero:
                        t.zero_()
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

    def load_released(self, buffers: Mapping[str, torch.Tensor], changed: set[str], index: int) -> None:
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
            if src is not None:
                dst.copy_(src)

    def run_loaders(self, buffers: Mapping[str, torch.Tensor] | None, layers: set[str] | None = None) -> None:
        """Run vLLM's own loader on every loader tensor (received into
        ``buffers[ViaLoader.local]``, or its buffer of this receiver), once
        the plain pieces of the layers it writes have landed; those layers
        are processed afterwards. ``layers``: only the loaders that write
        one of these."""
        import torch
        from vllm.model_executor.model_loader.reload import layerwise

        self.loaded = True
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

    def after_round(self, index: int) -> None:
        for layer in self.layers.values():
            if layer.materialized and not layer.processed and layer.release_round <= index:
                self._process(layer)

    def _process(self, layer: _Layer) -> None:
        from vllm.model_executor.model_loader.reload import layerwise

        t0 = time.perf_counter()
        info = layerwise.LAYERWISE_INFO[layer.module]
        layerwise._layerwise_process(layer.module, info)
        repack_cpu_experts(layer.module)
        layer.processed = True
        self.n_processed += 1
        self.process_seconds += time.perf_counter() - t0

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
            layerwise.finalize_layerwise_reload(self.owner.model, self.owner.model_config)
            self.started = False
            for name in self.owner.followers:
                reprocess(self.owner.modules[name])
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


def _attr(modules: Mapping[str, Any], full: str):
    mod, _, name = full.rpartition(".")
    return getattr(modules[mod], name)


class _LazyParams(Mapping):
    """Local name -> parameter data, materializing layers on first use."""

    reshard_lazy = True
    """Checked tensor by tensor as a refit touches them (materializing them
    all up front would defeat the layerwise reload)."""

    def __init__(self, update: LayerwiseUpdate) -> None:
        self.update = update

    def __getitem__(self, key: str):
        return self.update.param(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.update.layer_of)

    def __len__(self) -> int:
        return len(self.update.layer_of)
