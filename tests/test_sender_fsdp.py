"""FSDP2 ``fully_shard`` models on CPU as senders, read automatically, into a
vLLM-style tensor-parallel layout (fused qkv, gate_up, expert stacks)."""

from __future__ import annotations

import os

import pytest
import torch

from reshard.costmodel.rules import EngineSpec, engine_layouts
from reshard.models.names import CheckpointNames
from reshard.receiver import Receiver
from reshard.sender import Sender

from . import procs
from .support import expand, group_config, local_view, make_locals

CONFIGS = {
    "qwen3_moe": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        vocab_size=101,
    ),
    # shared_expert_gate is [1, H] and the router [3, H]: fewer rows than
    # FSDP ranks, so some ranks hold empty shards of them.
    "qwen2_moe": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=3,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        vocab_size=130,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        intermediate_size=96,
        num_hidden_layers=2,
        vocab_size=130,
        tie_word_embeddings=False,
    ),
}


def _model(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **CONFIGS[model_type])
    return AutoModelForCausalLM.from_config(cfg), cfg


def _reference(model_type: str) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors of the same model, built whole."""
    model, _ = _model(model_type)
    names = CheckpointNames(model_type)
    out = {}
    for n, p in model.state_dict().items():
        for cp in names.split(n, tuple(p.shape)):
            if not cp.offset:
                out[cp.name] = p
                continue
            idx = tuple(
                slice(o, o + 1) if d not in cp.dims else slice(o, o + cp.shape[cp.dims.index(d)])
                for d, o in enumerate(cp.offset)
            )
            out[cp.name] = p[idx].reshape(cp.shape)
    return out


def _run(rank: int, address: str, pg_port: int, model_type: str, engine_tp: int, world: int = 2) -> dict:
    cfg = group_config(address, world, engine_tp)
    if rank < world:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(pg_port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        model, _ = _model(model_type)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sender = Sender(model, config=cfg)
        stats = sender.push(1)
        sender.close()
        dist.destroy_process_group()
        return {"sent": stats.exec.bytes_sent, "grids": len(sender.layout.grids), "pieces": len(sender.layout.pieces)}
    from reshard.models import canonical_tensors

    _, hf_cfg = _model(model_type)
    tensors = tuple(canonical_tensors(hf_cfg.to_dict(), dtype="float32"))
    side = engine_layouts(tensors, hf_cfg.to_dict(), EngineSpec(tp=engine_tp), base=world)
    layout = side.layout_of(rank)
    items = expand(layout)
    local = make_locals(items, False)
    stats = Receiver(local, config=cfg, rank=rank, layout=layout).pull(1)
    ref = _reference(model_type)
    kept = 0
    for meta, slot in items:
        want = ref[meta.name][tuple(slice(o, o + n) for o, n in zip(slot.box.offsets, slot.box.sizes, strict=True))]
        got = local_view(local[slot.local], slot, slot.box)
        assert torch.equal(got, want), f"rank {rank}: {meta.name}{slot.box}"
        kept += slot.box.numel * 4
    return {"received": stats.exec.bytes_received, "kept": kept, "locals": sorted(local)}


@pytest.mark.parametrize(("model_type", "tp"), [("qwen3_moe", 2), ("qwen2", 2)])
def test_fsdp2_model_to_vllm_style_tp_layout(model_type, tp):
    server = procs.StoreServer()
    out = procs.check(procs.run(_run, 2 + tp, server.address, procs.free_port(), model_type, tp, timeout=600))
    trainers, engines = out[:2], out[2:]
    # Parameters the grid rule can say are grids; fused experts are pieces.
    assert all(t["grids"] > 0 for t in trainers)
    if model_type == "qwen3_moe":
        assert all(t["pieces"] > 0 for t in trainers)
    fused = ("qkv_proj", "w13_weight", "w2_weight") if model_type == "qwen3_moe" else ("qkv_proj", "gate_up_proj")
    for part in fused:
        assert all(any(part in n for n in e["locals"]) for e in engines), part
    # Each engine rank receives exactly the bytes it keeps (KV heads replicated
    # below tp are kept twice, and received twice).
    for e in engines:
        assert e["received"] == e["kept"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fsdp2_worlds_with_tensors_smaller_than_the_world(world):
    """FSDP2 cuts dim 0 with torch.chunk semantics: with more ranks than rows
    (shared_expert_gate [1, H], the router [3, H]) trailing ranks hold empty
    shards, and the last non-empty one may be short. Every rank still
    publishes the grid rule, and the engine gets every byte."""
    tp = 2
    server = procs.StoreServer()
    out = procs.check(
        procs.run(_run, world + tp, server.address, procs.free_port(), "qwen2_moe", tp, world, timeout=600)
    )
    trainers, engines = out[:world], out[world:]
    assert all(t["grids"] > 0 for t in trainers)
    assert sum(t["sent"] for t in trainers) == sum(e["received"] for e in engines)
    for e in engines:
        assert e["received"] == e["kept"]
        assert any("shared_expert_gate" in n for n in e["locals"])
