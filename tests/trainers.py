"""Trainer ranks for the engine tests: a checkpoint under FSDP2, and the
ways a test makes one disagree with the engine."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["decoder_layers", "fsdp2_model", "mutated_rename"]


def decoder_layers(model):
    """The model's list of decoder layers (``model.layers``, ``transformer.h``)."""
    import torch

    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == model.config.num_hidden_layers:
            return mod
    raise ValueError(f"no decoder layer list in {type(model).__name__}")


def fsdp2_model(rank: int, world: int, pg_port: int, path: str, *, dtype: str = "float32", mutate: str = "") -> Any:
    """``path`` loaded at ``dtype``, each decoder layer and the root
    ``fully_shard``-ed over ``world`` ranks (the default gloo group is
    created on first use and kept for the life of the process).
    ``mutate="shape"``: the final norm gets one more element than the
    engine's (a trainer whose model disagrees on a tensor)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(pg_port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    if mutate == "shape":
        w = model.model.norm.weight
        model.model.norm.weight = torch.nn.Parameter(torch.zeros(w.shape[0] + 1, dtype=w.dtype))
    mesh = init_device_mesh("cpu", (world,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def mutated_rename(mutate: str) -> Callable[[str], str | None]:
    """The sender's rename; ``mutate="missing"`` drops one tensor the engine needs."""
    from reshard.sender import default_rename

    def rename(n: str) -> str | None:
        if mutate == "missing" and n == "model.layers.1.post_attention_layernorm.weight":
            return None
        return default_rename(n)

    return rename
