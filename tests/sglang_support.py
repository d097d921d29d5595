"""Helpers for the SGLang tests (run in the main venv): SGLang servers in the
SGLang venv, FSDP2 trainer ranks, and one refit with both sides running.

Servers run ``python -m tests.sglang_serve`` with the SGLang venv's Python
(torch 2.14.1); trainer ranks are spawned processes of this venv (torch
2.13); they meet in one gloo refit group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from reshard.adapters.sglang import HOOK, SglangEngines

from .support import HANG_S, wait_for

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13, 4, 200, 31]]
MAX_TOKENS = 12


def sglang_python() -> Path | None:
    """The SGLang venv's Python: ``$RESHARD_SGLANG_VENV`` or ``.venv-sglang``."""
    venv = Path(os.environ.get("RESHARD_SGLANG_VENV") or REPO / ".venv-sglang")
    py = venv / "bin" / "python"
    return py if py.exists() else None


def _http(method: str, url: str, body: Any = None, timeout: float = 120.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, list) else x


class Server:
    """``python -m tests.sglang_serve`` on a tiny model, on CPU, with the reshard hook."""

    def __init__(
        self, python: Path, model: str | os.PathLike, *, tp: int, port: int, log: Path, dtype: str = "float32"
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.tp = tp
        self.log = log
        # On CPU SGLang sizes its KV cache from the machine's free memory before
        # and after loading (psutil's, the whole machine's): it refuses to start
        # ("no memory for the KV cache") when free memory dropped below
        # 1 - mem_fraction_static of what it was, whatever else on the machine
        # took it. A load that overlaps other engines (a CI clone beside) took
        # more than half once, so 0.95; --max-total-tokens sizes what it
        # allocates either way.
        args = [
            str(python), "-m", "tests.sglang_serve",
            "--model-path", str(model), "--device", "cpu", "--tp-size", str(tp), "--dtype", dtype,
            "--attention-backend", "torch_native", "--sampling-backend", "pytorch", "--disable-cuda-graph",
            "--mem-fraction-static", "0.95", "--max-total-tokens", "2048", "--max-running-requests", "4",
            "--chunked-prefill-size", "512", "--skip-server-warmup", "--random-seed", "0",
            "--log-level", "warning", "--host", "127.0.0.1", "--port", str(port),
            "--custom-weight-loader", HOOK,
        ]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        env.pop("SGLANG_USE_CPU_ENGINE", None)
        if tp > 1:
            env["RESHARD_SGLANG_CPU_TP"] = "1"
            env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
        self._logf = open(log, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            args, cwd=REPO, env=env, stdout=self._logf, stderr=subprocess.STDOUT, start_new_session=True
        )

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, budget_s: float = HANG_S) -> None:
        """Until the server generates a token (``/health_generate``); a server
        that exits fails at once."""

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                status, _ = _http("GET", self.url + "/health_generate", timeout=30)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                return False
            return status == 200

        try:
            wait_for(ready, budget_s, "the SGLang server to generate")
        except AssertionError as e:
            raise RuntimeError(f"{e}:\n{self.log_tail()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._logf.close()

    def generate(self, prompts=PROMPTS, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
        body = {
            "input_ids": prompts,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True},
        }
        status, out = _http("POST", self.url + "/generate", body, timeout=300)
        if status != 200:
            raise RuntimeError(f"generate: {status} {out}")
        return [o["output_ids"] for o in out]

    def stream(self, prompt: list[int], max_tokens: int, started: threading.Event, out: dict[str, Any]) -> None:
        """A streamed greedy generation: ``started`` is set at its first
        tokens; ``out`` gets its tokens and its last ``meta_info`` (or
        ``error``)."""
        body = {
            "input_ids": prompt,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True},
            "stream": True,
        }
        req = urllib.request.Request(
            self.url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        last: dict[str, Any] = {}
        try:
            with urllib.request.urlopen(req, timeout=HANG_S) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    last = json.loads(line[6:])
                    started.set()
            # Each chunk carries every token so far (SGLang's default, not incremental).
            out["tokens"], out["meta_info"] = last["output_ids"], last["meta_info"]
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
            started.set()

    def pause(self, mode: str) -> None:
        """``/pause_generation``: ``in_place`` freezes running requests where
        they are; ``retract`` moves them back to the waiting queue."""
        status, out = _http("POST", self.url + "/pause_generation", {"mode": mode})
        if status != 200:
            raise RuntimeError(f"pause_generation: {status} {out}")

    def resume(self) -> None:
        status, out = _http("POST", self.url + "/continue_generation", {})
        if status != 200:
            raise RuntimeError(f"continue_generation: {status} {out}")

    def running(self) -> int:
        """Requests the scheduler runs, as of its last step (``/v1/loads``;
        a paused scheduler takes no step, so it still counts a request it
        froze mid-generation)."""
        status, out = _http("GET", self.url + "/v1/loads?include=core")
        if status != 200:
            raise RuntimeError(f"v1/loads: {status} {out}")
        return sum(int(load["num_running_reqs"]) for load in out["loads"])

    def checksums(self) -> list[dict[str, str]]:
        """Per TP rank, SGLang's own checksum of every parameter (``/weights_checker``)."""
        status, out = _http("POST", self.url + "/weights_checker", {"action": "checksum"})
        if status != 200:
            raise RuntimeError(f"weights_checker: {status} {out}")
        ranks = [r for r in out.get("ranks") or [] if isinstance(r, dict) and "checksums" in r]
        if len(ranks) != self.tp:
            raise RuntimeError(f"weights_checker: unexpected reply {str(out)[:2000]}")
        # SGLang 0.5.23 sends parallelism_info as a one-element list.
        ranks.sort(key=lambda r: _first(r["parallelism_info"])["tp_rank"])
        return [r["checksums"] for r in ranks]

    def load_from_disk(self, path: str | os.PathLike) -> None:
        """SGLang's own refit from a checkpoint (``model.load_weights``): the reference."""
        status, out = _http("POST", self.url + "/update_weights_from_disk", {"model_path": str(path)}, timeout=300)
        if status != 200 or not out.get("success"):
            raise RuntimeError(f"update_weights_from_disk: {status} {out}")


def sglang_trainer_push(
    rank: int,
    world: int,
    pg_port: int,
    path: str,
    config: dict[str, Any],
    refit: int,
    mutate: str,
    drive: str,
    dtype: str = "float32",
) -> dict[str, Any]:
    """One FSDP2 trainer rank pushes ``path`` (held in ``dtype``) as refit
    ``refit``; with ``drive`` (a server URL), rank 0 also drives the server
    (the one-call path)."""
    from reshard import GroupConfig, Sender
    from tests.trainers import fsdp2_model, mutated_rename

    try:
        model = fsdp2_model(rank, world, pg_port, path, mutate=mutate, dtype=dtype)
        sender = Sender(model, config=GroupConfig(**config), rename=mutated_rename(mutate))
        try:
            if drive and rank == 0:
                st = sender.push(refit, engines=SglangEngines([drive]))
                engine_stats = [r.to_builtins() for r in sender.engine_replies]
            else:
                st = sender.push(refit)
                engine_stats = None
            return {"ok": True, "sent": st.exec.bytes_sent, "engine_stats": engine_stats}
        finally:
            sender.close()
    except Exception as e:
        return {"ok": False, "error": str(e), "step": getattr(e, "step", None)}


class Trainers:
    """``world`` FSDP2 trainer ranks (a process pool of this venv's torch)
    that push a checkpoint on request."""

    def __init__(self, world: int = 2) -> None:
        from tests import procs

        self.world = world
        self.pool = procs.Pool(world)
        self.port = procs.free_port()

    def start_push(
        self,
        path: str | os.PathLike,
        config: dict[str, Any],
        refit: int,
        mutate: str = "",
        drive: str = "",
        dtype: str = "float32",
    ) -> None:
        """Every rank pushes; with ``drive`` (a server URL), rank 0 drives it too."""
        self.pool.submit(sglang_trainer_push, self.world, self.port, str(path), config, refit, mutate, drive, dtype)

    def results(self, timeout: float = HANG_S) -> list[dict[str, Any]]:
        from tests import procs

        return procs.check(self.pool.wait(timeout))

    def close(self) -> None:
        self.pool.close()


def refit_with_trainers(
    server: Server,
    trainers: Trainers,
    address: str,
    path: str | os.PathLike,
    *,
    refit: int,
    generation: int,
    mutate: str = "",
    trainer_drives: bool = False,
    dtype: str = "float32",
) -> dict[str, Any]:
    """One refit: the trainer ranks push while the driver (here, or trainer
    rank 0 through ``Sender.push(engines=...)``) drives the server."""
    from reshard import GroupConfig
    from tests.support import group_kwargs

    config = group_kwargs(address, trainers.world, server.tp, generation=generation)
    if trainer_drives:
        trainers.start_push(path, config, refit, mutate, drive=server.url, dtype=dtype)
        results = trainers.results()
        return {
            "replies": results[0].get("engine_stats"),
            "error": None if all(r["ok"] for r in results) else results[0].get("error"),
            "trainers": results,
            "paused": False,
        }
    trainers.start_push(path, config, refit, mutate, dtype=dtype)
    engines = SglangEngines([server.url])
    engines.init(GroupConfig(**config))
    error: BaseException | None = None
    replies = None
    try:
        replies = [r.to_builtins() for r in engines.refit(refit)]
    except Exception as e:
        error = e
    return {"replies": replies, "error": error, "trainers": trainers.results(), "paused": engines.paused}
