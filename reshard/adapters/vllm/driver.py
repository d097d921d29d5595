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
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from reshard.adapters.core.fanout import fan_out
from reshard.adapters.core.replies import WorkerReply, raise_for_replies
from reshard.adapters.core.spec import GroupSpec
from reshard.errors import MixedWeightsError, ReshardError
from reshard.transport.group import GroupConfig
from reshard.transport.session import DEFAULT_BUDGET_BYTES

__all__ = ["HttpEngine", "VllmEngines", "init_workers", "pull_workers"]


def init_workers(engine, spec: GroupSpec | dict[str, Any]) -> list[WorkerReply]:
    """``reshard_init`` on every worker of ``engine``; returns their replies
    (``stats``: pieces, kept bytes, ...)."""
    spec = GroupSpec.parse(spec)
    replies = [WorkerReply.parse(r) for r in engine.collective_rpc("reshard_init", args=(spec.to_json(),))]
    raise_for_replies(replies, "reshard_init")
    return replies


def pull_workers(engine, refit: int, *, method: str = "reshard", atomic: bool | None = None) -> list[WorkerReply]:
    """``reshard_pull`` on every worker (trainer ranks push at the same time);
    raises one error if any worker failed."""
    replies = _pull_replies(engine, refit, method, atomic)
    raise_for_replies(replies, "reshard_pull", version=refit)
    return replies


def _pull_replies(engine, refit: int, method: str, atomic: bool | None) -> list[WorkerReply]:
    flag = "" if atomic is None else str(atomic).lower()
    return [WorkerReply.parse(r) for r in engine.collective_rpc("reshard_pull", args=(str(refit), method, flag))]


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
    succeeds, and :class:`reshard.errors.MixedWeightsError` names the engine.
    :attr:`mixed` lists them."""

    def __init__(
        self,
        engines: Sequence[Any],
        *,
        pause_mode: str = "wait",
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
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
        self.workers: list[list[WorkerReply]] = []
        self.config: GroupConfig | None = None

    def init(self, config: GroupConfig) -> None:
        self.workers = []
        offset = 0
        for e in self.engines:
            spec = GroupSpec.of(
                config,
                engine_offset=offset,
                budget_bytes=self.budget_bytes,
                atomic=self.atomic,
                # The job token never travels over HTTP: servers read
                # $RESHARD_TOKEN from their own environment.
                with_token=not isinstance(e, HttpEngine),
            )
            replies = init_workers(e, spec)
            self.workers.append(replies)
            offset += len(replies)
        if offset != config.num_destinations:
            raise ReshardError(
                f"the engines have {offset} workers ({', '.join(str(len(w)) for w in self.workers)} per engine) "
                f"but the refit group expects num_destinations={config.num_destinations}"
            )
        self.config = config

    def refit(self, refit: int, *, method: str = "reshard") -> list[WorkerReply]:
        if self.config is None:
            raise RuntimeError("VllmEngines.init must run before a refit")
        mixed: list[Any] = []

        def one(e: Any) -> list[WorkerReply]:
            server = isinstance(e, HttpEngine)
            if server:
                e.pause(self.pause_mode)
            replies: list[WorkerReply] = []
            try:
                replies = _pull_replies(e, refit, method, None)
                # Cached prefixes were computed with the old weights (and, after a
                # failed refit, the engine kept those weights: flushing is harmless).
                e.reset_prefix_cache()
            finally:
                if any(r.mixed for r in replies):
                    mixed.append(e)
                elif server:
                    # A server whose weights are half old, half new stays paused.
                    e.resume()
            try:
                raise_for_replies(replies, "reshard_pull", version=refit)
            except MixedWeightsError as err:
                err.paused = server
                err.args = (
                    f"{err.args[0]}\nengine {e!r} mixes old and new weights"
                    + (" and stays paused until a refit succeeds" if server else ""),
                )
                raise
            return replies

        try:
            return [r for replies in fan_out(self.engines, one, name="reshard-pull") for r in replies]
        finally:
            self.mixed = mixed
