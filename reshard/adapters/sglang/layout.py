"""Learn where SGLang puts every checkpoint box, from SGLang's own loaders.

A dry run, once per TP worker: the model's own ``load_weights`` is called
with meta tensors standing in for the checkpoint tensors, under a dispatch
mode that records every ``copy_`` into a parameter (and every ``fill_`` /
``zero_``, which is how vocabulary padding is cleared) with the storage
offset, sizes and strides of both sides, and does not perform it. SGLang's
parameters stay live and untouched; nothing is allocated.

A ``copy_`` from a view of checkpoint tensor ``T`` into a view of parameter
``P`` becomes a piece: box ``B`` of ``T`` lands in ``P`` at offset ``O``,
dims mapped. Whatever SGLang's loaders do (the stacked-params mapping to
``qkv_proj`` / ``gate_up_proj``, GQA key/value replication, the padded and
split vocabulary, routing a tied embedding) is what we learn; there is no
per-model table. Loaders that compute on the checkpoint tensor (arithmetic,
dtype casts, ``contiguous()`` copies) break the chain from a checkpoint
storage to the parameter: those are reported, and the receiver refuses to
plan with an incomplete layout rather than serve stale weights.

The recording is the adapters' shared core
(:mod:`reshard.adapters.core.recording`); only the lifecycle differs: SGLang
keeps live parameters during an update (so any write into one that is not a
copy of a checkpoint box is refused), vLLM swaps in meta ones.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from reshard.adapters.core.recording import LearnedLayout, record_loads
from reshard.plan.layout import TensorMeta

if TYPE_CHECKING:
    import torch

__all__ = ["canonical_tensors_of", "learn_layout", "model_dtype"]


def model_dtype(model: torch.nn.Module) -> str:
    """The floating dtype most of the model's parameters have (``float32``, ``bfloat16``)."""
    counts: dict[str, int] = defaultdict(int)
    for p in model.parameters():
        if p.is_floating_point():
            counts[str(p.dtype).removeprefix("torch.")] += p.numel()
    if not counts:
        raise ValueError("the model has no floating-point parameters")
    return max(counts, key=lambda k: counts[k])


def canonical_tensors_of(model: torch.nn.Module) -> list[TensorMeta]:
    """Checkpoint names, shapes and dtypes of the model an SGLang worker serves.

    SGLang model classes keep the Hugging Face config as ``model.config``; the
    dtype is the one the engine computes in (trainer and engine must agree)."""
    from reshard.models import canonical_tensors

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(f"{type(model).__name__} has no Hugging Face config at .config")
    return canonical_tensors(_checkpoint_config(config.to_dict()), dtype=model_dtype(model))


def _checkpoint_config(cfg: dict) -> dict:
    """The checkpoint's config from the one SGLang's model holds: SGLang's
    DeepSeek models rename the RoPE type ``yarn`` to ``deepseek_yarn`` in
    place, which transformers does not know."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key)
        if isinstance(rope, dict):
            renamed = {k: "yarn" for k in ("rope_type", "type") if rope.get(k) == "deepseek_yarn"}
            cfg[key] = {**rope, **renamed}
    return cfg


def learn_layout(model: torch.nn.Module, tensors: Iterable[TensorMeta]) -> LearnedLayout:
    """Dry-run ``model.load_weights`` on meta tensors and record where each
    checkpoint box lands (see the module docstring). The model's weights are
    not written."""
    params: dict[int, tuple[str, torch.Tensor]] = {}
    layers: dict[str, list[str]] = defaultdict(list)
    derived: list[torch.Tensor] = []
    for mod_name, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()) + list(mod._buffers.items()):
            if p is None or p.is_meta:
                continue
            if pname in mod._non_persistent_buffers_set:
                # Not in any checkpoint: state the engine derives from its
                # parameters (refreshed after a refit, see the receiver).
                derived.append(p)
                continue
            key = p.untyped_storage()._cdata
            if key not in params:
                full = f"{mod_name}.{pname}" if mod_name else pname
                params[key] = (full, p)
                layers[mod_name].append(full)
    return record_loads(params, layers, tensors, model.load_weights, strict=True, derived=derived)  # type: ignore[arg-type]
