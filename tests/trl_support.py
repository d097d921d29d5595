"""Helpers for the TRL tests: a GRPO run on ``world`` trainer processes
launched as ``accelerate launch`` would (its environment variables, then
TRL's own ``GRPOTrainer`` through reshard's integration), and what each
rank saw."""

from __future__ import annotations

import os
from typing import Any

from .procs import GROUP_TIMEOUT_S

__all__ = ["LOGP_MAX", "grpo_rank", "reward_even_words"]

LOGP_MAX = "sampling/sampling_logp_difference/max"
"""TRL's own measure of how far the engine's sampling logprobs are from the
trainer's recomputed ones (per step, max over tokens)."""

PROMPTS = [f"w{i} w{i + 1} w{i + 2} w{i + 3}" for i in range(10, 200, 7)]


def reward_even_words(completions: list[str], **_: Any) -> list[float]:
    """A reward with spread inside every group: the share of words with an even number."""
    out = []
    for text in completions:
        words = text.split()
        even = sum(1 for w in words if w[1:].isdigit() and int(w[1:]) % 2 == 0)
        out.append(even / max(1, len(words)))
    return out


def accelerate_env(rank: int, world: int, port: int) -> None:
    """The environment ``accelerate launch --cpu --num_processes world`` gives a process."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        ACCELERATE_USE_CPU="true",
    )


def grpo_rank(
    rank: int,
    world: int,
    pg_port: int,
    path: str,
    out_dir: str,
    mode: str,
    url: str,
    store_port: int,
    steps: int,
    sync: bool,
    greedy_prompts: list[list[int]],
    peft: dict[str, Any] | None = None,
    lora: str = "merged",
) -> dict[str, Any]:
    """One trainer rank of a GRPO run through ``ReshardGRPOTrainer``; after
    training (and, with ``sync``, a last refit) rank 0 reports the trainer's
    greedy tokens and, in colocate mode, every rank its engine's. ``peft``:
    train a LoRA adapter (``LoraConfig`` keywords, TRL's ``peft_config``; the
    model replicated over the ranks, as Accelerate's DDP keeps it), refit
    ``lora`` (``merged`` or ``adapter``)."""
    accelerate_env(rank, world, pg_port)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig

    from reshard.integrations.trl import ReshardGRPOTrainer, ReshardOptions

    tok = PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(path, "tokenizer.json"),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    ds = Dataset.from_dict({"prompt": PROMPTS})
    cfg: dict[str, Any] = dict(
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=2e-2 if peft is None else 1e-1,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        seed=0,
        use_vllm=True,
        vllm_mode=mode,
        vllm_group_port=store_port,
        dataloader_num_workers=0,
    )
    if mode == "server":
        cfg["vllm_server_base_url"] = url
    else:
        cfg.update(vllm_max_model_length=128, vllm_gpu_memory_utilization=0.1)
    llm_kwargs: dict[str, Any] = {"dtype": "float32", "enforce_eager": True}
    if lora == "adapter":
        llm_kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=2)
    model: Any = path
    extra: dict[str, Any] = {}
    if peft is not None:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(**peft)
    elif world > 1:
        # FSDP2 over the trainer processes: Accelerate runs FSDP on GPUs only
        # (on CPU its MULTI_CPU mode wraps the model in DDP), so transformers
        # shards the model at load time (DistributedConfig), and the trainer
        # leaves placement and gradient reduction to it.
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, distributed_config=DistributedConfig(fsdp_size=world)
        )
    trainer = ReshardGRPOTrainer(
        model=model,
        reward_funcs=reward_even_words,
        args=GRPOConfig(**cfg),
        train_dataset=ds,
        processing_class=tok,
        reshard=ReshardOptions(sync=sync, timeout_s=GROUP_TIMEOUT_S, llm_kwargs=llm_kwargs, lora=lora),
        **extra,
    )
    trainer.train()
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {
        "dtensor_params": sum(isinstance(p, DTensor) for p in trainer.model_wrapped.parameters()),
        "logp_max": [h[LOGP_MAX] for h in trainer.state.log_history if LOGP_MAX in h],
        "refits_in_training": trainer.reshard.refits,
        "communicator": None if mode != "server" or rank != 0 else trainer.vllm_generation.vllm_client.communicator,
    }
    if sync:
        trainer.sync_weights()
        out["refits"] = trainer.reshard.refits
        out["engine_stats"] = [[_plain(s) for s in refit] for refit in trainer.reshard.engine_stats]
        out["sent"] = [s.exec.bytes_sent for s in trainer.reshard.stats]
    # The engine's greedy tokens now (rank 0 asks the server; in colocate mode
    # every rank its own engine), checked against the trainer's weights below.
    engine: list[list[int]] | None = None
    if mode == "colocate":
        from reshard.testing.engines import greedy

        engine = out["engine_greedy"] = greedy(trainer.vllm_generation.llm, greedy_prompts)
    elif sync and rank == 0:
        from .vllm_support import server_greedy

        # Adapter-only refits: the adapter's newest version, as TRL's generation uses it.
        name = trainer.vllm_generation.vllm_client.model if lora == "adapter" else None
        engine = out["engine_greedy"] = server_greedy(url, greedy_prompts, model=name)
        out["served_model"] = name
    out["greedy"], out["engine_gap"] = _trainer_greedy(trainer, greedy_prompts, engine)
    trainer.close_reshard()
    if mode == "colocate":
        from reshard.testing.engines import shutdown

        shutdown(trainer.vllm_generation.llm)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return out


def _plain(stats: Any) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(stats)


def _trainer_greedy(
    trainer: Any, prompts: list[list[int]], engine: list[list[int]] | None
) -> tuple[list[list[int]] | None, float | None]:
    """Rank 0: greedy tokens of the trainer's current weights (gathered here
    for the check only, by transformers on a fresh copy) and, given the
    engine's greedy tokens, the largest gap (nats) at any of their positions
    between the trainer's most likely next token and the engine's choice,
    teacher-forced: 0 where both pick the same token; where a near-tie lets
    the two implementations pick different ones on the same weights, float32
    rounding (about 1e-6); far larger on other weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    if hasattr(model, "peft_config"):
        # A LoRA policy: PEFT's own merge of it (the ranks are replicas).
        import copy

        state = copy.deepcopy(model).merge_and_unload().state_dict()
    else:
        state = _full_state(model)
    if trainer.accelerator.process_index != 0:
        return None, None
    config = AutoConfig.from_pretrained(model.config._name_or_path)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(state)
    fresh.eval()
    out = []
    gap = None
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = fresh.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, min_new_tokens=12
            )
            out.append(gen[0, len(p) :].tolist())
        for p, tokens in zip(prompts, engine, strict=True) if engine is not None else ():
            ids = torch.tensor([p + tokens])
            logp = torch.log_softmax(fresh(ids).logits[0, len(p) - 1 : -1].float(), dim=-1)
            chosen = logp.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
            worst = float((logp.max(dim=1).values - chosen).max())
            gap = worst if gap is None else max(gap, worst)
    return out, gap


def _full_state(model: Any) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
