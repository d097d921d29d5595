"""Tiny models built locally (no model hub) for tests, examples and the demo.

Each is a real transformers model saved with ``save_pretrained`` (safetensors)
plus a word-level tokenizer built with ``tokenizers``. They use a large
initializer range and seeded noise on norms and biases: with the default
init a tiny model's output ignores its layer weights, and a refit test would
pass on wrong weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["NONDETERMINISTIC", "TINY", "build_tiny_model", "perturb", "tiny_config"]

# vLLM on CPU needs head_dim in {32, 64, 80, ...}. Each entry says what of
# vLLM's loading it exercises; tests/test_zoo.py refits every one into a bf16
# engine at TP=2 (some at TP=1 as well).
TINY: dict[str, dict[str, Any]] = {
    # GQA (2 KV heads), untied, qkv bias, a vocabulary vLLM pads (500 -> 512).
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        num_hidden_layers=2,
        vocab_size=500,
        tie_word_embeddings=False,
    ),
    # One KV head (replicated across TP ranks), tied embeddings.
    "llama": dict(
        model_type="llama",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=256,
        num_hidden_layers=2,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
    # q/k norms per head.
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        num_hidden_layers=2,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
    # Fused checkpoint tensors: qkv_proj and gate_up_proj.
    "phi3": dict(
        model_type="phi3",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        num_hidden_layers=2,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
    # Conv1D weights stored transposed ([in, out]), a fused c_attn, tied.
    "gpt2": dict(
        model_type="gpt2",
        n_embd=128,
        n_head=4,
        n_layer=2,
        n_positions=512,
        n_inner=256,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
    # Llama's layout under Mistral's names and loader.
    "mistral": dict(
        model_type="mistral",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        num_hidden_layers=2,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
    # Gemma (1): norms stored as w and applied as 1 + w (SGLang's loader adds
    # the 1 to the checkpoint tensor), GeGLU, tied embeddings. A larger init:
    # at 0.1 the tied head makes any such tiny model repeat its last token.
    "gemma": dict(
        initializer_range=0.3,
        model_type="gemma",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        num_hidden_layers=2,
        vocab_size=512,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
    # Gemma-style norms (1 + w), per-head q/k norms, a sliding-window layer.
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        num_hidden_layers=2,
        vocab_size=512,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
    ),
    # vLLM's Transformers modeling backend; q/k norms over the whole projection.
    "olmo2": dict(
        model_type="olmo2",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        num_hidden_layers=2,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
    # vLLM's Transformers modeling backend; LayerNorm with bias, tied.
    "starcoder2": dict(
        model_type="starcoder2",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        num_hidden_layers=2,
        vocab_size=512,
        tie_word_embeddings=True,
        use_bias=True,
    ),
    # Mixture of experts (block_sparse_moe w1/w2/w3).
    "mixtral": dict(
        model_type="mixtral",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
    # Shared experts and a [1, hidden] shared_expert_gate.
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=False,
        num_hidden_layers=2,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
    # FusedMoE w13/w2 stacks in vLLM, fused experts in transformers 5.
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        vocab_size=512,
        tie_word_embeddings=False,
        norm_topk_prob=True,
    ),
    # MLA without q-LoRA; a dense first layer, then MoE with a shared expert.
    "deepseek_v2": dict(
        model_type="deepseek_v2",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=256,
        moe_intermediate_size=64,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        num_hidden_layers=2,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
    # MLA with q-LoRA, sigmoid routing with a float32 e_score_correction_bias.
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=256,
        moe_intermediate_size=64,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        topk_method="noaux_tc",
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        scoring_func="sigmoid",
        num_hidden_layers=2,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
}

# DeepSeek-V3 with two attention heads, one expert group and wider experts:
# a configuration once reported to serve wrong tokens after a TP=1 refit on a
# loaded machine (the zoo runs it on vLLM's reference CPU MLA backend,
# whichever MLA backend the machine would pick).
TINY["deepseek_v3_g1"] = dict(
    TINY["deepseek_v3"], num_attention_heads=2, num_key_value_heads=2, moe_intermediate_size=128, n_group=1
)

NONDETERMINISTIC: set[tuple[str, int]] = set()
"""(architecture, TP) whose fresh vLLM engines disagree with each other on
this CPU in bf16: tests compare parameters with vLLM's own reload instead
of tokens."""


def tiny_config(kind: str, **overrides: Any) -> dict[str, Any]:
    if kind not in TINY:
        raise ValueError(f"unknown tiny model {kind!r}; known: {sorted(TINY)}")
    cfg: dict[str, Any] = dict(
        initializer_range=0.1,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        torch_dtype="float32",
    )
    cfg.update(TINY[kind])
    cfg.update(overrides)
    return cfg


def perturb(model, seed: int, scale: float = 0.1) -> None:
    """Seeded noise on norms and biases (zero or one by default)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * scale)
        # Loaded buffers such as DeepSeek-V3's router e_score_correction_bias
        # (zero at init, so a refit that skipped it would go unnoticed).
        for name, b in model.named_buffers():
            if name.endswith("_bias") and b.is_floating_point():
                b.add_(torch.randn(b.shape, generator=g, dtype=torch.float32).to(b.dtype) * scale)


def build_tiny_model(path: str | os.PathLike, kind: str = "qwen2", *, seed: int = 0, **overrides: Any) -> Path:
    """Build and save a tiny model and tokenizer at ``path`` (reused if present)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    cfg_dict = tiny_config(kind, **overrides)
    stamp = path / "reshard-tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()) == {"config": cfg_dict, "seed": seed}:
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = dict(cfg_dict)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb(model, seed + 1)
    # Saved in the config's dtype (float32 unless overridden), as a checkpoint is.
    model.to(getattr(torch, cfg_dict["torch_dtype"]))
    model.save_pretrained(path, safe_serialization=True)
    vocab_size = cfg_dict["vocab_size"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    vocab.update({f"w{i}": i + 4 for i in range(vocab_size - 4)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(path)
    stamp.write_text(json.dumps({"config": cfg_dict, "seed": seed}))
    return path
