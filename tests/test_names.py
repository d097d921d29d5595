"""Checkpoint names from transformers' own conversion mapping, read backwards."""

from __future__ import annotations

import pytest

from reshard.models import canonical_tensors, load_model
from reshard.models.names import CheckpointNames


def test_qwen3_moe_fused_experts_split_into_checkpoint_tensors():
    names = CheckpointNames("qwen3_moe")
    pieces = names.split("model.layers.1.mlp.experts.gate_up_proj", (4, 64, 32))
    assert [p.name for p in pieces[:4]] == [
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "model.layers.1.mlp.experts.0.up_proj.weight",
        "model.layers.1.mlp.experts.1.gate_proj.weight",
        "model.layers.1.mlp.experts.1.up_proj.weight",
    ]
    up1 = pieces[3]
    assert up1.shape == (32, 32) and up1.offset == (1, 32, 0) and up1.dims == (1, 2)
    down = names.split("model.layers.1.mlp.experts.down_proj", (4, 32, 16))
    assert down[2].name == "model.layers.1.mlp.experts.2.down_proj.weight"
    assert down[2].shape == (32, 16) and down[2].offset == (2, 0, 0)
    # Everything else keeps its name.
    assert names.split("model.norm.weight", (32,))[0].name == "model.norm.weight"


def test_mixtral_renaming_is_reversed():
    pieces = CheckpointNames("mixtral").split("model.layers.0.mlp.experts.gate_up_proj", (2, 8, 4))
    assert pieces[0].name == "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    assert pieces[1].name == "model.layers.0.block_sparse_moe.experts.0.w3.weight"


@pytest.mark.parametrize(
    ("preset", "params", "tensors"),
    [
        ("llama3-8b", 8_030_261_248, 291),
        ("llama3-70b", 70_553_706_496, 723),
        ("qwen3-235b", 235_093_634_560, 36_945),
        ("kimi-k2", 1_026_408_232_448, 69_975),
    ],
)
def test_presets(preset, params, tensors):
    spec = load_model(preset)
    assert spec.params == params
    assert len(spec.tensors) == tensors


def test_deepseek_v3_has_per_expert_names_and_the_router_bias():
    spec = load_model("deepseek-v3")
    names = {t.name for t in spec.tensors}
    assert "model.layers.3.mlp.experts.255.down_proj.weight" in names
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.2.mlp.gate_proj.weight" in names  # first_k_dense_replace = 3
    assert round(spec.params / 1e9) == 671


def test_kimi_k2_is_deepseek_v3_shaped_at_a_trillion_parameters():
    spec = load_model("kimi-k2")
    names = {t.name for t in spec.tensors}
    assert "model.layers.60.mlp.experts.383.down_proj.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names  # first_k_dense_replace = 1
    assert "model.layers.1.mlp.gate_proj.weight" not in names
    shapes = {t.name: t.shape for t in spec.tensors}
    assert shapes["model.layers.1.self_attn.q_b_proj.weight"] == (64 * 192, 1536)  # 64 heads, MLA
    assert shapes["model.embed_tokens.weight"] == (163_840, 7168)
    assert round(spec.params / 1e12, 2) == 1.03


def test_tied_embeddings_appear_once():
    tensors = canonical_tensors(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": 100,
            "tie_word_embeddings": True,
        }
    )
    names = [t.name for t in tensors]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
