"""Canonical tensors of a model: checkpoint names, shapes and dtypes from a
Hugging Face config.

Shapes and names come from transformers itself, building the model on the
meta device (no weights), and its checkpoint conversion mapping backwards
(see :mod:`reshard.models.names`).
"""

from __future__ import annotations

import re
from typing import Any

from reshard.models.names import CheckpointNames
from reshard.plan.index import natural_key
from reshard.plan.layout import TensorMeta

__all__ = ["canonical_tensors"]


def canonical_tensors(config: dict[str, Any], *, dtype: str | None = None) -> list[TensorMeta]:
    """Checkpoint names, shapes and dtypes of the model a config describes.

    Parameters take ``dtype`` (default: the config's ``torch_dtype``, else
    bfloat16), except those transformers keeps in float32 when it loads a
    checkpoint at that dtype (``_keep_in_fp32_modules_strict``, and
    ``_keep_in_fp32_modules`` for float16: DeepSeek-V3's
    ``e_score_correction_bias``), so the table says what a trainer that
    loaded the model with ``from_pretrained(dtype=...)`` holds. Persistent
    buffers keep their own dtype. Tied parameters appear once, under the
    name transformers lists first.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    model_type = cfg.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **cfg)
    dt = dtype or config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    torch_dtype = getattr(torch, dt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch_dtype)
    names = CheckpointNames(model_type)
    out: list[TensorMeta] = []
    state = model.state_dict(keep_vars=True)
    params = dict(model.named_parameters())
    persistent = [n for n, _ in model.named_buffers() if n in state]
    keep_fp32 = _keep_in_fp32(model, torch_dtype)
    for n in list(params) + persistent:
        t = params.get(n)
        if t is None:
            t = state[n]
        tdt = str(t.dtype).removeprefix("torch.")
        if keep_fp32 is not None and t.is_floating_point() and keep_fp32.search(n):
            tdt = "float32"
        for piece in names.split(n, tuple(t.shape)):
            out.append(TensorMeta(piece.name, piece.shape, tdt))
    out.sort(key=lambda m: natural_key(m.name))
    return out


def _keep_in_fp32(model, dtype) -> re.Pattern | None:
    """The parameter names transformers loads in float32 at ``dtype`` (its
    ``dtype_plan``), as one pattern; ``None`` when there are none."""
    plan = getattr(model, "_get_dtype_plan", None)
    patterns = list(plan(dtype)) if callable(plan) else []
    if not patterns:
        return None
    return re.compile("|".join(p.replace(".", r"\.").replace("*", ".*") for p in patterns))
