"""Driving the worker extension from an RL driver, raising one clear error
when any worker failed.

- :func:`init_workers` / :func:`pull_workers`: one engine, anything with
  ``collective_rpc`` (an offline ``LLM``, or :class:`HttpEngine`).
- :class:`HttpEngine`: a ``vllm serve`` endpoint started with
  ``VLLM_SERVER_DEV_MODE=1`` and ``--worker-extension-cls
  reshard.adapters.vllm.ReshardWorkerExtension`` (``/collective_rpc``,
  ``/pause``, ``/resume``, ``/reset_prefix_cache`` are dev-mode routes in
  vLLM 0.32).
- :class:`VllmEngines`: several engines driven as one, for
  ``Sender.push(n, engines=VllmEngines([...]))``.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from reshard.errors import RefitError, ReshardError
from reshard.transport.group import GroupConfig

__all__ = ["HttpEngine", "VllmEngines", "init_workers", "pull_workers"]


def _check(replies: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
    bad = [r for r in replies if not r.get("ok")]
    if not bad:
        return replies
    first = bad[0]
    if first.get("step") and first.get("errors"):
        errors: dict[int, str] = {}
        for r in bad:
            errors.update({int(k): v for k, v in (r.get("errors") or {}).items()})
        raise RefitError(first["step"], errors)
    raise ReshardError(f"{what} failed on {len(bad)} worker(s): " + "; ".join(r["error"] for r in bad))


def init_workers(engine, config: dict[str, Any]) -> list[dict[str, Any]]:
    """``reshard_init`` on every worker of ``engine``; returns their summaries."""
    return _check(engine.collective_rpc("reshard_init", args=(json.dumps(config),)), "reshard_init")


def pull_workers(engine, refit: int, *, method: str = "reshard", atomic: bool | None = None) -> list[dict[str, Any]]:
    """``reshard_pull`` on every worker (trainer ranks push at the same time)."""
    return _check(_pull_replies(engine, refit, method, atomic), "reshard_pull")


def _pull_replies(engine, refit: int, method: str, atomic: bool | None) -> list[dict[str, Any]]:
    flag = "" if atomic is None else str(atomic).lower()
    return engine.collective_rpc("reshard_pull", args=(str(refit), method, flag))


class HttpEngine:
    """A ``vllm serve`` endpoint (``http://host:port``) in dev mode."""

    def __init__(self, url: str, *, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"HttpEngine({self.url!r})"

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(
            self.url + path, data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                text = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            hint = " (is the server running with VLLM_SERVER_DEV_MODE=1?)" if e.code == 404 else ""
            raise ReshardError(f"vLLM server {self.url}: POST {path} failed with HTTP {e.code}{hint}: {detail}") from e
        except OSError as e:
            raise ReshardError(f"vLLM server {self.url}: POST {path} failed: {e}") from e
        return json.loads(text) if text.strip() else None

    def collective_rpc(self, method: str, args: Sequence[Any] = (), timeout: float | None = None) -> list[Any]:
        """Every worker's reply; the HTTP route passes string arguments only."""
        body: dict[str, Any] = {"method": method, "args": [a if isinstance(a, str) else json.dumps(a) for a in args]}
        if timeout is not None:
            body["timeout"] = timeout
        out = self._post("/collective_rpc", body)
        return list((out or {}).get("results", []))

    def pause(self, mode: str = "wait") -> None:
        """``wait``: finish requests in flight first; ``keep``: freeze them
        (they continue on the new weights); ``abort``: drop them."""
        self._post(f"/pause?mode={mode}")

    def resume(self) -> None:
        self._post("/resume")

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache")


class VllmEngines:
    """Several vLLM engines (offline ``LLM`` objects, :class:`HttpEngine` or
    URLs) refit as one: engine ``i``'s workers take the refit ranks after
    engine ``i - 1``'s. Implements :class:`reshard.sender.engines.Engines`.

    ``pause_mode``: how requests in flight are handled around a swap on
    servers (``wait``, ``keep`` or ``abort``; offline engines generate only
    when their owner calls them). ``budget_bytes`` caps each worker's
    staging. ``atomic``: every worker keeps all its old weights when a refit
    fails, at the cost of one materialized copy of its weights during the
    refit (see :meth:`reshard.adapters.vllm.receiver.VllmReceiver.pull`).

    A job token (``GroupConfig.token``) is handed to offline engines; servers
    read ``$RESHARD_TOKEN`` from their own environment instead.

    Without ``atomic``, a refit that fails after some layers took their new
    weights leaves a worker *mixed*; a server with such a worker stays
    paused (it queues requests and generates nothing) until a refit
    succeeds, and the error names the engine. :attr:`mixed` lists them."""

    def __init__(
        self,
        engines: Sequence[Any],
        *,
        pause_mode: str = "wait",
        budget_bytes: int | None = None,
        atomic: bool = False,
    ) -> None:
        if pause_mode not in ("wait", "keep", "abort"):
            raise ValueError(f"pause_mode {pause_mode!r}: use 'wait', 'keep' or 'abort'")
        self.engines = [HttpEngine(e) if isinstance(e, str) else e for e in engines]
        if not self.engines:
            raise ValueError("VllmEngines needs at least one engine")
        self.pause_mode = pause_mode
        self.budget_bytes = budget_bytes
        self.atomic = atomic
        self.mixed: list[Any] = []
        self.workers: list[list[dict[str, Any]]] = []
        self.config: GroupConfig | None = None

    def init(self, config: GroupConfig) -> None:
        base = {k: v for k, v in asdict(config).items() if k not in ("host_store", "store_bind") and v is not None}
        if self.budget_bytes is not None:
            base["budget_bytes"] = self.budget_bytes
        base["atomic"] = self.atomic
        self.workers = []
        offset = 0
        for e in self.engines:
            cfg = {**base, "engine_offset": offset}
            if isinstance(e, HttpEngine):
                # The job token never travels over HTTP: servers read
                # $RESHARD_TOKEN from their own environment.
                cfg.pop("token", None)
            summaries = init_workers(e, cfg)
            self.workers.append(summaries)
            offset += len(summaries)
        if offset != config.num_destinations:
            raise ReshardError(
                f"the engines have {offset} workers ({', '.join(str(len(w)) for w in self.workers)} per engine) "
                f"but the refit group expects num_destinations={config.num_destinations}"
            )
        self.config = config

    def refit(self, refit: int, *, method: str = "reshard") -> list[dict[str, Any]]:
        if self.config is None:
            raise RuntimeError("VllmEngines.init must run before a refit")
        servers: list[HttpEngine] = []  # the ones paused so far
        results: list[list[dict[str, Any]] | None] = [None] * len(self.engines)
        errors: list[BaseException] = []
        mixed: list[Any] = []
        try:
            for e in self.engines:
                if isinstance(e, HttpEngine):
                    e.pause(self.pause_mode)
                    servers.append(e)

            def pull(i: int) -> None:
                try:
                    replies = _pull_replies(self.engines[i], refit, method, None)
                    if any(r.get("mixed") for r in replies):
                        mixed.append(self.engines[i])
                    results[i] = _check(replies, "reshard_pull")
                except BaseException as e:
                    errors.append(e)

            threads = [
                threading.Thread(target=pull, args=(i,), name=f"reshard-pull-{i}", daemon=True)
                for i in range(len(self.engines))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            # Cached prefixes were computed with the old weights (and, after a
            # failed refit, the engine kept those weights: flushing is harmless).
            for e in self.engines:
                e.reset_prefix_cache()
        finally:
            self.mixed = mixed
            # A server whose weights are half old, half new stays paused.
            for s in servers:
                if s not in mixed:
                    s.resume()
        if errors:
            if mixed:
                raise ReshardError(
                    f"refit {refit} failed after some layers took their new weights on {mixed}; "
                    "servers among them stay paused until a refit succeeds"
                ) from errors[0]
            raise errors[0]
        return [w for r in results for w in (r or [])]
