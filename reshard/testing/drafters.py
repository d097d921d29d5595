"""Tiny speculative-decoding drafters for tests, examples and benchmarks,
built from the tiny models of :mod:`reshard.testing.tiny` (no hub):

- :func:`build_draft_model`: a separate draft model (``method="draft_model"``),
  another tiny model of the target's vocabulary;
- :func:`build_eagle_head`: an EAGLE-1 head for a Llama target
  (``method="eagle"``): one decoder layer without its input norm and ``fc``,
  under the bare names EAGLE checkpoints use (``layers.0.*``, ``fc.weight``),
  sharing the target's embedding and head;
- :func:`build_eagle3_head`: an EAGLE-3 head for a Llama target
  (``method="eagle3"``), its own norm and head;
- :func:`build_mtp_model`: a DeepSeek-V3 checkpoint with one MTP layer
  (``method="mtp"``), ``model.layers.{num_hidden_layers}.*``: a decoder
  layer (MoE, as the last target layer is), ``enorm``, ``hnorm``,
  ``eh_proj`` and ``shared_head`` (its ``embed_tokens`` and
  ``shared_head.head`` equal to the target's, as DeepSeek-V3 ships them).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from reshard.testing.tiny import build_tiny_model

__all__ = ["build_draft_model", "build_eagle3_head", "build_eagle_head", "build_mtp_model", "speculative_config"]


QWEN3_NEXT: dict[str, Any] = dict(
    model_type="qwen3_next",
    hidden_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    intermediate_size=256,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    full_attention_interval=2,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    partial_rotary_factor=0.25,
    vocab_size=512,
    tie_word_embeddings=False,
)
"""A tiny Qwen3-Next: a linear-attention layer then a full-attention one
(head dims of 64, as vLLM's CPU kernels take), MoE with a shared expert."""


def speculative_config(method: str, draft: str | os.PathLike | None = None, tokens: int = 2) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for ``method`` with drafter ``draft``
    (MTP: none, the target's checkpoint)."""
    out: dict[str, Any] = {"method": method, "num_speculative_tokens": tokens}
    if draft is not None:
        out["model"] = str(draft)
    return out


def build_draft_model(path: str | os.PathLike, kind: str = "llama", *, seed: int = 0, **overrides: Any) -> Path:
    """A separate draft model: a tiny ``kind`` model (see :func:`build_tiny_model`)."""
    return build_tiny_model(path, kind, seed=seed, **overrides)


def _noise(t, seed: int, scale: float = 0.1):
    import torch

    g = torch.Generator().manual_seed(seed)
    return t + torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype) * scale


def _stamped(path: Path, stamp: dict[str, Any]) -> bool:
    mark = path / "reshard-drafter.json"
    return mark.exists() and json.loads(mark.read_text()) == stamp


def build_eagle_head(path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> Path:
    """An EAGLE-1 head for the tiny Llama (``overrides`` as the target's)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(path)
    stamp = {"eagle": seed, **{k: repr(v) for k, v in overrides.items()}}
    if _stamped(path, stamp):
        return path
    base = build_tiny_model(path / "base", "llama", seed=seed, num_hidden_layers=1, **overrides)
    w = load_file(str(base / "model.safetensors"))
    out = {
        k.removeprefix("model."): v
        for k, v in w.items()
        if k.startswith("model.layers.0.") and "input_layernorm" not in k
    }
    h = int(json.loads((base / "config.json").read_text())["hidden_size"])
    g = torch.Generator().manual_seed(seed + 11)
    out["fc.weight"] = (torch.randn((h, 2 * h), generator=g) * 0.05).to(next(iter(w.values())).dtype)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / f).exists():
            shutil.copy(base / f, path / f)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(base)
    (path / "reshard-drafter.json").write_text(json.dumps(stamp))
    return path


def build_eagle3_head(path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> Path:
    """An EAGLE-3 head for the tiny Llama (``overrides`` as the target's):
    one decoder layer whose attention reads the embedding and the hidden
    state together (``2 * hidden`` inputs, ``hidden_norm``), ``fc`` over
    two of the target's hidden states, its own ``norm`` and ``lm_head``."""
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(path)
    stamp = {"eagle3": seed, **{k: repr(v) for k, v in overrides.items()}}
    if _stamped(path, stamp):
        return path
    base = build_tiny_model(
        path / "base", "llama", seed=seed, num_hidden_layers=1, tie_word_embeddings=False, **overrides
    )
    w = load_file(str(base / "model.safetensors"))
    cfg = json.loads((base / "config.json").read_text())
    h = int(cfg["hidden_size"])
    g = torch.Generator().manual_seed(seed + 17)
    dtype = w["model.norm.weight"].dtype
    out = {k.removeprefix("model."): v for k, v in w.items() if k.startswith("model.layers.0.")}
    for proj in ("q_proj", "k_proj", "v_proj"):
        rows = out[f"layers.0.self_attn.{proj}.weight"].shape[0]
        out[f"layers.0.self_attn.{proj}.weight"] = (torch.randn((rows, 2 * h), generator=g) * 0.05).to(dtype)
    out["layers.0.hidden_norm.weight"] = _noise(torch.ones(h), seed + 5).to(dtype)
    # Two of the tiny target's two layers' hidden states (real heads take three of many).
    out["fc.weight"] = (torch.randn((h, 2 * h), generator=g) * 0.05).to(dtype)
    out["norm.weight"] = w["model.norm.weight"]
    out["lm_head.weight"] = w["lm_head.weight"]
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    cfg["draft_vocab_size"] = cfg["vocab_size"]
    cfg["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [0, 1]}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / f).exists():
            shutil.copy(base / f, path / f)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(base)
    (path / "reshard-drafter.json").write_text(json.dumps(stamp))
    return path


def build_mtp_model(path: str | os.PathLike, kind: str = "deepseek_v3", *, seed: int = 0, **overrides: Any) -> Path:
    """A tiny DeepSeek-V3 checkpoint with one MTP layer (see the module docstring)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(path)
    stamp = {"mtp": kind, "seed": seed, **{k: repr(v) for k, v in overrides.items()}}
    if _stamped(path, stamp):
        return path
    if kind == "qwen3_next":
        overrides = {**QWEN3_NEXT, **overrides}
        kind = "qwen3_moe"  # (its tiny sizes; the model type comes from the overrides)
    build_tiny_model(path, kind, seed=seed, num_nextn_predict_layers=1, **overrides)
    cfg = json.loads((path / "config.json").read_text())
    n = int(cfg["num_hidden_layers"])
    h = int(cfg["hidden_size"])
    w = load_file(str(path / "model.safetensors"))
    dtype = w["model.embed_tokens.weight"].dtype
    last = f"model.layers.{n - 1}."
    if cfg["model_type"] == "qwen3_next":
        # Qwen3-Next: ``mtp.*``, one full-attention MoE layer, its own norms and fc.
        for i, (k, v) in enumerate(sorted(w.items())):
            if k.startswith(last):
                w["mtp.layers.0." + k[len(last) :]] = _noise(v.float(), seed * 1000 + i, 0.02).to(v.dtype).contiguous()
        g = torch.Generator().manual_seed(seed + 13)
        w["mtp.fc.weight"] = (torch.randn((h, 2 * h), generator=g) * 0.05).to(dtype)
        for j, norm in enumerate(("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")):
            w[f"mtp.{norm}.weight"] = _noise(torch.zeros(h), seed + 20 + j).to(dtype)
        save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "reshard-drafter.json").write_text(json.dumps(stamp))
        return path
    mtp = f"model.layers.{n}."
    for i, (k, v) in enumerate(sorted(w.items())):
        if k.startswith(last):
            w[mtp + k[len(last) :]] = _noise(v.float(), seed * 1000 + i, 0.02).to(v.dtype).contiguous()
    g = torch.Generator().manual_seed(seed + 13)
    w[mtp + "enorm.weight"] = _noise(torch.ones(h), seed + 1).to(dtype)
    w[mtp + "hnorm.weight"] = _noise(torch.ones(h), seed + 2).to(dtype)
    w[mtp + "eh_proj.weight"] = (torch.randn((h, 2 * h), generator=g) * 0.05).to(dtype)
    w[mtp + "shared_head.norm.weight"] = _noise(torch.ones(h), seed + 3).to(dtype)
    w[mtp + "embed_tokens.weight"] = w["model.embed_tokens.weight"].clone()
    w[mtp + "shared_head.head.weight"] = w["lm_head.weight"].clone()
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "reshard-drafter.json").write_text(json.dumps(stamp))
    return path
