"""``reshard bench --engine sglang``: refits into a real SGLang server, every method from one run.

The same measurement as :mod:`reshard.tools.engine_bench` (which see), into
an SGLang server instead of vLLM: the server runs from SGLang's own venv
(``make sglang-setup``) with reshard's custom weight loader, at TP=1 (what
SGLang runs on CPU), and the trainer ranks drive nothing: this process
drives the server, alternating after a warm-up:

- ``reshard``: one refit (``SglangEngines``: pause, the loader pulls the
  slices its worker keeps, KV cache flush, resume);
- ``gather_broadcast``: the baseline through the same interface;
- ``reload``: SGLang's own ``/update_weights_from_disk`` from the checkpoint
  on ``/dev/shm``;
- ``raw_p2p``: plain gloo sends of the same bytes from the trainer ranks to
  a process standing for the worker.

SGLang has no two-phase refit here (its update pauses the server for the
whole call), so its paused time is its refit time.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from reshard.tools import engine_bench as eb

__all__ = ["METHODS", "run_sglang_bench", "sglang_python"]

METHODS = ("reshard", "gather_broadcast", "reload", "raw_p2p")

_REPO = Path(__file__).resolve().parents[2]


def sglang_python(path: str | None = None) -> Path | None:
    """SGLang's venv Python: ``path``, ``$RESHARD_SGLANG_VENV``, or ``.venv-sglang`` of this checkout."""
    if path:
        p = Path(path)
        return p if p.exists() else None
    venv = Path(os.environ.get("RESHARD_SGLANG_VENV") or _REPO / ".venv-sglang")
    py = venv / "bin" / "python"
    return py if py.exists() else None


def _http(url: str, body: dict | None = None, *, timeout: float = 600.0) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def _greedy(url: str) -> list[list[int]]:
    from reshard.testing.engines import MAX_TOKENS, PROMPTS

    out = []
    for prompt in PROMPTS:
        body = {
            "input_ids": [prompt],
            "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True},
        }
        out.append(list(_http(f"{url}/generate", body)[0]["output_ids"]))
    return out


def _checkpoint_bytes(path: Path) -> int:
    """Bytes of every tensor of a safetensors checkpoint (what a TP=1 worker keeps)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():  # noqa: SIM118 (safe_open has no __iter__)
                sl = sf.get_slice(key)
                n = 1
                for s in sl.get_shape():
                    n *= s
                total += n * (2 if sl.get_dtype() in ("BF16", "F16") else 4)
    return total


def _start_server(python: Path, model: Path, port: int, dtype: str, log: Path) -> subprocess.Popen:
    from reshard.adapters.sglang import HOOK

    cmd = [str(python), "-m", "sglang.launch_server", "--model-path", str(model), "--device", "cpu"]
    cmd += ["--attention-backend", "torch_native", "--sampling-backend", "pytorch", "--disable-cuda-graph"]
    cmd += ["--dtype", dtype, "--mem-fraction-static", "0.95", "--max-total-tokens", "2048"]
    cmd += ["--skip-server-warmup", "--random-seed", "0", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--custom-weight-loader", HOOK]
    env = dict(os.environ, PYTHONPATH=str(_REPO))
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health_generate", timeout=30) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the SGLang server did not start; see {log}")
        time.sleep(1)


def _stop(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_sglang_bench(
    *,
    size_mb: float = 256,
    trainers: int = 2,
    reps: int = 3,
    warmup: int = 1,
    dtype: str = "float32",
    workdir: str | None = None,
    python: str | None = None,
    say=print,
) -> dict[str, Any]:
    import torch

    from reshard.adapters.sglang import SglangEngines
    from reshard.testing.tiny import build_tiny_model
    from reshard.transport.group import GroupConfig

    py = sglang_python(python)
    if py is None:
        raise RuntimeError("no SGLang venv: run `make sglang-setup`, or pass --sglang-python")
    with eb.scratch(workdir, "reshard-sglang-bench-") as work:
        cfg_model = eb.model_config(size_mb, dtype)
        say(f"building two {size_mb:.0f} MB {dtype} checkpoints in {work} ...")
        engine_path = build_tiny_model(work / "v1", "qwen2", seed=0, **cfg_model)
        trainer_path = build_tiny_model(work / "v2", "qwen2", seed=7, **cfg_model)
        model_bytes = sum(f.stat().st_size for f in trainer_path.glob("*.safetensors"))
        kept = [_checkpoint_bytes(trainer_path)]

        port = eb.free_port()
        url = f"http://127.0.0.1:{port}"
        say(f"starting SGLang (TP=1, CPU) from {py} ...")
        server = _start_server(py, engine_path, port, dtype, work / "server.log")
        bench_address = f"127.0.0.1:{eb.free_port()}"
        refit_address = f"127.0.0.1:{eb.free_port()}"
        store = eb.bench_store(bench_address, host=True)
        store.set("bench/kept", json.dumps(kept))
        cfg: dict[str, Any] = {
            "trainers": trainers,
            "tp": 1,
            "reps": reps,
            "warmup": warmup,
            "dtype": dtype,
            "trainer_path": str(trainer_path),
            "bench_address": bench_address,
            "refit_address": refit_address,
            "pg_port": eb.free_port(),
            "parties": 1 + trainers + 1,
            "methods": METHODS,
        }
        torch.set_num_threads(1)
        procs: list[Any] = []
        rows: list[dict[str, Any]] = []
        tokens: dict[str, list] = {}
        try:
            _wait_healthy(url, server, work / "server.log")
            q, procs = eb.spawn_ranks(
                [(eb.trainer_rank, r, (cfg,)) for r in range(trainers)] + [(eb.raw_sink, 0, (cfg,))]
            )
            group = GroupConfig(address=refit_address, num_sources=trainers, num_destinations=1, timeout_s=600)
            engines = SglangEngines([url])
            engines.init(group)
            steps = eb.schedule(warmup, reps, METHODS)
            say(f"{len(steps)} timed steps ({warmup} warm-up round(s), then {reps}), methods alternating ...")
            refit = 0
            for step, (rep, method) in enumerate(steps):
                eb.barrier(store, step, cfg["parties"])
                row: dict[str, Any] = {"step": step, "rep": rep, "method": method, "warmup": rep < warmup}
                t0 = time.perf_counter()
                replies = []
                if method in eb.REFIT_METHODS:
                    refit += 1
                    replies = engines.refit(refit, method=eb.REFIT_METHODS[method])
                elif method == "reload":
                    out = _http(f"{url}/update_weights_from_disk", {"model_path": str(trainer_path)})
                    if not out.get("success"):
                        raise RuntimeError(f"update_weights_from_disk failed: {out}")
                t_end = time.perf_counter()
                row.update(
                    seconds=t_end - t0,
                    paused_seconds=(t_end - t0) if method != "raw_p2p" else 0.0,
                    flush_seconds=0.0,
                    # SGLang's apply is its post-load hook (the slices land in place).
                    workers=[{**r.stats, "apply_seconds": r.stats.get("post_load_seconds", 0.0)} for r in replies],
                )
                rows.append(row)
                if rep == warmup + reps - 1 and method != "raw_p2p":
                    tokens[method] = _greedy(url)
            results = eb.collect(q, procs, timeout=600)
        finally:
            eb.join_all(procs)
            _stop(server)
        eb.merge_ranks(rows, results)
        return eb.summarize(
            rows,
            tokens,
            kept,
            model_bytes,
            size_mb,
            1,
            trainers,
            dtype,
            reps,
            warmup,
            names=METHODS,
            engine="sglang tp=1 (CPU, server)",
        )
