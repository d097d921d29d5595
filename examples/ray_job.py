"""A Ray job, as verl, OpenRLHF, NeMo RL and SkyRL deploy: FSDP2 trainer
ranks and a vLLM engine are Ray actors, and the weights move from the
trainer actors straight into the engine's workers with reshard.

The engine actor is a ``vllm.LLM`` with ``weight_transfer_config={"backend":
"reshard"}``; the trainer actors attach with vLLM's own
``RayVLLMWeightSyncClient(engine)`` and call ``send_weights()`` after each
step. The bytes do not go through Ray's object store: trainer ranks and
engine workers meet in a refit group (gloo here, NCCL on GPUs) whose store
trainer rank 0 hosts.

    python examples/ray_job.py [--steps 2]
"""

from __future__ import annotations

import argparse
import os
import sys

import ray

TRAINERS = 2
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


@ray.remote(num_cpus=0)
class Trainer:
    """One FSDP2 trainer rank."""

    def __init__(self, rank: int, pg_port: int, path: str) -> None:
        import torch
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(pg_port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=TRAINERS)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        self.rank = rank
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (TRAINERS,))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.batch = torch.randint(4, 500, (4, 16), generator=torch.Generator().manual_seed(rank))

    def attach(self, engine, address: str) -> None:
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from reshard.adapters.vllm.backend import ReshardTrainerInitInfo  # registers "reshard" here

        info = ReshardTrainerInitInfo(rank=self.rank, address=address, num_sources=TRAINERS, num_destinations=1)
        self.transfer = WeightTransferTrainerFactory.trainer_init(
            info, client=RayVLLMWeightSyncClient(engine), source=ModuleSource(self.model)
        )

    def step(self) -> float:
        loss = self.model(input_ids=self.batch, labels=self.batch).loss  # stands in for an RL objective
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.transfer.send_weights()  # every rank; rank 0 also drives the engine
        return float(loss)

    def close(self) -> None:
        import torch.distributed as dist

        self.transfer.shutdown()
        dist.destroy_process_group()


def engine_class():
    from vllm import LLM

    class Engine(LLM):
        """The vLLM engine as a Ray actor (its methods are vLLM's own)."""

        def greedy(self, prompt: list[int]) -> list[int]:
            from vllm import SamplingParams

            sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            return list(self.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids)

    return Engine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()

    from _common import free_port, workdir

    from reshard.testing.tiny import build_tiny_model

    path = str(build_tiny_model(workdir("ray") / "policy", "qwen2", seed=0))
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        engine = (
            ray.remote(num_cpus=0)(engine_class())
            .options(runtime_env={"env_vars": ENGINE_ENV})
            .remote(
                model=path,
                dtype="float32",
                enforce_eager=True,
                max_model_len=128,
                block_size=32,
                max_num_seqs=4,
                seed=0,
                weight_transfer_config={"backend": "reshard"},
            )
        )
        prompt = [5, 6, 7, 8, 9]
        before = ray.get(engine.greedy.remote(prompt))
        pg_port, address = free_port(), f"127.0.0.1:{free_port()}"
        trainers = [Trainer.remote(r, pg_port, path) for r in range(TRAINERS)]
        ray.get([t.attach.remote(engine, address) for t in trainers])
        for step in range(1, args.steps + 1):
            losses = ray.get([t.step.remote() for t in trainers])
            print(
                f"step {step}: loss {losses[0]:.3f}, weights swapped; rollout {ray.get(engine.greedy.remote(prompt))}"
            )
        after = ray.get(engine.greedy.remote(prompt))
        ray.get([t.close.remote() for t in trainers])
    finally:
        ray.shutdown()
    print(f"tokens before {before}\ntokens after  {after}")
    ok = after != before
    print("OK: the engine actor serves the trainer actors' weights" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
