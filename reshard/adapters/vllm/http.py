"""A ``vllm serve`` endpoint driven over HTTP: :class:`HttpEngine`.

The server runs with ``VLLM_SERVER_DEV_MODE=1`` and ``--worker-extension-cls
reshard.adapters.vllm.ReshardWorkerExtension`` (``/collective_rpc``,
``/pause``, ``/resume``, ``/reset_prefix_cache`` are dev-mode routes in vLLM
0.32). A server that cannot be reached (refused, reset, timed out) raises
:class:`~reshard.errors.ServerUnreachable`; an HTTP error, :class:`ReshardError`.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from reshard.errors import ReshardError, ServerUnreachable

__all__ = ["HttpEngine"]

log = logging.getLogger("reshard")


class HttpEngine:
    """A ``vllm serve`` endpoint (``http://host:port``) in dev mode."""

    def __init__(self, url: str, *, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._version: str | None = None

    def version(self) -> str | None:
        """The server's vLLM version (``GET /version``; ``None`` if it does not say)."""
        if self._version is None:
            try:
                with urllib.request.urlopen(self.url + "/version", timeout=self.timeout_s) as resp:
                    self._version = str(json.loads(resp.read()).get("version") or "") or None
            except (OSError, ValueError) as e:
                log.warning("vLLM server %s: GET /version failed (%s); assuming a recent vLLM", self.url, e)
        return self._version

    def __repr__(self) -> str:
        return f"HttpEngine({self.url!r})"

    def _post(
        self, path: str, body: dict[str, Any] | None = None, *, text: bool = False, timeout_s: float | None = None
    ) -> Any:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(
            self.url + path, data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            hint = " (is the server running with VLLM_SERVER_DEV_MODE=1?)" if e.code == 404 else ""
            raise ReshardError(f"vLLM server {self.url}: POST {path} failed with HTTP {e.code}{hint}: {detail}") from e
        except OSError as e:
            # Refused, reset, timed out: the server is down (ServerUnreachable).
            raise ServerUnreachable(f"vLLM server {self.url}: POST {path} failed: {e}") from e
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:
            if text:
                return raw.decode(errors="replace")
            raise

    def post_json(self, path: str, body: dict[str, Any]) -> Any:
        """``POST path`` with a JSON body; the server's answer, JSON or text
        (vLLM's LoRA routes answer text); HTTP errors raise, naming the server."""
        return self._post(path, body, text=True)

    def collective_rpc(self, method: str, args: Sequence[Any] = (), timeout: float | None = None) -> list[Any]:
        """Every worker's reply; the HTTP route passes string arguments only."""
        body: dict[str, Any] = {"method": method, "args": [a if isinstance(a, str) else json.dumps(a) for a in args]}
        if timeout is not None:
            body["timeout"] = timeout
        out = self._post("/collective_rpc", body)
        return list((out or {}).get("results", []))

    def workers(self, timeout_s: float = 30.0) -> int:
        """How many workers the server runs (its TP x PP size), asked with a
        short timeout: :class:`ServerUnreachable` when it is down."""
        out = self._post("/collective_rpc", {"method": "reshard_status", "args": []}, timeout_s=timeout_s)
        return len((out or {}).get("results", []))

    def pause(self, mode: str = "wait", *, clear_cache: bool = True) -> None:
        """``wait``: finish requests in flight first; ``keep``: freeze them
        (they continue on the new weights); ``abort``: drop them.
        ``clear_cache=False``: keep the KV and prefix caches (vLLM drops them
        by default, which in ``keep`` mode preempts the frozen requests: they
        are recomputed when they resume)."""
        self._post(f"/pause?mode={mode}" + ("" if clear_cache else "&clear_cache=false"))

    def resume(self) -> None:
        self._post("/resume")

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's ``/reset_prefix_cache``: whether it dropped every cached
        prefix (it cannot while requests hold KV blocks, unless
        ``reset_running_requests``, which preempts them: they are computed
        again when they run next)."""
        query = "?reset_running_requests=true" if reset_running_requests else ""
        out = self._post("/reset_prefix_cache" + query)
        return bool((out or {}).get("success", True)) if isinstance(out, dict) else True

    def sleep(self, level: int = 1) -> None:
        """vLLM's ``/sleep`` (dev mode): level 1 offloads the weights and
        drops the KV cache, level 2 drops both (on a GPU; on CPU vLLM 0.32's
        worker keeps both and only the engine's state changes)."""
        self._post(f"/sleep?level={int(level)}")

    def wake_up(self, tags: Sequence[str] | None = None) -> bool:
        """vLLM's ``/wake_up``; whether the engine is fully awake after it."""
        query = "&".join(f"tags={t}" for t in tags or ())
        out = self._post("/wake_up" + (f"?{query}" if query else ""))
        return (out or {}).get("status") == "awake"

    def is_sleeping(self) -> bool:
        """vLLM's ``/is_sleeping``: asleep at any level (or paused)."""
        req = urllib.request.Request(self.url + "/is_sleeping", method="GET")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return bool(json.loads(resp.read()).get("is_sleeping"))
        except (OSError, ValueError) as e:
            raise ReshardError(f"vLLM server {self.url}: GET /is_sleeping failed: {e}") from e
