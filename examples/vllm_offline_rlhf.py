"""An RLHF-style loop with an offline vLLM engine: two FSDP2 trainer ranks
take optimizer steps, and after each step the engine's weights are
hot-swapped by reshard before it generates the next rollouts.

- The engine (``vllm.LLM``, here TP=1 on CPU) runs reshard's worker
  extension; this process drives it: ``init_workers`` once, then
  ``pull_workers(llm, step)`` each step, while the trainer ranks call
  ``Sender.push(step)``.
- Each trainer rank holds its FSDP2 shard; reshard reads the DTensor
  placements and sends each engine worker exactly the slices it keeps.

    python examples/vllm_offline_rlhf.py [--steps 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys

TRAINERS = 2


def trainer(rank: int, path: str, address: str, pg_port: int, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from reshard import GroupConfig, Sender

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(pg_port))
    dist.init_process_group("gloo", rank=rank, world_size=TRAINERS)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (TRAINERS,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # The refit group: trainer ranks 0..1, then the engine's worker.
    sender = Sender(model, config=GroupConfig(address=address, num_sources=TRAINERS, num_destinations=1))
    batch = torch.randint(4, 500, (4, 16), generator=torch.Generator().manual_seed(rank))
    for step in range(1, steps + 1):
        loss = model(input_ids=batch, labels=batch).loss  # stands in for an RL objective
        loss.backward()
        opt.step()
        opt.zero_grad()
        sender.push(step)  # collective with the engine's pull of the same step
    sender.close()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()

    from _common import free_port, workdir

    from reshard.adapters.vllm.driver import init_workers, pull_workers
    from reshard.testing.engines import greedy, offline_llm, shutdown
    from reshard.testing.tiny import build_tiny_model

    path = str(build_tiny_model(workdir("rlhf") / "policy", "qwen2", seed=0))
    llm = offline_llm(path, 1, extension="reshard.adapters.vllm.ReshardWorkerExtension")
    address = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    pg_port = free_port()
    ranks = [ctx.Process(target=trainer, args=(r, path, address, pg_port, args.steps)) for r in range(TRAINERS)]
    for r in ranks:
        r.start()
    try:
        # Every worker learns which slices it keeps from vLLM's own loaders.
        init_workers(llm, {"address": address, "num_sources": TRAINERS, "num_destinations": 1})
        rollouts = [greedy(llm)]
        print(f"step 0: rollout {rollouts[-1][0]}")
        for step in range(1, args.steps + 1):
            (reply,) = pull_workers(llm, step)  # blocks until the trainers pushed this step
            llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
            rollouts.append(greedy(llm))
            mb = reply.stats["bytes_received"] / 1e6
            print(f"step {step}: {mb:.1f} MB in {reply.stats['refit_seconds']:.3f} s, rollout {rollouts[-1][0]}")
    finally:
        for r in ranks:
            r.join(timeout=120)
        shutdown(llm)
    ok = rollouts[-1] != rollouts[0] and all(r.exitcode == 0 for r in ranks)
    print("OK: the engine generated from the trainer's new weights after every step" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
