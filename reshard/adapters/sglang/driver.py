"""Drive refits of a running SGLang server over its HTTP API, in one call.

``SglangEngine(url).refit(n, config)`` runs, against one server:

1. ``POST /pause_generation`` (mode ``retract`` by default: running requests
   go back to the queue and are recomputed with the new weights);
2. ``POST /begin_weight_update``;
3. ``POST /update_weights_from_tensor`` with ``load_format`` = the reshard
   hook and a ``pull`` command: every TP worker pulls its slices of refit
   ``n`` straight from the trainer ranks (which call ``Sender.push(n)`` at
   the same time), then SGLang flushes its KV / radix cache;
4. ``POST /end_weight_update`` (SGLang's post-processing, TP barrier);
5. reads every worker's reply from the refit store;
6. ``POST /continue_generation``, unless the refit failed after bytes
   landed: then the engine stays paused (it would serve a mix of old and
   new weights) and :class:`MixedWeightsError` says so.

The call blocks until the workers are done, so the trainer side must push
concurrently. :class:`SglangEngines` is the :class:`reshard.sender.engines.Engines`
of one or more servers: ``sender.push(n, engines=SglangEngines([url]))`` on
one trainer rank does both (other ranks call ``sender.push(n)``). By hand:
:meth:`SglangEngine.refit_async` (a future), then ``sender.push(n)``.

The driver needs ``torch`` (to build the payload SGLang unpickles and to
read the refit store) but not SGLang.
"""

from __future__ import annotations

import base64
import concurrent.futures
import datetime
import io
import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from reshard.adapters.core.fanout import fan_out
from reshard.adapters.core.replies import WorkerReply
from reshard.adapters.core.servers import replica_offsets, unreachable_line
from reshard.adapters.core.spec import GroupSpec
from reshard.adapters.sglang import protocol
from reshard.adapters.sglang.protocol import Command
from reshard.errors import MixedWeightsError, RefitError, ReshardError, ServerUnreachable
from reshard.transport.config import parse_address
from reshard.transport.session import DEFAULT_BUDGET_BYTES

if TYPE_CHECKING:
    from reshard.transport.group import GroupConfig

__all__ = ["HOOK", "SglangEngine", "SglangEngines"]

HOOK = "reshard.adapters.sglang.hook.load"
"""The custom weight loader to register: ``--custom-weight-loader reshard.adapters.sglang.hook.load``."""


def command_payload(cmd: Command) -> str:
    """Base64 of the pickled ``[(command, empty tensor)]`` SGLang expects per TP rank."""
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing  # registers the tensor reductions with ForkingPickler

    buf = io.BytesIO()
    placeholder = torch.empty(0)  # host: the tensor SGLang's API wants beside the command
    ForkingPickler(buf, 4).dump([(protocol.encode_command(cmd), placeholder)])
    return base64.b64encode(buf.getvalue()).decode()


class SglangEngine:
    """One SGLang server, started with ``--custom-weight-loader`` :data:`HOOK`."""

    def __init__(
        self,
        url: str,
        *,
        engine_offset: int = 0,
        tp_size: int | None = None,
        api_key: str | None = None,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> None:
        """``engine_offset``: refit ranks of this engine's workers start at
        ``num_sources + engine_offset`` (several engines share one refit
        group). ``tp_size``: read from ``/server_info`` when not given."""
        self.url = url.rstrip("/")
        self.engine_offset = engine_offset
        self.api_key = api_key
        self.budget_bytes = budget_bytes
        self._tp_size = tp_size
        self.paused = False
        self.last_replies: list[WorkerReply] = []

    # -- HTTP --------------------------------------------------------------------

    def _call(self, method: str, path: str, body: dict | None = None, *, timeout: float = 60.0) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            # Refused, reset, timed out: the server is down.
            raise ServerUnreachable(f"SGLang server {self.url}: {method} {path} failed: {e}") from e
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def _post_ok(self, path: str, body: dict | None = None, *, timeout: float = 60.0) -> tuple[bool, str]:
        status, out = self._call("POST", path, body if body is not None else {}, timeout=timeout)
        ok = status == 200 and (not isinstance(out, dict) or out.get("success", True))
        msg = out.get("message", "") if isinstance(out, dict) else str(out)
        return ok, msg

    @property
    def tp_size(self) -> int:
        if self._tp_size is None:
            status, info = self._call("GET", "/server_info")
            if status != 200 or not isinstance(info, dict) or "tp_size" not in info:
                raise ReshardError(f"SGLang server {self.url}: cannot read tp_size from /server_info ({status})")
            if int(info.get("pp_size", 1) or 1) != 1 or int(info.get("dp_size", 1) or 1) != 1:
                raise ReshardError(f"SGLang server {self.url}: only TP is supported (pp_size and dp_size must be 1)")
            self._tp_size = int(info["tp_size"])
        return self._tp_size

    def pause(self, mode: str = "retract") -> None:
        ok, msg = self._post_ok("/pause_generation", {"mode": mode})
        if not ok:
            raise ReshardError(f"SGLang server {self.url}: pause_generation failed: {msg}")
        self.paused = True

    def resume(self) -> None:
        ok, msg = self._post_ok("/continue_generation", {})
        if not ok:
            raise ReshardError(f"SGLang server {self.url}: continue_generation failed: {msg}")
        self.paused = False

    # -- refits ------------------------------------------------------------------

    def refit(
        self,
        refit: int,
        config: GroupConfig,
        *,
        method: str = "reshard",
        pause: str | None = "retract",
        flush_cache: bool = True,
    ) -> list[WorkerReply]:
        """Refit ``refit`` of every worker of this engine (see the module
        docstring). ``pause``: ``retract``, ``abort``, ``in_place`` or
        ``None`` (then the update waits for in-flight requests to finish).
        Returns every worker's :class:`~reshard.adapters.core.replies.WorkerReply`; raises :class:`RefitError`
        (weights unchanged) or :class:`MixedWeightsError`."""
        spec = GroupSpec.of(config, engine_offset=self.engine_offset, budget_bytes=self.budget_bytes)
        cmd = Command(op="pull", id=uuid.uuid4().hex, group=spec, refit=refit, method=method)
        return self._run(cmd, pause, flush_cache)

    def refit_async(
        self, refit: int, config: GroupConfig, **kwargs: Any
    ) -> concurrent.futures.Future[list[WorkerReply]]:
        """:meth:`refit` in a background thread."""
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-sglang")
        fut = pool.submit(self.refit, refit, config, **kwargs)
        pool.shutdown(wait=False)
        return fut

    def state(self, config: GroupConfig) -> list[dict[str, str]]:
        """Per TP worker, a digest of every tensor the model's forward pass may
        read, by module path (:func:`reshard.adapters.core.state.model_state`):
        compare a refit server's with a fresh one's
        (:func:`reshard.adapters.core.state.compare_states`). Runs in an update
        session of its own, with generation running."""
        spec = GroupSpec.of(config, engine_offset=self.engine_offset, budget_bytes=self.budget_bytes)
        replies = self._run(Command(op="state", id=uuid.uuid4().hex, group=spec), None, False)
        return [r.stats["state"] for r in sorted(replies, key=lambda r: r.tp_rank)]

    def close(self, config: GroupConfig) -> list[WorkerReply]:
        """Make every worker leave the refit group (a session of its own)."""
        spec = GroupSpec.of(config, engine_offset=self.engine_offset, budget_bytes=self.budget_bytes)
        return self._run(Command(op="close", id=uuid.uuid4().hex, group=spec), None, False)

    def _run(self, cmd: Command, pause: str | None, flush_cache: bool) -> list[WorkerReply]:
        tp = self.tp_size
        spec = cmd.group
        if pause:
            self.pause(pause)
        ok, msg = self._post_ok("/begin_weight_update", {})
        if not ok:
            if pause:
                self.resume()
            raise ReshardError(f"SGLang server {self.url}: begin_weight_update failed: {msg}")
        payload = command_payload(cmd)
        body = {
            "serialized_named_tensors": [payload] * tp,
            "load_format": HOOK,
            "flush_cache": flush_cache,
        }
        # join + plan + transfer + outcome can each take up to the group timeout.
        http_error = ""
        try:
            ok, msg = self._post_ok("/update_weights_from_tensor", body, timeout=4 * spec.timeout_s + 60)
            if not ok:
                http_error = msg
        except ReshardError as e:
            http_error = str(e)
        ok_end, msg_end = self._post_ok("/end_weight_update", {})
        replies = self._replies(cmd, tp, wait_s=5.0 if not http_error else 1.0)
        self.last_replies = replies
        bad = [r for r in replies if not r.ok]
        missing = tp - len(replies)
        mixed = any(r.mixed for r in replies) or (missing > 0 and cmd.op == "pull")
        if not bad and not missing and ok_end:
            # Every worker has the new weights. SGLang fails the update call
            # when its cache flush was refused (requests still running): retry it.
            if http_error and flush_cache:
                ok, msg = self._post_ok("/flush_cache", None)
                if not ok:
                    if pause:
                        self.resume()
                    raise ReshardError(
                        f"SGLang server {self.url}: the weights were updated, but the KV cache was not flushed "
                        f"({http_error}; /flush_cache: {msg})"
                    )
            if pause:
                self.resume()
            return replies
        errors: dict[int, str] = {}
        step = next((r.step for r in bad if r.step), None) or "sglang"
        for r in bad:
            errors.update(r.errors or {r.rank: r.error})
        have = {r.rank for r in replies}
        for t in range(tp):
            rank = spec.rank_of(t)
            if rank not in have:
                errors[rank] = f"TP worker {t} posted no reply (SGLang: {http_error or 'no error'})"
        if http_error and not errors:
            errors[spec.rank_of(0)] = f"update_weights_from_tensor: {http_error}"
        if not ok_end:
            errors.setdefault(spec.rank_of(0), f"end_weight_update: {msg_end}")
        if mixed:
            err = MixedWeightsError(step, errors, version=cmd.refit or None)
            err.paused = bool(pause)
            raise err
        if pause:
            self.resume()
        raise RefitError(step, errors, version=cmd.refit or None)

    def _replies(self, cmd: Command, tp: int, *, wait_s: float) -> list[WorkerReply]:
        from torch.distributed import PrefixStore, TCPStore

        spec = cmd.group
        host, port = parse_address(spec.address)
        try:
            tcp = TCPStore(
                host,
                port,
                None,
                False,
                timeout=datetime.timedelta(seconds=30),
                wait_for_workers=False,
                use_libuv=True,
            )
        except Exception as e:
            raise ReshardError(f"cannot reach the refit store at {spec.address} to read the replies: {e}") from e
        store = PrefixStore(protocol.reply_prefix(spec.job), tcp)
        keys = [protocol.reply_key(cmd.id, spec.rank_of(t)) for t in range(tp)]
        deadline = time.monotonic() + wait_s
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.02)
        out = []
        for k in keys:
            if store.check([k]):
                out.append(protocol.reply_decoder.decode(store.get(k)))
                store.delete_key(k)
        return out


class SglangEngines:
    """SGLang servers as :class:`reshard.sender.engines.Engines`: ``sender.push(n,
    engines=SglangEngines(["http://engine-0:30000", ...]))``. Engine ``i``'s
    workers take the refit ranks after engine ``i-1``'s; all engines are
    refitted concurrently, each paused, updated, flushed and resumed.

    With ``GroupConfig.min_replicas`` (an elastic group) server ``i`` is
    replica ``i`` (``replica_size``: set from the servers' TP size when left
    ``None``; every server must have the same), and a server that cannot be
    reached does not fail the push: the live ones are refit and
    :attr:`unreachable` names it (replica -> URL and error; ``Sender.push``
    adds it to its stats' ``missing_replicas``). It stays out of this
    object's refits. Without ``min_replicas`` it fails the push, naming its URL."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        pause: str | None = "retract",
        api_key: str | None = None,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        self.engines = [SglangEngine(u, api_key=api_key, budget_bytes=budget_bytes) for u in urls]
        self.pause = pause
        self.config: GroupConfig | None = None
        self.unreachable: dict[int, str] = {}
        """Elastic groups: the servers found down (replica index -> URL and error)."""

    @property
    def paused(self) -> bool:
        return any(e.paused for e in self.engines)

    def init(self, config: GroupConfig) -> None:
        self.unreachable = {}
        if config.min_replicas is not None:

            def size(i: int) -> int | None:
                try:
                    return self.engines[i].tp_size
                except ServerUnreachable as err:
                    self.unreachable[i] = unreachable_line(self.engines[i].url, err)
                    return None

            sizes = fan_out(range(len(self.engines)), size, name="reshard-probe")
            offsets = replica_offsets(config, sizes, [e.url for e in self.engines])
            for e, offset in zip(self.engines, offsets, strict=True):
                e.engine_offset = offset
            self.config = config
            return
        offset = 0
        for e in self.engines:
            e.engine_offset = offset
            offset += e.tp_size
        if offset != config.num_destinations:
            raise ReshardError(
                f"the SGLang servers have {offset} TP workers in all, the refit group expects "
                f"num_destinations={config.num_destinations}"
            )
        self.config = config

    def refit(self, refit: int, *, method: str = "reshard") -> list[WorkerReply]:
        if self.config is None:
            raise ReshardError("call init(config) before refit")
        config = self.config
        elastic = config.min_replicas is not None

        def one(i: int) -> list[WorkerReply]:
            e = self.engines[i]
            try:
                return e.refit(refit, config, method=method, pause=self.pause)
            except ServerUnreachable as err:
                if not elastic:
                    raise
                self.unreachable[i] = unreachable_line(e.url, err)
                return []

        live = [i for i in range(len(self.engines)) if i not in self.unreachable]
        replies = fan_out(live, one, name="reshard-sglang")
        return [r for rs in replies for r in rs]
