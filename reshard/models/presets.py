"""Model presets for planning: ``config.json`` files shipped in
``reshard/models/configs``; ``--model`` also takes a path to any ``config.json``.
Their canonical tensors come from :func:`reshard.models.canonical.canonical_tensors`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from reshard.models.canonical import canonical_tensors
from reshard.plan.layout import TensorMeta

__all__ = ["PRESETS", "ModelSpec", "load_model"]

PRESETS: dict[str, str] = {
    "llama3-8b": "llama3-8b.json",
    "llama3-70b": "llama3-70b.json",
    "qwen3-30b-a3b": "qwen3-30b-a3b.json",
    "qwen3-235b": "qwen3-235b-a22b.json",
    "qwen3-235b-a22b": "qwen3-235b-a22b.json",
    "deepseek-v3": "deepseek-v3.json",
    # Kimi-K2 (moonshotai/Kimi-K2-Instruct): DeepSeek-V3's architecture at
    # 384 experts and 64 heads. Its checkpoint says model_type "kimi_k2" and
    # ships its own code; transformers builds the same model as deepseek_v3.
    "kimi-k2": "kimi-k2.json",
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
        text = resources.files("reshard.models.configs").joinpath(PRESETS[name_or_path]).read_text()
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
