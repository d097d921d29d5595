"""TRL's GRPO with reshard refits: ``ReshardGRPOTrainer`` against a plain vLLM server.

TRL syncs the policy into vLLM before every generation step; its own sync
gathers each parameter and broadcasts it over an NCCL group (which needs
CUDA). ``ReshardGRPOTrainer`` is TRL's ``GRPOTrainer`` with every sync one
``Sender.push``: each trainer rank sends what it holds, each vLLM worker
pulls what it keeps. The server is a plain vLLM server with reshard's worker
extension and the dev routes (``VLLM_SERVER_DEV_MODE=1``); TRL generates
through it as usual.

    python examples/trl_grpo.py

Needs TRL 1.16.0 (scripts/frameworks_setup.sh). Two GRPO steps on a tiny
model; TRL logs ``sampling/sampling_logp_difference/max``, the largest gap
between the engine's sampling logprobs and the trainer's: it stays near zero
because the engine always generates from the current policy.
"""

from __future__ import annotations

import sys


def reward_even_words(completions: list[str], **_) -> list[float]:
    """Share of generated words with an even number (the tiny model's words are w0, w1, ...)."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in words) / max(1, len(words)))
    return out


def main() -> int:
    import torch
    from _common import completion, free_port, start_vllm_server, stop, workdir
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig

    from reshard.integrations.trl import ReshardGRPOTrainer, ReshardOptions
    from reshard.testing.tiny import build_tiny_model

    work = workdir("trl-grpo")
    path = build_tiny_model(work / "policy", "qwen2", seed=0)
    proc, url = start_vllm_server(
        path,
        work / "server.log",
        *("--worker-extension-cls", "reshard.adapters.vllm.ReshardWorkerExtension"),
        *("--dtype", "float32", "--logprobs-mode", "processed_logprobs"),
    )
    try:
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_file=str(path / "tokenizer.json"),
            unk_token="<unk>",
            bos_token="<s>",
            eos_token="</s>",
            pad_token="<pad>",
        )
        prompts = Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(10, 90, 5)]})
        args = GRPOConfig(
            output_dir=str(work / "out"),
            max_steps=2,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=8,
            learning_rate=2e-2,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            bf16=False,
            use_cpu=True,
            gradient_checkpointing=False,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_url=url,
        )
        trainer = ReshardGRPOTrainer(
            model=str(path),
            reward_funcs=reward_even_words,
            args=args,
            train_dataset=prompts,
            processing_class=tokenizer,
            # The refit store: trainer rank 0 hosts it, the server's workers dial in.
            reshard=ReshardOptions(address=f"127.0.0.1:{free_port()}"),
        )
        trainer.train()
        gaps = [h["sampling/sampling_logp_difference/max"] for h in trainer.state.log_history if "loss" in h]
        for step, (gap, workers) in enumerate(zip(gaps, trainer.reshard.engine_stats, strict=False), 1):
            got = sum(w.bytes_received for w in workers)
            print(f"step {step}: refit into {len(workers)} worker(s), {got / 1e6:.2f} MB; TRL's logprob gap {gap:.2e}")
        # The last optimizer step came after the last sync: refit once more, then compare.
        trainer.sync_weights()
        trainer.close_reshard()
        policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        policy.load_state_dict(trainer.accelerator.unwrap_model(trainer.model).state_dict())
        prompt = [5, 6, 7, 8, 9]
        ids = torch.tensor([prompt])
        greedy = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
        mine = policy.generate(ids, attention_mask=torch.ones_like(ids), **greedy)[0, len(prompt) :].tolist()
        served = completion(url, prompt)
    finally:
        stop(proc)
    print(f"trainer's greedy tokens {mine}\nserver's greedy tokens  {served}")
    ok = trainer.reshard.refits == 3 and len(gaps) == 2 and all(g < 0.1 for g in gaps) and served == mine
    print("OK: every step generated from the current policy" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
