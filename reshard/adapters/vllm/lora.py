"""Adapter-only refits into vLLM's LoRA slots (``enable_lora=True``).

A trainer publishes an adapter's factors (``Sender(LoraAdapter(model))``,
:mod:`reshard.sender.lora_adapter`); each worker of an engine serving the
base model pulls exactly the slices of every ``A`` and ``B`` its LoRA layers
keep, learned from vLLM's own slicing (each layer's ``slice_lora_a`` /
``slice_lora_b`` run on index tensors: column-parallel layers cut ``B`` on
its output dim, row-parallel ones ``A`` on its input dim, q/k/v and
gate/up packed), so no worker holds a full copy and no file is written.

Each refit of adapter ``name`` is a new *version*, received while the
engine keeps generating (:meth:`AdapterReceiver.stage`: a thread of the
worker receives into the adapter's buffers and builds vLLM's ``LoRAModel``
from a copy of them, ``B`` scaled as vLLM scales it at load, in vLLM's LoRA
dtype), then kept (:meth:`AdapterReceiver.staged`, once it is done) in the
worker's store under the path ``reshard://<name>/<refit>``; vLLM's own
loader serves those paths from the store, so vLLM registers, evicts and
re-loads the version as it would a directory, and a base-weight refit
(which resets vLLM's LoRA state) loses nothing. How long a version stays in
the store, and how many may, is :mod:`reshard.adapters.vllm.lora_versions`'s.

The swap is atomic per request: a version gets its own name
(``<name>@<refit>``), id and path; a driver hands requests the new
``LoRARequest`` once every worker holds the version, requests in flight keep
the one they started with, and vLLM's prefix cache, keyed by LoRA name and
path, never serves KV computed with another version. A failed refit keeps
nothing: the old version keeps serving.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reshard.adapters.vllm.lora_versions import WorkerAdapters, lora_path, presliced, version_name
from reshard.errors import ReshardError
from reshard.plan.box import Box
from reshard.plan.layout import TensorMeta
from reshard.plan.specs import PieceSpec
from reshard.receiver import Receiver, Tensors
from reshard.sender.lora_adapter import AdapterSpec
from reshard.transport.group import GroupConfig
from reshard.transport.session import DEFAULT_BUDGET_BYTES
from reshard.transport.stats import EngineStats

if TYPE_CHECKING:
    import torch

__all__ = ["AdapterReceiver"]


# -- one adapter on one worker -----------------------------------------------------------


@dataclass(slots=True)
class _Job:
    """One refit of an adapter being received, in a thread of its own."""

    refit: int
    lora_id: int
    thread: threading.Thread | None = None
    stats: Any = None
    model: Any = None
    error: BaseException | None = None
    seconds: float = 0.0


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
        """Bytes of one version on this worker (its slices of every factor)."""
        self._pinned = torch.device(device).type == "cuda"
        self._job: _Job | None = None
        self._kept: tuple[int, dict[str, Any]] | None = None
        """The last refit kept, and its stats (a driver may ask again)."""

    def stage(self, refit: int, lora_id: int, *, method: str = "reshard", max_versions: int) -> dict[str, Any]:
        """Start receiving refit ``refit`` of the adapter, in a thread of this
        worker, as version ``refit`` with vLLM id ``lora_id``, and return at
        once: the engine keeps generating meanwhile (nothing it serves is
        written). If this worker already holds ``max_versions`` versions
        (:meth:`WorkerAdapters.room`), the refit is refused on every rank
        before any byte moves. :meth:`staged` says when it is done."""
        self._wait()
        refuse = self.owner.room(self.name, max_versions, refit)
        job = _Job(refit, lora_id)

        def run() -> None:
            t0 = time.perf_counter()
            try:
                job.stats = self.receiver.pull(refit, method=method, into=Tensors(self.buffers, refuse=refuse or ""))
                job.model = self._build(lora_id)
            except BaseException as e:  # reported by staged
                job.error = e
            job.seconds = time.perf_counter() - t0

        job.thread = threading.Thread(target=run, name=f"reshard-lora-{self.name}-{refit}", daemon=True)
        self._job = job
        job.thread.start()
        return {"staging": refit, "refused": refuse is not None}

    def staged(self, refit: int) -> dict[str, Any]:
        """``{"staged": False}`` while refit ``refit`` is being received; once
        it is received and built, keeps it as a version vLLM loads from
        ``reshard://<name>/<refit>`` (the engine serves nothing new until a
        driver hands out its ``LoRARequest``) and returns its stats with
        ``"staged": True``. Raises the refit's error if it failed (nothing
        is kept)."""
        if self._kept is not None and self._kept[0] == refit:
            return self._kept[1]
        job = self._job
        if job is None or job.refit != refit:
            raise ReshardError(
                f"engine rank {self.rank}: adapter {self.name!r} refit {refit} was never staged"
                + (f" (refit {job.refit} was)" if job is not None else "")
            )
        if job.thread is not None and job.thread.is_alive():
            return {"staged": False}
        self._job = None
        if job.error is not None:
            raise job.error
        assert job.stats is not None
        path = lora_path(self.name, refit)
        self.owner.add(path, job.model)
        stats = EngineStats.of_refit(
            job.stats,
            staged=True,
            adapter=self.name,
            lora_path=path,
            lora_name=version_name(self.name, refit),
            lora_int_id=job.lora_id,
            kept_bytes=self.kept_bytes,
            stage_seconds=job.seconds,
            refit_seconds=job.seconds,
            **self.owner.report(self.name),
        ).to_builtins()
        self._kept = (refit, stats)
        return stats

    def _wait(self) -> None:
        """Let a staging thread still running (a failed refit winding down on
        this rank) finish before the next refit starts; a refit received that
        no driver asked about is never kept."""
        job = self._job
        if job is not None and job.thread is not None and job.thread.is_alive():
            job.thread.join(timeout=self.receiver.config.timeout_s)
            if job.thread.is_alive():
                raise ReshardError(
                    f"engine rank {self.rank}: adapter {self.name!r} refit {job.refit} is still being received"
                )
        self._job = None

    def _build(self, lora_id: int) -> Any:
        """vLLM's ``LoRAModel`` of what the buffers hold, ``B`` scaled as vLLM's
        loader scales it (in its LoRA dtype, in place). Copies: the next refit
        writes the buffers while this version may still serve. They are kept
        where vLLM's own loader keeps an adapter it loaded (host memory,
        pinned when the worker runs on a GPU; its slots are filled from there)."""
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
                b = self._copy(self.buffers[sl.b])
                b *= sl.scaling
                a_list.append(self._copy(self.buffers[sl.a]))
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
        return presliced()(lora_id, rank, loras)

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        import torch

        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pinned)
        out.copy_(t)
        return out

    def close(self) -> None:
        job, self._job = self._job, None
        self.receiver.close()
        if job is not None and job.thread is not None:
            job.thread.join(timeout=5)


def _slice(m: Any, packed: bool, a: list, b: list) -> tuple[list, list]:
    """What vLLM's layer ``m`` keeps of each slice's ``A`` and ``B`` (its own
    ``slice_lora_a`` / ``slice_lora_b``, which it runs only with TP > 1)."""
    if getattr(m, "tp_size", 1) <= 1:
        return a, b
    if packed:
        return list(m.slice_lora_a(list(a))), list(m.slice_lora_b(list(b)))
    return [m.slice_lora_a(a[0])], [m.slice_lora_b(b[0])]
