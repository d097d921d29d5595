"""DeepSpeed ZeRO-3 trainer ranks refit a vLLM engine after every step.

Two trainer ranks build the policy in ``zero.Init`` (each holds half of
every parameter, flattened) and train it with DeepSpeed; after each step
``Sender(engine).push(step)`` sends each engine worker exactly the slices
it keeps, straight from every rank's ZeRO-3 partitions: no
``GatheredParameters``, no rank ever holding a whole tensor. At the end
rank 0 gathers the weights once, the DeepSpeed way, and a fresh engine on
them must generate what the refit engine generates.

Needs DeepSpeed on CPU (``scripts/trainers_setup.sh``); runs with
``DS_ACCELERATOR=cpu`` (set here for the trainer ranks).

    python examples/deepspeed_to_vllm.py [--steps 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys

TRAINERS = 2


def trainer(rank: int, path: str, final: str, address: str, pg_port: int, steps: int) -> None:
    os.environ.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(pg_port),
        RANK=str(rank),
        WORLD_SIZE=str(TRAINERS),
        LOCAL_RANK=str(rank),
    )
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from reshard import GroupConfig, Sender

    deepspeed.init_distributed(dist_backend="gloo")
    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    keep = HfDeepSpeedConfig(ds_config)  # from_pretrained builds the model in zero.Init while this lives
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    # The refit group: trainer ranks 0..1, then the engine's worker. Sender reads
    # the ZeRO-3 partitions of engine.module; the layout is re-read at every push.
    sender = Sender(engine, config=GroupConfig(address=address, num_sources=TRAINERS, num_destinations=1))
    batch = torch.randint(4, 500, (4, 16), generator=torch.Generator().manual_seed(rank))
    for step in range(1, steps + 1):
        loss = engine(input_ids=batch, labels=batch).loss  # stands in for an RL objective
        engine.backward(loss)
        engine.step()
        sender.push(step)  # collective with the engine's pull of the same step
    sender.close()
    # Only to check the example: the final weights, gathered the DeepSpeed way.
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        if rank == 0:
            state = {n: p.detach().clone() for n, p in model.named_parameters()}
            model.save_pretrained(final, state_dict=state)
    del keep
    torch.distributed.destroy_process_group()
    # DeepSpeed keeps gloo groups of its own alive past destroy_process_group
    # (their worker threads outlive it), and a gloo worker that wakes while the
    # interpreter finalizes aborts the process ("terminate called without an
    # active exception"; pytorch/pytorch#190489): seen here about once in a dozen
    # runs on a busy machine, after this rank's work was done. Every file is
    # written and every group this rank used is closed, so leave without
    # finalizing, with the exit status saying the work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()

    from _common import free_port, workdir

    from reshard.adapters.vllm.driver import init_workers, pull_workers
    from reshard.testing.engines import greedy, offline_llm, shutdown
    from reshard.testing.tiny import build_tiny_model

    work = workdir("deepspeed")
    path = str(build_tiny_model(work / "policy", "qwen2", seed=0, torch_dtype="bfloat16"))
    final = str(work / "final")
    llm = offline_llm(path, 1, dtype="bfloat16")
    address = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    pg_port = free_port()
    ranks = [ctx.Process(target=trainer, args=(r, path, final, address, pg_port, args.steps)) for r in range(TRAINERS)]
    for r in ranks:
        r.start()
    try:
        # The worker learns which slices it keeps from vLLM's own loaders.
        init_workers(llm, {"address": address, "num_sources": TRAINERS, "num_destinations": 1, "timeout_s": 300})
        rollouts = [greedy(llm)]
        print(f"step 0: rollout {rollouts[-1][0]}")
        for step in range(1, args.steps + 1):
            (reply,) = pull_workers(llm, step)  # blocks until the trainers pushed this step
            llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
            rollouts.append(greedy(llm))
            mb = reply.stats["bytes_received"] / 1e6
            print(f"step {step}: {mb:.2f} MB from {TRAINERS} ZeRO-3 ranks, rollout {rollouts[-1][0]}")
    finally:
        for r in ranks:
            r.join(timeout=300)
        shutdown(llm)
    if not all(r.exitcode == 0 for r in ranks):
        print("FAILED: a trainer rank failed")
        return 1
    fresh = offline_llm(final, 1, dtype="bfloat16", extension=None)
    try:
        expected = greedy(fresh)
    finally:
        shutdown(fresh)
    print(f"fresh engine on the gathered weights: {expected[0]}")
    ok = rollouts[-1] == expected and rollouts[-1] != rollouts[0]
    print("OK: the refit engine generates what a fresh engine on the trained weights does" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
