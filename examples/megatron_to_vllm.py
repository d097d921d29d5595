"""Megatron-Core trainer ranks (TP=2) refit a vLLM engine (TP=1).

Each Megatron rank holds its tensor-parallel shards: fused ``linear_qkv``
rows per query group, gated ``linear_fc1`` (gate and up interleaved by
rank), the padded vocabulary. ``megatron_sender`` reads them from Megatron's
own objects and publishes which box of which checkpoint tensor each rank
holds; the engine worker learns from vLLM's loaders which boxes it keeps
(fused ``qkv_proj`` and ``gate_up_proj``); each byte goes from the Megatron
rank that holds it to the worker.

    python examples/megatron_to_vllm.py
"""

from __future__ import annotations

import multiprocessing as mp
import sys

TP = 2
CONFIG = dict(
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    num_hidden_layers=2,
    vocab_size=512,
)


def megatron_rank(rank: int, pg_port: int, address: str, hf: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from reshard import GroupConfig
    from reshard.adapters.megatron import megatron_sender

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank, world_size=TP)
    ps.initialize_model_parallel(tensor_model_parallel_size=TP)
    torch.manual_seed(0)
    cfg = TransformerConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf["head_dim"],
        ffn_hidden_size=hf["intermediate_size"],
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        init_method_std=0.1,  # a visible change in a tiny model
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        tensor_model_parallel_size=TP,
    )
    vocab = -(-hf["vocab_size"] // (128 * TP)) * (128 * TP)  # Megatron pads the vocabulary
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=vocab,
        max_sequence_length=128,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    # Megatron's own objects say what this rank holds; hf_config names the checkpoint tensors.
    sender = megatron_sender(
        model, config=GroupConfig(address=address, num_sources=TP, num_destinations=1, timeout_s=120), hf_config=hf
    )
    sender.push(1)
    sender.close()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> int:
    from _common import free_port, workdir

    from reshard.adapters.vllm.driver import init_workers, pull_workers
    from reshard.testing.engines import greedy, offline_llm, shutdown
    from reshard.testing.tiny import build_tiny_model, tiny_config

    hf = tiny_config("llama", **CONFIG, tie_word_embeddings=False)
    path = build_tiny_model(workdir("megatron") / "start", "llama", seed=0, **CONFIG, tie_word_embeddings=False)
    llm = offline_llm(str(path), 1)
    address = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    pg_port = free_port()
    ranks = [ctx.Process(target=megatron_rank, args=(r, pg_port, address, hf)) for r in range(TP)]
    try:
        before = greedy(llm)
        init_workers(llm, {"address": address, "num_sources": TP, "num_destinations": 1, "timeout_s": 120})
        for r in ranks:
            r.start()
        (reply,) = pull_workers(llm, 1)
        llm.reset_prefix_cache()
        after = greedy(llm)
    finally:
        for r in ranks:
            r.join(timeout=120)
        shutdown(llm)
    print(f"the worker received {reply.stats['bytes_received'] / 1e6:.2f} MB from {TP} Megatron ranks")
    print(f"tokens before {before[0]}\ntokens after  {after[0]}")
    ok = after != before and all(r.exitcode == 0 for r in ranks)
    print("OK: the engine serves the Megatron model's weights" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
