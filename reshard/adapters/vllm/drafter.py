"""A speculative-decoding drafter refit with its target, sliced: a separate
draft model, an EAGLE/EAGLE3 head, or MTP layers.

The drafter is learned from its own loaders, as the target is
(:func:`reshard.adapters.vllm.layout.learn_layout` on the drafter's
``load_weights``, fed the names and shapes of the drafter's checkpoint),
and its pieces join the worker's layout:

- **canonical names** are the drafter's checkpoint names. A drafter with a
  checkpoint of its own (``draft_model``, ``eagle``, ``eagle3``) has them
  under :data:`DRAFT_NAMES` (``draft.``), since a separate draft model's
  names are the target's (``model.layers.0...``); MTP layers live in the
  target's checkpoint and keep its names (``model.layers.{num_hidden_layers}.*``
  for DeepSeek-V3, ``model.mtp_layers.*`` for MiMo);
- **local names** of the drafter's parameters are under :data:`DRAFT_LOCAL`;
- **tensors shared with the target by reference** (EAGLE's and MTP's
  ``embed_tokens`` and ``lm_head``, DeepSeek MTP's ``shared_head.head``)
  are the target's: written once, under the target's name, never twice;
- in a refit the drafter runs its own layerwise reload beside the target's
  (:class:`WithDrafter`): each layer materialized when its first byte
  arrives and processed (``process_weights_after_loading``: CPU repacks,
  MoE experts repacked) after its last round, and
  ``finalize_layerwise_reload`` on the drafter after the target's.

A drafter no trainer publishes fails the plan (every uncovered drafter
tensor named) unless the engine was told the drafter is frozen
(``GroupSpec.draft="frozen"``): then it is left out of the layout and
reported as such (``EngineStats.drafter``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reshard.adapters.core.recording import LearnedLayout
from reshard.adapters.vllm.update import LayerwiseUpdate, WorkerModel, keeps_backups
from reshard.errors import MixedWeightsError, ReshardError
from reshard.plan.layout import TensorMeta
from reshard.plan.specs import PieceSpec

if TYPE_CHECKING:
    import torch

    from reshard.plan.items import RankPlan

__all__ = [
    "DRAFT_LOCAL",
    "DRAFT_MODES",
    "DRAFT_NAMES",
    "Drafter",
    "LearnedDrafter",
    "WithDrafter",
    "checkpoint_tensors",
    "drafter_worker",
    "find_drafter",
    "learn_drafter",
]

DRAFT_LOCAL = "drafter:"
"""Prefix of the drafter's local (parameter) names in a worker's layout."""
DRAFT_NAMES = "draft."
"""Prefix of the canonical names of a drafter with a checkpoint of its own."""
DRAFT_MODES = ("refit", "separate", "frozen")
"""``refit``: the drafter is a destination of every refit (a trainer must
publish its tensors); ``separate``: left out of the target's refits, refit
in refits of its own (vLLM's draft sessions, ``start_draft_weight_update``);
``frozen``: it is left alone (a draft session is refused)."""


@dataclass(frozen=True, slots=True)
class Drafter:
    """A worker's drafter: its module, vLLM's ``ModelConfig`` of it, the
    speculative method."""

    model: Any
    model_config: Any
    method: str

    @property
    def names(self) -> str:
        """The prefix of its canonical names (see the module docstring)."""
        return "" if _in_target_checkpoint(self.method) else DRAFT_NAMES


def _in_target_checkpoint(method: str) -> bool:
    """MTP methods (``mtp``, ``deepseek_mtp``, ``mimo_mtp``, ``qwen3_next_mtp``, ...)
    load the drafter from the target's own checkpoint."""
    return method == "mtp" or method.endswith("_mtp")


def find_drafter(worker: Any) -> Drafter | None:
    """The drafter of vLLM worker ``worker`` (``None``: no speculative
    decoding, or a method without weights such as ``ngram``)."""
    spec = getattr(worker, "speculative_config", None)
    if spec is None:
        spec = getattr(getattr(worker, "vllm_config", None), "speculative_config", None)
    if spec is None or getattr(spec, "draft_model_config", None) is None:
        return None
    runner = worker.model_runner
    get = getattr(runner, "get_draft_model", None)
    model = get() if callable(get) else getattr(getattr(runner, "drafter", None), "model", None)
    if model is None:
        return None
    return Drafter(model=model, model_config=spec.draft_model_config, method=str(spec.method))


def checkpoint_tensors(model_config: Any) -> list[TensorMeta]:
    """Names and shapes of the drafter's checkpoint tensors, from its
    safetensors headers (no data read), in the dtype the engine keeps
    floating-point tensors in. The drafter's loader decides which it takes."""
    from safetensors import safe_open

    path = str(model_config.model)
    if not os.path.isdir(path):
        raise ReshardError(
            f"the drafter's checkpoint {path!r} is not a local directory: its tensors cannot be named; "
            "say the drafter is frozen (draft='frozen') to leave it alone"
        )
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    if not files:
        raise ReshardError(f"the drafter's checkpoint {path!r} has no safetensors files")
    dtype = str(model_config.dtype).removeprefix("torch.")
    out = []
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sl = f.get_slice(key)
                kept = dtype if sl.get_dtype() in ("F32", "F16", "BF16") else _dtype_of(sl.get_dtype())
                out.append(TensorMeta(key, tuple(sl.get_shape()), kept))
    return out


def _dtype_of(code: str) -> str:
    return {"I64": "int64", "I32": "int32", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F64": "float64"}.get(
        code, code.lower()
    )


@dataclass(slots=True)
class LearnedDrafter:
    """What a worker learned of its drafter."""

    drafter: Drafter
    learned: LearnedLayout
    """The drafter's own layout (its local names, its checkpoint names),
    without the tensors it shares with the target."""
    pieces: list[PieceSpec]
    """The same pieces as they join the worker's layout (canonical and
    local names prefixed)."""
    shared: list[str]
    """Drafter parameters that are the target's (written once, as the target's)."""
    shared_modules: list[Any]
    """Drafter modules that are the target's (or hold its tensors): left to
    the target's reload, never the drafter's."""


def learn_drafter(
    drafter: Drafter, target: torch.nn.Module, tensors: list[TensorMeta] | None = None, *, rank: int = -1
) -> LearnedDrafter:
    """Learn ``drafter`` from its own loaders (``tensors``: its checkpoint's,
    by default read from its headers), leaving out what it shares with
    ``target`` by reference. A layout that would leave it stale is refused,
    naming engine rank ``rank``."""
    from reshard.adapters.vllm.layout import learn_layout

    metas = tensors if tensors is not None else checkpoint_tensors(drafter.model_config)
    learned = learn_layout(drafter.model, metas)
    ids = {id(m) for m in target.modules()}
    ids |= {id(t) for t in list(target.parameters()) + list(target.buffers())}
    storages = {
        t.untyped_storage().data_ptr()
        for t in list(target.parameters()) + list(target.buffers())
        if t.device.type != "meta" and t.untyped_storage().nbytes() > 0
    }
    modules = dict(drafter.model.named_modules())
    shared_modules = [
        m
        for m in modules.values()
        if id(m) in ids or any(id(t) in ids for t in list(m._parameters.values()) + list(m._buffers.values()))
    ]
    shared = set()
    for local in learned.local_shapes:
        mod, _, attr = local.rpartition(".")
        owner = modules.get(mod)
        t = getattr(owner, attr, None) if owner is not None else None
        if owner is None or t is None:
            continue
        if (
            id(owner) in ids
            or id(t) in ids
            or (
                t.device.type != "meta"
                and t.untyped_storage().nbytes() > 0
                and t.untyped_storage().data_ptr() in storages
            )
        ):
            shared.add(local)
    learned = _without(learned, shared)
    problems = learned.problems()
    if problems:
        raise ReshardError(
            f"engine rank {rank}: the drafter's layout learned from its loaders is incomplete, so refits would "
            "leave it stale:\n  " + "\n  ".join(problems[:20])
        )
    pieces = [
        dataclasses.replace(
            p,
            tensor=TensorMeta(drafter.names + p.tensor.name, p.tensor.shape, p.tensor.dtype),
            local=DRAFT_LOCAL + p.local,
        )
        for p in learned.pieces
    ]
    return LearnedDrafter(
        drafter=drafter, learned=learned, pieces=pieces, shared=sorted(shared), shared_modules=shared_modules
    )


def drafter_worker(learned: LearnedDrafter, *, rank: int, device: Any, delta: bool = False) -> WorkerModel:
    """What a refit of the drafter needs (as :class:`WorkerModel` says for a
    target): its local names under :data:`DRAFT_LOCAL` in the worker's
    plans; layers written in place decided from its own processing.
    ``delta``: delta refits (its staging buffers are a base: never loaded from in place)."""
    from reshard.adapters.vllm.direct import direct_layers
    from reshard.adapters.vllm.lifecycle import followers

    cpu = str(device).split(":")[0] == "cpu"
    modules = dict(learned.drafter.model.named_modules())
    layout = learned.learned
    return WorkerModel(
        model=learned.drafter.model,
        model_config=learned.drafter.model_config,
        learned=layout,
        rank=rank,
        delta=delta,
        modules=modules,
        followers=tuple(followers(modules, set(layout.layers))),
        direct=direct_layers(modules, layout, layout.whole()),
        backup_direct=keeps_backups(device),
        device=None if cpu else device,
        prefix=DRAFT_LOCAL,
    )


def _without(learned: LearnedLayout, shared: set[str]) -> LearnedLayout:
    """``learned`` without parameters ``shared`` (and loader tensors that write only those)."""
    if not shared:
        return learned
    via = {}
    for name, v in learned.via_loader.items():
        params = tuple(p for p in v.params if p not in shared)
        if params or not v.params:
            via[name] = dataclasses.replace(v, params=params)
    dropped = {v.local for name, v in learned.via_loader.items() if name not in via}
    gone = shared | dropped
    layers = {m: [p for p in ps if p not in gone] for m, ps in learned.layers.items()}
    return LearnedLayout(
        pieces=[p for p in learned.pieces if p.local not in gone],
        local_shapes={k: v for k, v in learned.local_shapes.items() if k not in gone},
        zero_fill={k: v for k, v in learned.zero_fill.items() if k not in gone},
        layers={m: ps for m, ps in layers.items() if ps},
        unsupported=list(learned.unsupported),
        uncovered={k: v for k, v in learned.uncovered.items() if k not in gone},
        via_loader=via,
    )


class WithDrafter:
    """One refit of a target and its drafter, each in its own layerwise
    reload, as one update (what :class:`reshard.adapters.vllm.destination.LayerwiseRefit`
    drives): names under :data:`DRAFT_LOCAL` are the drafter's.
    ``target=None``: the drafter alone (vLLM's draft session)."""

    def __init__(self, target: LayerwiseUpdate | None, drafter: LayerwiseUpdate, shared: list[Any]) -> None:
        """``shared``: the drafter's modules that are the target's
        (:attr:`LearnedDrafter.shared_modules`)."""
        self.target = target
        self.drafter = drafter
        self.shared = shared
        self.updates = [u for u in (target, drafter) if u is not None]
        self.layer_of: dict[str, Any] = {DRAFT_LOCAL + k: v for k, v in drafter.layer_of.items()}
        if target is not None:
            self.layer_of.update(target.layer_of)
        first = self.updates[0]
        self.skipped = first.skipped
        self.seconds = first.seconds
        """Where the apply's time went, by step: the target's, the drafter's added at :meth:`end`."""
        self.started = False

    def begin(self, plan: RankPlan | None = None) -> None:
        """The drafter's reload first, then the modules it shares with the
        target taken out of it (back live), then the target's, which owns
        them: a module the target writes in place (its embedding) must not
        be left on the meta device by the drafter's reload, nor put back at
        its old values when the drafter's reload is finalized. A drafter
        refit alone leaves them to the target (its refits write them)."""
        from reshard.adapters.vllm.lifecycle import keep_live

        self.started = True
        self.drafter.begin(plan)
        for m in self.shared:
            keep_live(m)
        if self.target is not None:
            self.target.begin(plan)

    def param(self, local: str, *, zero: bool = True) -> torch.Tensor:
        if not self.started:
            self.begin()
        if local.startswith(DRAFT_LOCAL):
            return self.drafter.param(local[len(DRAFT_LOCAL) :], zero=zero)
        if self.target is None:
            raise KeyError(f"{local!r}: a drafter's refit writes only the drafter's tensors")
        return self.target.param(local, zero=zero)

    def after_round(self, index: int) -> None:
        for u in self.updates:
            u.after_round(index)

    def _split(self, names: Any) -> tuple[Any, Any]:
        """``names`` (a mapping or set of local names; ``None``: all) as the
        target's and the drafter's (names under :data:`DRAFT_LOCAL` unprefixed)."""
        if names is None:
            return None, None
        n = len(DRAFT_LOCAL)
        if isinstance(names, Mapping):
            target = {k: v for k, v in names.items() if not k.startswith(DRAFT_LOCAL)}
            return target, {k[n:]: v for k, v in names.items() if k.startswith(DRAFT_LOCAL)}
        return {k for k in names if not k.startswith(DRAFT_LOCAL)}, {k[n:] for k in names if k.startswith(DRAFT_LOCAL)}

    def load_from(self, buffers: Mapping[str, torch.Tensor], changed: AbstractSet[str] | None = None) -> None:
        """Load target and drafter from staging ``buffers`` (a commit, or a
        delta refit), as :meth:`LayerwiseUpdate.load_from` does for one."""
        if not self.started:
            self.begin()
        (tb, db), (tc, dc) = self._split(buffers), self._split(changed)
        if self.target is not None:
            self.target.load_from(tb, tc)
        self.drafter.load_from(db, dc)

    def load_released(self, buffers: Mapping[str, torch.Tensor], changed: AbstractSet[str], index: int) -> None:
        """A delta refit in flight: :meth:`LayerwiseUpdate.load_released` on each."""
        if not self.started:
            self.begin()
        (tb, db), (tc, dc) = self._split(buffers), self._split(changed)
        if self.target is not None:
            self.target.load_released(tb, tc, index)
        self.drafter.load_released(db, dc, index)

    def end(self) -> None:
        try:
            if self.target is not None:
                self.target.end()
        finally:
            self.drafter.end()
            if self.target is not None:
                for k, v in self.drafter.seconds.items():
                    self.seconds[k] = self.seconds.get(k, 0.0) + v

    def abort(self, error: BaseException) -> None:
        mixed: MixedWeightsError | None = None
        for update in self.updates[::-1]:
            try:
                update.abort(error)
            except MixedWeightsError as e:
                mixed = mixed or e
        if mixed is not None:
            raise mixed

    # -- the account (summed over both) ------------------------------------------

    def _sum(self, attr: str) -> Any:
        return sum(getattr(u, attr) for u in self.updates)

    @property
    def process_seconds(self) -> float:
        return self._sum("process_seconds")

    @property
    def n_processed(self) -> int:
        return self._sum("n_processed")

    @property
    def n_direct(self) -> int:
        return self._sum("n_direct")

    @property
    def n_released(self) -> int:
        return self._sum("n_released")

    @property
    def n_loaded(self) -> int:
        return self._sum("n_loaded")
