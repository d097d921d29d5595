"""Adapter-only refits into vLLM's LoRA slots (``enable_lora=True``).

A trainer publishes an adapter's factors (``Sender(LoraAdapter(model))``,
:mod:`reshard.sender.lora_adapter`); each worker of an engine serving the
base model pulls exactly the slices of every ``A`` and ``B`` its LoRA layers
keep, learned from vLLM's own slicing (each layer's ``slice_lora_a`` /
``slice_lora_b`` run on index tensors: column-parallel layers cut ``B`` on
its output dim, row-parallel ones ``A`` on its input dim, q/k/v and
gate/up packed), so no worker holds a full copy and no file is written.

Each refit of adapter ``name`` is a new *version*: the worker builds vLLM's
``LoRAModel`` from its slices (``B`` scaled as vLLM scales it at load, in
vLLM's LoRA dtype), and keeps it in a per-worker store under the path
``reshard://<name>/<refit>``; vLLM's own loader serves those paths from the
store (an instance patch of the worker's ``_load_adapter``), so vLLM
registers, evicts and re-loads the version as it would a directory, and a
base-weight refit (which resets vLLM's LoRA state) loses nothing.

The swap is atomic per request: a version gets its own name
(``<name>@<refit>``), id and path; a driver hands requests the new
``LoRARequest`` once every worker holds the version, requests in flight keep
the one they started with, and vLLM's prefix cache, keyed by LoRA name and
path, never serves KV computed with another version. (vLLM 0.32 batches
requests by LoRA name: two ids under one name in a batch would kill the
engine, hence one name per version.) A failed refit registers nothing: the
old version keeps serving. Old versions leave the store when the driver
retires them (:class:`reshard.adapters.vllm.adapters.VllmAdapters`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reshard.errors import ReshardError
from reshard.plan.box import Box
from reshard.plan.layout import TensorMeta
from reshard.plan.specs import PieceSpec
from reshard.receiver import Receiver
from reshard.sender.lora_adapter import AdapterSpec
from reshard.transport.group import GroupConfig
from reshard.transport.session import DEFAULT_BUDGET_BYTES
from reshard.transport.stats import EngineStats

if TYPE_CHECKING:
    import torch

__all__ = ["SCHEME", "AdapterReceiver", "WorkerAdapters", "lora_path", "version_name"]

SCHEME = "reshard://"


def lora_path(name: str, version: int) -> str:
    """The path vLLM knows version ``version`` of adapter ``name`` by."""
    return f"{SCHEME}{name}/{version}"


def version_name(name: str, version: int) -> str:
    """The LoRA name of a version (one per version: see the module docstring)."""
    return f"{name}@{version}"


# -- the worker's store ---------------------------------------------------------------


class WorkerAdapters:
    """One vLLM worker's adapters refit by reshard: the store of versions its
    LoRA manager loads ``reshard://`` paths from, and a receiver per adapter."""

    def __init__(self, runner: Any) -> None:
        wm = getattr(runner, "lora_manager", None)
        if wm is None or not hasattr(wm, "_adapter_manager"):
            raise ReshardError("this vLLM engine runs without LoRA: start it with enable_lora=True (--enable-lora)")
        self.wm = wm
        self.mgr = wm._adapter_manager
        self.store: dict[str, Any] = {}
        self.receivers: dict[str, AdapterReceiver] = {}
        self.loads = 0
        """Versions vLLM loaded from the store (a version evicted and used again loads again)."""
        self._install()

    def _install(self) -> None:
        """Patch this worker's LoRA manager (its instance only, once)."""
        if getattr(self.wm, "_reshard_adapters", None) is not None:
            self.wm._reshard_adapters = self
            return
        wm, mgr = self.wm, self.mgr
        original_load = wm._load_adapter
        original_activate = mgr.activate_adapter

        def load_adapter(request: Any) -> Any:
            path = str(getattr(request, "lora_path", "") or "")
            if not path.startswith(SCHEME):
                return original_load(request)
            owner = wm._reshard_adapters
            model = owner.store.get(path)
            if model is None:
                from vllm.exceptions import LoRAAdapterNotFoundError

                raise LoRAAdapterNotFoundError(request.lora_name, path)
            owner.loads += 1
            return model if model.id == request.lora_int_id else model.clone(request.lora_int_id)

        def activate_adapter(lora_id: int) -> bool:
            model = mgr._registered_adapters.cache.get(lora_id)
            if not isinstance(model, _presliced()):
                return original_activate(lora_id)
            # Its tensors are this worker's slices already: set_lora must not cut them again.
            for m in mgr.modules.values():
                m.slice_lora_a = _same
                m.slice_lora_b = _same
            try:
                return original_activate(lora_id)
            finally:
                for m in mgr.modules.values():
                    del m.slice_lora_a
                    del m.slice_lora_b

        wm._load_adapter = load_adapter
        mgr.activate_adapter = activate_adapter
        wm._reshard_adapters = self

    def drop(self, paths: list[str]) -> list[str]:
        """Forget versions (their paths); vLLM keeps those it holds until it evicts them."""
        return [p for p in paths if self.store.pop(p, None) is not None]

    def close(self) -> None:
        for r in self.receivers.values():
            r.close()
        self.receivers.clear()


def _same(x: Any) -> Any:
    return x


_PRESLICED: list[type] = []


def _presliced() -> type:
    """vLLM's ``LoRAModel``, marked as holding one worker's slices."""
    if not _PRESLICED:
        from vllm.lora.lora_model import LoRAModel

        class PreslicedLoRAModel(LoRAModel):
            """A LoRA model whose tensors are already this worker's slices."""

        _PRESLICED.append(PreslicedLoRAModel)
    return _PRESLICED[0]


# -- one adapter on one worker -----------------------------------------------------------


@dataclass(slots=True)
class _Slice:
    """One LoRA slice of one vLLM module: the PEFT module it comes from, and
    the local buffers its ``A`` and ``B`` slices are received into."""

    module: str
    """The vLLM module (``model.layers.0.self_attn.qkv_proj``)."""
    index: int
    """Its slice (q, k, v of a packed qkv module: 0, 1, 2)."""
    peft: str
    """The PEFT module (``model.layers.0.self_attn.q_proj``)."""
    rank: int
    alpha: int
    scaling: float
    a: str = ""
    b: str = ""


@dataclass(slots=True)
class _Module:
    name: str
    packed: bool
    slices: list[_Slice | None] = field(default_factory=list)


def _pieces_of(probe_out: torch.Tensor, meta: TensorMeta, local: str) -> list[PieceSpec]:
    """The boxes of ``meta`` that ``probe_out`` (a layer's slice of an index
    tensor of ``meta``'s shape: element ``(i, j)`` holds ``i * cols + j``)
    holds, and where: one piece per run of rows taken from consecutive rows."""
    cols = meta.shape[1]
    out = probe_out.tolist()
    pieces: list[PieceSpec] = []
    start = 0
    shape = tuple(probe_out.shape)
    while start < len(out):
        first = out[start]
        src, c0 = divmod(first[0], cols)
        width = len(first)
        n = 0
        while start + n < len(out):
            row = out[start + n]
            if row != list(range((src + n) * cols + c0, (src + n) * cols + c0 + width)):
                break
            n += 1
        if n == 0:
            raise ReshardError(f"vLLM's LoRA slicing of {meta.name!r} is no set of row ranges (row {start})")
        pieces.append(PieceSpec(meta, Box((src, c0), (n, width)), local, shape, (start, 0)))
        start += n
    return pieces


class AdapterReceiver:
    """Adapter ``name`` on one worker: its slices learned from vLLM's LoRA
    layers, received into buffers of vLLM's LoRA dtype, built into vLLM
    ``LoRAModel`` versions (see the module docstring)."""

    def __init__(
        self,
        owner: WorkerAdapters,
        name: str,
        spec: AdapterSpec,
        *,
        tensors: list[TensorMeta],
        config: GroupConfig,
        rank: int,
        device: Any = "cpu",
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> None:
        import torch
        from vllm.lora.peft_helper import PEFTHelper

        self.owner, self.name, self.spec, self.rank = owner, name, spec, rank
        wm, mgr = owner.wm, owner.mgr
        cfg = dict(spec.config_dict(), vllm_max_position_embeddings=getattr(wm, "max_position_embeddings", None))
        self.helper = helper = PEFTHelper.from_dict(cfg)
        helper.validate_legal(wm.lora_config)
        self.dtype = wm.lora_config.lora_dtype
        if not isinstance(self.dtype, torch.dtype):
            self.dtype = getattr(torch, str(self.dtype).removeprefix("torch."))
        adapted = set(spec.modules)
        shapes = {t.name: t.shape for t in tensors}
        pieces: list[PieceSpec] = []
        self.buffers: dict[str, torch.Tensor] = {}
        self.modules: list[_Module] = []
        seen: set[str] = set()
        for mname, m in mgr.modules.items():
            subs = mgr.packed_modules.get(mname)
            packed = subs is not None
            subs = subs if packed else [mname]
            if not adapted & set(subs):
                continue
            mod = _Module(mname, packed)
            probes_a: list[torch.Tensor | None] = []
            probes_b: list[torch.Tensor | None] = []
            metas: list[tuple[TensorMeta, TensorMeta] | None] = []
            for i, sub in enumerate(subs):
                if sub not in adapted:
                    mod.slices.append(None)
                    probes_a.append(None)
                    probes_b.append(None)
                    metas.append(None)
                    continue
                seen.add(sub)
                shape = shapes.get(f"{sub}.weight")
                if shape is None or len(shape) != 2:
                    raise ReshardError(
                        f"engine rank {rank}: adapter {name!r} adapts {sub!r}, whose weight this engine's checkpoint "
                        "table does not have as a matrix"
                    )
                r, scaling = helper.get_rank_and_scaling(sub)
                out_f, in_f = shape
                a = TensorMeta(
                    f"base_model.model.{sub}.lora_A.weight", (r, in_f), str(self.dtype).removeprefix("torch.")
                )
                b = TensorMeta(f"base_model.model.{sub}.lora_B.weight", (out_f, r), a.dtype)
                metas.append((a, b))
                probes_a.append(torch.arange(r * in_f, dtype=torch.int64).view(r, in_f))  # host: a probe
                probes_b.append(torch.arange(out_f * r, dtype=torch.int64).view(out_f, r))  # host: a probe
                mod.slices.append(_Slice(mname, i, sub, r, int(helper.lora_alpha), scaling))
            sliced_a, sliced_b = _slice(m, packed, probes_a, probes_b)
            for i, sl in enumerate(mod.slices):
                if sl is None:
                    continue
                meta_ab = metas[i]
                assert meta_ab is not None
                for which, meta, got in (("a", meta_ab[0], sliced_a[i]), ("b", meta_ab[1], sliced_b[i])):
                    local = f"{mname}#{i}.{which}"
                    setattr(sl, which, local)
                    # On the worker's device: the executor receives into them in place.
                    self.buffers[local] = torch.zeros(tuple(got.shape), dtype=self.dtype, device=device)
                    pieces += _pieces_of(got, meta, local)
            self.modules.append(mod)
        missing = sorted(adapted - seen)
        if missing:
            raise ReshardError(
                f"engine rank {rank}: adapter {name!r} adapts {missing[:3]}, which this engine does not serve with "
                "LoRA (vLLM's LoRA layers cover linear layers; check target_modules)"
            )
        self.receiver = Receiver(
            self.buffers, pieces, config=config, rank=rank, device=device, budget_bytes=budget_bytes
        )
        self.kept_bytes = sum(t.nbytes for t in self.buffers.values())

    def pull(self, refit: int, lora_id: int, *, method: str = "reshard") -> dict[str, Any]:
        """Receive refit ``refit`` of the adapter and keep it as version
        ``refit`` with vLLM id ``lora_id``; the engine serves nothing new
        until a driver hands out the version's ``LoRARequest``."""
        t0 = time.perf_counter()
        stats = self.receiver.pull(refit, method=method)
        model = self._build(lora_id)
        path = lora_path(self.name, refit)
        self.owner.store[path] = model
        return EngineStats.of_refit(
            stats,
            adapter=self.name,
            lora_path=path,
            lora_name=version_name(self.name, refit),
            lora_int_id=lora_id,
            kept_bytes=self.kept_bytes,
            refit_seconds=time.perf_counter() - t0,
        ).to_builtins()

    def _build(self, lora_id: int) -> Any:
        """vLLM's ``LoRAModel`` of what the buffers hold (copies: the next refit
        writes the buffers while this version may still serve), ``B`` scaled as
        vLLM's loader scales it (in its LoRA dtype, in place)."""
        from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights

        loras: dict[str, Any] = {}
        rank = 0
        for mod in self.modules:
            a_list: list[torch.Tensor | None] = []
            b_list: list[torch.Tensor | None] = []
            alphas: list[int | None] = []
            for sl in mod.slices:
                if sl is None:
                    a_list.append(None)
                    b_list.append(None)
                    alphas.append(None)
                    continue
                b = self.buffers[sl.b].clone()
                b *= sl.scaling
                a_list.append(self.buffers[sl.a].clone())
                b_list.append(b)
                alphas.append(sl.alpha)
                rank = max(rank, sl.rank)
            first = next(sl for sl in mod.slices if sl is not None)
            if mod.packed:
                # (None marks a slice the adapter leaves alone, as vLLM's own pack does.)
                scaling = [1 if a is not None else None for a in a_list]
                loras[mod.name] = PackedLoRALayerWeights(
                    mod.name,
                    first.rank,
                    alphas,
                    a_list,
                    b_list,
                    scaling=scaling,  # type: ignore[arg-type]
                )
            else:
                a0, b0 = a_list[0], b_list[0]
                assert a0 is not None and b0 is not None  # a module of one slice is adapted or skipped
                loras[mod.name] = LoRALayerWeights(mod.name, first.rank, first.alpha, a0, b0, scaling=1.0)
        return _presliced()(lora_id, rank, loras)

    def close(self) -> None:
        self.receiver.close()


def _slice(m: Any, packed: bool, a: list, b: list) -> tuple[list, list]:
    """What vLLM's layer ``m`` keeps of each slice's ``A`` and ``B`` (its own
    ``slice_lora_a`` / ``slice_lora_b``, which it runs only with TP > 1)."""
    if getattr(m, "tp_size", 1) <= 1:
        return a, b
    if packed:
        return list(m.slice_lora_a(list(a))), list(m.slice_lora_b(list(b)))
    return [m.slice_lora_a(a[0])], [m.slice_lora_b(b[0])]
