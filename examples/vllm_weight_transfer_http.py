"""vLLM's own weight-transfer API with the ``reshard`` backend, driven by
vLLM's own HTTP client from a trainer process that never starts an engine.

The server: ``VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server
--model PATH --weight-transfer-config '{"backend": "reshard"}'`` (the backend
is registered by reshard's ``vllm.general_plugins`` entry point).

The trainer: ``WeightTransferTrainerFactory.trainer_init(ReshardTrainerInitInfo(...),
client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))``, then
``send_weights()`` after each step on every trainer rank. Importing
``ReshardTrainerInitInfo`` registers the backend in this process. Pause the
server around the swap to keep requests from mixing weights.

    python examples/vllm_weight_transfer_http.py
"""

from __future__ import annotations

import sys


def main() -> int:
    import torch
    from _common import completion, free_port, post, start_vllm_server, stop, workdir
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from reshard.adapters.vllm.backend import ReshardTrainerInitInfo  # registers "reshard"
    from reshard.testing.tiny import build_tiny_model

    work = workdir("weight-transfer")
    path = build_tiny_model(work / "policy", "qwen2", seed=0)
    proc, url = start_vllm_server(path, work / "server.log", "--weight-transfer-config", '{"backend": "reshard"}')
    try:
        prompt = [5, 6, 7, 8, 9]
        before = completion(url, prompt)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        info = ReshardTrainerInitInfo(
            rank=0,  # this trainer rank; rank 0 drives the server
            address=f"127.0.0.1:{free_port()}",  # the refit store, hosted by trainer rank 0
            num_sources=1,  # trainer ranks
            num_destinations=1,  # the server's workers
        )
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model)
        )
        for step in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)  # stands in for an optimizer step
            post(f"{url}/pause?mode=wait")  # requests in flight finish on the old weights
            try:
                engine.send_weights()  # start, update (the workers pull), finish, reset the prefix cache
            finally:
                post(f"{url}/resume")
            print(f"step {step}: weights sent")
        engine.shutdown()
        after = completion(url, prompt)
    finally:
        stop(proc)
    print(f"tokens before {before}\ntokens after  {after}")
    ok = after != before
    print("OK: the server answers from the new weights" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
