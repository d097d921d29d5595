"""Refit a running SGLang server: the reshard hook is SGLang's custom weight
loader, and ``engines=SglangEngines([url])`` drives it from the trainer.

SGLang pins its own torch, so the server runs from its own virtual
environment (``make sglang-setup`` builds ``.venv-sglang``); the trainer
runs from reshard's. They meet in one gloo refit group. The server, on CPU:

    .venv-sglang/bin/python -m sglang.launch_server --model-path PATH --device cpu \\
        --attention-backend torch_native --sampling-backend pytorch \\
        --custom-weight-loader reshard.adapters.sglang.hook.load

Each ``push(step, engines=...)`` pauses generation (running requests are
retracted and recomputed on the new weights), opens SGLang's weight-update
session, makes every TP worker pull its slices, flushes the KV cache and
resumes.

    python examples/sglang_server.py [--sglang-python .venv-sglang/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def generate(url: str, prompt: list[int]) -> list[int]:
    body = {"input_ids": [prompt], "sampling_params": {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}}
    req = urllib.request.Request(
        f"{url}/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return list(json.loads(r.read())[0]["output_ids"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sglang-python", default=str(REPO / ".venv-sglang" / "bin" / "python"))
    args = p.parse_args()
    if not Path(args.sglang_python).exists():
        print(f"no SGLang venv at {args.sglang_python}: run `make sglang-setup` first")
        return 2

    import torch
    from _common import free_port, stop, workdir
    from transformers import AutoModelForCausalLM

    from reshard import GroupConfig, Sender
    from reshard.adapters.sglang import HOOK, SglangEngines
    from reshard.testing.tiny import build_tiny_model

    work = workdir("sglang")
    path = build_tiny_model(work / "policy", "qwen2", seed=0)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [args.sglang_python, "-m", "sglang.launch_server", "--model-path", str(path), "--device", "cpu"]
    cmd += ["--attention-backend", "torch_native", "--sampling-backend", "pytorch", "--disable-cuda-graph"]
    cmd += ["--dtype", "float32", "--mem-fraction-static", "0.95", "--max-total-tokens", "2048"]
    cmd += ["--skip-server-warmup", "--random-seed", "0", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--custom-weight-loader", HOOK]
    log = open(work / "server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health_generate", timeout=30) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                print(f"the SGLang server did not start; see {work / 'server.log'}")
                return 1
            time.sleep(1)
        prompt = [5, 6, 7, 8, 9]
        before = generate(url, prompt)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        sender = Sender(
            model, config=GroupConfig(address=f"127.0.0.1:{free_port()}", num_sources=1, num_destinations=1)
        )
        engines = SglangEngines([url])
        for step in (1, 2):
            with torch.no_grad():
                for prm in model.parameters():
                    prm.add_(torch.randn_like(prm) * 0.05)  # stands in for an optimizer step
            sender.push(step, engines=engines)
            (worker,) = sender.engine_stats
            print(f"step {step}: the TP worker received {worker.bytes_received / 1e6:.1f} MB")
        sender.close()
        after = generate(url, prompt)
    finally:
        stop(proc)
        log.close()
    print(f"tokens before {before}\ntokens after  {after}")
    ok = after != before
    print("OK: the server answers from the new weights" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
