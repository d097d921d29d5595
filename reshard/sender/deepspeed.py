"""DeepSpeed trainers: ZeRO-1/2/3 (with ``zero.Init``, persisted parameters,
offloaded partitions, AutoEP expert groups) read where DeepSpeed keeps them.

- ``DeepSpeedEngine``: the model is ``engine.module``.
- ZeRO-1/2 keep whole parameters on every rank (their optimizer state is
  what they partition): replicas, read as plain tensors.
- ZeRO-3 keeps, for each parameter, ``ds_tensor``: the rank's part of the
  row-major flattened parameter. Rank ``r`` of ``ds_process_group`` (of
  ``W`` ranks) holds ``[r*P, min((r+1)*P, ds_numel))`` with
  ``P = ceil(ds_numel / W)`` (the last part is padded, trailing ones may be
  all padding). Between steps ``param.data`` is empty; inside
  ``GatheredParameters`` and for persisted small parameters it is whole,
  but ``ds_tensor`` is the partition the optimizer writes, so reshard
  always reads ``ds_tensor`` (each rank sends its own part, nothing is
  gathered). DeepSpeed rebinds ``ds_tensor.data`` after steps: the views
  are re-read at every push.
- AutoEP (``expert_parallel`` in the config) replaces each MoE block by an
  ``AutoEPMoELayer`` whose ``experts.w1``/``w3``/``w2`` stack this
  expert-parallel rank's experts (gate, up, down) and whose ``router.gate``
  is the router. They are mapped back to the transformers parameters they
  were built from (``experts.gate_up_proj`` ``[E, 2F, H]``,
  ``experts.down_proj`` ``[E, H, F]``, ``gate``), which the checkpoint
  names split as usual. Under ZeRO-3 the expert stacks are partitioned over
  the expert-data-parallel group, which ``ds_process_group`` names.

DeepSpeed attributes read (pinned by ``tests/test_trainers.py``):
``ds_shape``, ``ds_numel``, ``ds_tensor`` (``status``, ``ds_quant_scale``),
``ds_process_group``; ``AutoEPMoELayer.model_family``, ``ep_rank``,
``num_local_experts``, ``expert_placement_descriptor``,
``folding_group_handles``, and the AutoEP presets' names.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from reshard.plan.box import Box, chunk_block, chunk_range
from reshard.sender.held import Held, flat_held
from reshard.sender.readers import ReadContext, TrainerReader

if TYPE_CHECKING:
    import torch

__all__ = [
    "READER",
    "autoep_config",
    "autoep_held",
    "autoep_layers",
    "deepspeed_engine_module",
    "is_zero3_param",
    "zero3_held",
]


def _loaded() -> bool:
    # DeepSpeed objects exist only once deepspeed is imported; never import it here.
    return "deepspeed" in sys.modules


def deepspeed_engine_module(obj: Any) -> Any | None:
    """``engine.module`` of a ``DeepSpeedEngine``, else ``None``. Engines
    that reshard does not read (pipeline parallel) raise."""
    if not _loaded():
        return None
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if not isinstance(obj, DeepSpeedEngine):
        return None
    if isinstance(obj, PipelineEngine):
        raise TypeError(
            f"{type(obj).__name__}: DeepSpeed pipeline parallelism is not read by reshard yet; "
            "describe each stage's tensors with Sender.from_pieces"
        )
    return obj.module


def is_zero3_param(t: Any) -> bool:
    """A parameter partitioned by ZeRO-3 (``zero.Init`` or stage 3)."""
    return hasattr(t, "ds_tensor") and hasattr(t, "ds_shape") and hasattr(t, "ds_numel")


def _partition(name: str, p: torch.Tensor, where: str, rank: int) -> tuple[torch.Tensor, int, int]:
    """(this rank's part of the flattened parameter, without padding; start; stop)."""
    import torch.distributed as dist

    def fail(why: str) -> ValueError:
        return ValueError(f"rank {rank}: ZeRO-3 parameter {name!r} of {where} (shape {list(p.ds_shape)}): {why}")  # type: ignore[attr-defined]

    part = p.ds_tensor  # type: ignore[attr-defined]
    if part is None:
        raise fail("it has no partition (ds_tensor is None); it was never partitioned")
    if getattr(part, "ds_quant_scale", None) is not None:
        raise fail("its partition is quantized (zero_quantized_weights); reshard sends unquantized weights only")
    status = getattr(part, "status", None)
    if status is not None and getattr(status, "name", "AVAILABLE") != "AVAILABLE":
        raise fail(
            f"its partition is {status.name} (swapped out to NVMe); reshard reads partitions in memory "
            "(CPU offload is read where it is, NVMe offload is not supported yet)"
        )
    group = p.ds_process_group  # type: ignore[attr-defined]
    world = dist.get_world_size(group)
    r = dist.get_rank(group)
    numel = int(p.ds_numel)  # type: ignore[attr-defined]
    if part.dim() != 1 or part.numel() != chunk_block(numel, world):
        raise fail(
            f"its partition has shape {list(part.shape)}, not the {chunk_block(numel, world)} elements "
            f"of one of {world} parts"
        )
    start, stop = chunk_range(numel, world, r)
    return part.detach().view(-1).narrow(0, 0, stop - start), start, stop


def zero3_held(name: str, p: torch.Tensor, *, where: str, rank: int) -> list[Held]:
    """The boxes of ZeRO-3 parameter ``p`` this rank holds: views of its partition."""
    flat, start, stop = _partition(name, p, where, rank)
    return flat_held(name, tuple(int(n) for n in p.ds_shape), flat, start, stop)  # type: ignore[attr-defined]


def _slab_held(name: str, shape: tuple[int, ...], p: torch.Tensor, slab: Box, *, where: str, rank: int) -> list[Held]:
    """Box ``slab`` of parameter ``name`` (``shape``) is ``p``: a ZeRO-3
    parameter (this rank holds part of it) or a whole tensor."""
    if is_zero3_param(p):
        local = tuple(int(n) for n in p.ds_shape)  # type: ignore[attr-defined]
        if local != slab.sizes:
            raise ValueError(f"rank {rank}: {name!r} of {where}: a part of shape {list(local)} for box {slab}")
        flat, start, stop = _partition(name, p, where, rank)
        return flat_held(name, shape, flat, start, stop, slab=slab)
    if tuple(p.shape) != slab.sizes:
        raise ValueError(f"rank {rank}: {name!r} of {where}: a tensor of shape {list(p.shape)} for box {slab}")
    return [Held(name, shape, slab, p.detach())]


def autoep_layers(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(path, layer)`` of every AutoEP MoE layer in ``module``."""
    if not _loaded():
        return []
    try:
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    except ImportError:  # pragma: no cover - a DeepSpeed without AutoEP
        return []
    return [(n, m) for n, m in module.named_modules() if isinstance(m, AutoEPMoELayer)]


_PLAIN_NAME = re.compile(r"^\w+(\.\w+)*$")


def autoep_config(source: Any) -> Any | None:
    """The AutoEP section of a ``DeepSpeedEngine``'s config (its name
    overrides say where the layers' tensors came from), else ``None``."""
    if deepspeed_engine_module(source) is None:
        return None
    return getattr(getattr(source, "_config", None), "expert_parallel_config", None)


def autoep_held(path: str, layer: Any, *, where: str, rank: int, config: Any = None) -> tuple[list[Held], set[int]]:
    """The boxes an AutoEP layer at ``path`` holds, in the names of the
    transformers tensors it replaced; and the ids of its tensors.
    ``config``: the engine's AutoEP config, whose name overrides apply to
    the preset as DeepSpeed applied them (``None``: the preset as registered)."""
    from deepspeed.module_inject.auto_ep_config import PRESET_MODELS

    here = f"{where}, AutoEP layer {path!r}"
    preset = PRESET_MODELS.get(getattr(layer, "model_family", None))
    if preset is None:
        raise ValueError(f"rank {rank}: {here}: unknown AutoEP model family {getattr(layer, 'model_family', None)!r}")
    if config is not None:
        from deepspeed.module_inject.auto_ep_presets.registry import apply_config_overrides

        preset = apply_config_overrides(config, preset)
    if getattr(layer, "folding_group_handles", None) is not None:
        raise ValueError(f"rank {rank}: {here}: expert tensor parallelism (AutoEP folding) is not read yet")
    names = {
        "router": preset.router_pattern,
        "experts": preset.experts_pattern,
        "shared_experts": preset.shared_experts_pattern,
        "shared_experts_gate": preset.shared_experts_gate_pattern,
    }
    for what, n in names.items():
        if n and not _PLAIN_NAME.match(n):
            raise ValueError(f"rank {rank}: {here}: the preset's {what} name {n!r} is a pattern reshard cannot map")
    # This rank's experts: a contiguous run (AutoEP's uniform placement).
    placement = getattr(layer, "expert_placement_descriptor", None) or {}
    mine = [e["experts"] for e in placement.get("ranks", ()) if e.get("rank") == layer.ep_rank]
    experts = list(mine[0]) if len(mine) == 1 else []
    local_n = int(layer.num_local_experts)
    total = int(layer.num_experts)
    if not experts or experts != list(range(experts[0], experts[0] + local_n)):
        raise ValueError(f"rank {rank}: {here}: expert placement {placement!r} is not a contiguous run per rank")
    e0 = experts[0]
    prefix = f"{path}." if path else ""
    out: list[Held] = []
    ids: set[int] = set()
    tensors = [*layer.named_parameters()]  # (each parameter once, aliases left out)
    for mname, mod in layer.named_modules():
        for bname, b in mod.named_buffers(recurse=False):
            if b is not None and bname not in mod._non_persistent_buffers_set:
                tensors.append((f"{mname}.{bname}" if mname else bname, b))
    for pname, p in tensors:
        ids.add(id(p))
        if pname == "expert_bias":  # AutoEP's own load-balancing state: no checkpoint has it
            continue
        local = tuple(int(n) for n in (p.ds_shape if is_zero3_param(p) else p.shape))  # type: ignore[attr-defined]
        if pname in ("experts.w1", "experts.w3", "experts.w2"):
            n_local, a, b = local
            if n_local != local_n:
                raise ValueError(f"rank {rank}: {here}: {pname} stacks {n_local} experts, expected {local_n}")
            if pname == "experts.w2":  # down_proj [E, H, F]
                name = f"{prefix}{names['experts']}.down_proj"
                shape, slab = (total, a, b), Box((e0, 0, 0), local)
            else:  # gate (w1) and up (w3) halves of gate_up_proj [E, 2F, H]
                name = f"{prefix}{names['experts']}.gate_up_proj"
                row = 0 if pname == "experts.w1" else a
                shape, slab = (total, 2 * a, b), Box((e0, row, 0), local)
            out += _slab_held(name, shape, p, slab, where=here, rank=rank)
            continue
        head, _, tail = pname.partition(".")
        if pname.startswith("router.gate."):
            name = f"{prefix}{names['router']}.{pname.removeprefix('router.gate.')}"
        elif pname == "router.e_score_correction_bias":  # copied from the router (DeepSeek-V3, MiniMax)
            name = f"{prefix}{names['router']}.e_score_correction_bias"
        elif head in ("shared_experts", "shared_experts_gate") and names[head]:
            name = f"{prefix}{names[head]}.{tail}"
        else:
            raise ValueError(
                f"rank {rank}: {here}: parameter {pname!r} of shape {list(local)} has no transformers name "
                "reshard knows (router.gate.*, router.e_score_correction_bias, experts.w1/w2/w3, shared_experts.*, "
                "shared_experts_gate.*)"
            )
        out += _slab_held(name, local, p, Box((0,) * len(local), local), where=here, rank=rank)
    return out, ids


# -- the reader ----------------------------------------------------------------


def _autoep_modules(model: torch.nn.Module, ctx: ReadContext) -> Iterator[tuple[list[Held], set[int]]]:
    config = autoep_config(ctx.source)
    for path, layer in autoep_layers(model):
        yield autoep_held(path, layer, where=ctx.where, rank=ctx.rank, config=config)


def _zero3_tensor(name: str, t: torch.Tensor, ctx: ReadContext) -> list[Held] | None:
    return zero3_held(name, t, where=ctx.where, rank=ctx.rank) if is_zero3_param(t) else None


def _refuse_moe(name: str, t: torch.Tensor, ctx: ReadContext) -> str | None:
    if getattr(t, "allreduce", True) is not False:
        return None
    return (
        f"rank {ctx.rank}: {name!r} of {ctx.where} (shape {list(getattr(t, 'ds_shape', t.shape))}) is a DeepSpeed "
        "MoE expert parameter (deepspeed.moe, allreduce=False): each expert-parallel rank holds other experts "
        "under the same name, which reshard does not read yet; use AutoEP (expert_parallel in the config) "
        "or describe the experts with Sender.from_pieces"
    )


def _refuse_autotp(model: torch.nn.Module, ctx: ReadContext) -> str | None:
    for path, mod in model.named_modules():
        cls = type(mod)
        if cls.__module__.startswith("deepspeed.module_inject.layers") and any(
            c.__name__ == "TensorParallel_Layer" for c in cls.__mro__
        ):
            return (
                f"rank {ctx.rank}: layer {path!r} ({cls.__name__}) of {ctx.where} is a DeepSpeed AutoTP "
                "tensor-parallel layer, which reshard does not read yet; describe its tensors with "
                "Sender.from_pieces"
            )
    return None


READER = TrainerReader(
    name="DeepSpeed ZeRO-1/2/3 (DeepSpeedEngine, zero.Init, AutoEP)",
    unwrap=deepspeed_engine_module,
    modules=_autoep_modules,
    tensor=_zero3_tensor,
    refuse=_refuse_moe,
    refuse_module=_refuse_autotp,
)
"""ZeRO-3 partitions and AutoEP layers as views of this rank's storage;
ZeRO-1/2 parameters are whole on every rank (replicas, read as plain
tensors)."""
