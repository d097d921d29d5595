"""Refit a running vLLM server over HTTP: pause, pull, flush, resume.

The server runs reshard's worker extension (``--worker-extension-cls
reshard.adapters.vllm.ReshardWorkerExtension``, dev routes on with
``VLLM_SERVER_DEV_MODE=1``). The trainer (here one rank holding a plain
module; with FSDP2 every rank calls ``push``) attaches a ``Sender`` and
passes ``engines=VllmEngines([url])`` on one rank: each ``push`` then pauses
the server (requests in flight finish on the old weights), makes every
worker pull its slices while this rank pushes, resets the prefix cache and
resumes the server.

    python examples/vllm_server.py
"""

from __future__ import annotations

import sys


def main() -> int:
    import torch
    from _common import completion, free_port, start_vllm_server, stop, workdir
    from transformers import AutoModelForCausalLM

    from reshard import GroupConfig, Sender
    from reshard.adapters.vllm.driver import VllmEngines
    from reshard.testing.tiny import build_tiny_model

    work = workdir("server")
    path = build_tiny_model(work / "policy", "qwen2", seed=0)
    proc, url = start_vllm_server(
        path, work / "server.log", "--worker-extension-cls", "reshard.adapters.vllm.ReshardWorkerExtension"
    )
    try:
        prompt = [5, 6, 7, 8, 9]
        before = completion(url, prompt)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        # The refit store lives in this process (trainer rank 0) on a port the workers can reach.
        cfg = GroupConfig(address=f"127.0.0.1:{free_port()}", num_sources=1, num_destinations=1)
        sender = Sender(model, config=cfg)
        engines = VllmEngines([url], pause_mode="wait")
        for step in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)  # stands in for an optimizer step
            stats = sender.push(step, engines=engines)
            (worker,) = sender.engine_stats
            print(
                f"step {step}: sent {stats.exec.bytes_sent / 1e6:.1f} MB; the worker received "
                f"{worker.bytes_received / 1e6:.1f} MB in {worker.refit_seconds:.3f} s"
            )
        sender.close()
        after = completion(url, prompt)
    finally:
        stop(proc)
    print(f"tokens before {before}\ntokens after  {after}")
    ok = after != before
    print("OK: the server answers from the new weights" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
