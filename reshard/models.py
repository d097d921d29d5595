"""Model presets for planning: canonical tensors from a Hugging Face config.

Shapes and names come from transformers itself, building the model on the
meta device (no weights), and its checkpoint conversion mapping backwards
(see :mod:`reshard.names`). Presets are ``config.json`` files shipped in
``reshard/presets``; ``--model`` also takes a path to any ``config.json``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from reshard.names import CheckpointNames
from reshard.plan.layout import TensorMeta
from reshard.plan.planner import natural_key

__all__ = ["PRESETS", "ModelSpec", "canonical_tensors", "load_model"]

PRESETS: dict[str, str] = {
    "llama3-8b": "llama3-8b.json",
    "llama3-70b": "llama3-70b.json",
    "qwen3-30b-a3b": "qwen3-30b-a3b.json",
    "qwen3-235b": "qwen3-235b-a22b.json",
    "qwen3-235b-a22b": "qwen3-235b-a22b.json",
    "deepseek-v3": "deepseek-v3.json",
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model for planning: its config and canonical (checkpoint) tensors."""

    name: str
    config: dict[str, Any]
    tensors: tuple[TensorMeta, ...] = field(repr=False)

    @property
    def params(self) -> int:
        total = 0
        for t in self.tensors:
            n = 1
            for s in t.shape:
                n *= s
            total += n
        return total

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _read_config(name_or_path: str) -> tuple[str, dict[str, Any]]:
    if name_or_path in PRESETS:
        text = resources.files("reshard.presets").joinpath(PRESETS[name_or_path]).read_text()
        return name_or_path, json.loads(text)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {name_or_path!r}: not a preset ({', '.join(sorted(PRESETS))}) nor a config.json")
    return path.parent.name or str(path), json.loads(path.read_text())


@lru_cache(maxsize=8)
def load_model(name_or_path: str, dtype: str | None = None) -> ModelSpec:
    """Canonical tensors of a preset or a ``config.json`` (file or directory)."""
    name, config = _read_config(name_or_path)
    return ModelSpec(name=name, config=config, tensors=tuple(canonical_tensors(config, dtype=dtype)))


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
