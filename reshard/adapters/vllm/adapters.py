"""Driving adapter-only refits (:mod:`reshard.adapters.vllm.lora`) from a
trainer: :class:`VllmAdapters`, for ``Sender(LoraAdapter(model)).push(n,
engines=VllmAdapters([llm], "policy", adapter))``.

After each refit, :meth:`VllmAdapters.request` is the ``LoRARequest`` of the
new version (offline engines: ``llm.generate(..., lora_request=...)``) and
:meth:`VllmAdapters.model` its name on servers (the OpenAI API's ``model``).
Servers run with ``--enable-lora``, ``VLLM_SERVER_DEV_MODE=1``,
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` and reshard's worker extension.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

from reshard.adapters.core.fanout import fan_out
from reshard.adapters.core.replies import WorkerReply, raise_for_replies
from reshard.adapters.core.spec import GroupSpec
from reshard.adapters.vllm.driver import HttpEngine
from reshard.adapters.vllm.lora import lora_path, version_name
from reshard.errors import ReshardError
from reshard.sender.lora_adapter import AdapterSpec, LoraAdapter
from reshard.transport.group import GroupConfig
from reshard.transport.session import DEFAULT_BUDGET_BYTES

__all__ = ["VllmAdapters"]

log = logging.getLogger("reshard")

_IDS = itertools.count(1 << 20)
_IDS_LOCK = threading.Lock()
"""vLLM LoRA ids for offline engines, unique in this process (servers number their own)."""


class VllmAdapters:
    """One LoRA adapter, ``name``, refit into the LoRA slots of several vLLM
    engines (offline ``LLM`` objects, :class:`HttpEngine` or URLs) as one.
    Implements :class:`reshard.sender.engines.Engines`.

    ``adapter``: the trainer's :class:`LoraAdapter` (or its
    :class:`AdapterSpec`): the config and modules engines learn their slices
    from. ``keep``: versions each engine keeps loadable (the newest, and
    older ones for requests that started before a swap); older ones are
    retired after each refit. Each refit's replies say ``lora_name``,
    ``lora_path`` and bytes received per worker.

    ``colocated``: the engines are this trainer rank's own (one per rank,
    TRL's colocate mode): their workers take refit ranks ``num_sources`` +
    their vLLM rank, and the other ranks' engines make up the rest of
    ``num_destinations``."""

    def __init__(
        self,
        engines: Sequence[Any],
        name: str,
        adapter: LoraAdapter | AdapterSpec,
        *,
        keep: int = 2,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        colocated: bool = False,
    ) -> None:
        if not name or "/" in name or "@" in name:
            raise ValueError(f"adapter name {name!r} must be non-empty and contain no '/' or '@'")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.engines = [HttpEngine(e) if isinstance(e, str) else e for e in engines]
        if not self.engines:
            raise ValueError("VllmAdapters needs at least one engine")
        self.name = name
        self.spec = adapter.spec() if isinstance(adapter, LoraAdapter) else AdapterSpec.parse(adapter)
        self.keep = keep
        self.budget_bytes = budget_bytes
        self.colocated = colocated
        self.config: GroupConfig | None = None
        self.versions: list[tuple[int, int]] = []
        """``(refit, offline lora id)`` of the versions kept, oldest first."""

    # -- Engines -------------------------------------------------------------------

    def init(self, config: GroupConfig) -> None:
        offset = 0
        for e in self.engines:
            spec = GroupSpec.of(
                config, engine_offset=offset, budget_bytes=self.budget_bytes, with_token=not isinstance(e, HttpEngine)
            )
            replies = _replies(e, "reshard_lora_init", spec.to_json(), self.name, self.spec.to_json())
            raise_for_replies(replies, "reshard_lora_init")
            offset += 0 if self.colocated else len(replies)
        if not self.colocated and offset != config.num_destinations:
            raise ReshardError(
                f"the engines have {offset} workers but the refit group expects "
                f"num_destinations={config.num_destinations}"
            )
        self.config = config

    def refit(self, refit: int, *, method: str = "reshard") -> list[WorkerReply]:
        """Pull refit ``refit`` of the adapter into every engine's workers,
        register it as a new version on every engine, then make it the one
        :meth:`request` and :meth:`model` hand out. A failure leaves the
        previous version serving."""
        if self.config is None:
            raise RuntimeError("VllmAdapters.init must run before a refit")
        with _IDS_LOCK:
            lora_id = next(_IDS)

        def pull(e: Any) -> list[WorkerReply]:
            replies = _replies(e, "reshard_lora_pull", self.name, str(refit), str(lora_id), method)
            raise_for_replies(replies, "reshard_lora_pull", version=refit)
            return replies

        replies = [r for rs in fan_out(self.engines, pull, name="reshard-lora-pull") for r in rs]
        # Every worker of every engine holds the version: register it (a load
        # that fails here fails the refit; inside a generation step it would
        # kill the engine), then hand it out.
        for e in self.engines:
            _register(e, self.name, refit, lora_id)
        self.versions.append((refit, lora_id))
        self._retire()
        log.info(
            "adapter %r refit %d: %s on %d worker(s), %.1f MB received",
            self.name,
            refit,
            version_name(self.name, refit),
            len(replies),
            sum(int(r.stats.get("bytes_received", 0)) for r in replies) / 1e6,
        )
        return replies

    # -- what requests use ---------------------------------------------------------

    def request(self) -> Any:
        """The newest version's ``vllm.lora.request.LoRARequest`` (offline engines)."""
        from vllm.lora.request import LoRARequest

        if not self.versions:
            raise RuntimeError(f"adapter {self.name!r} has no version yet: refit it first")
        refit, lora_id = self.versions[-1]
        return LoRARequest(version_name(self.name, refit), lora_id, lora_path(self.name, refit))

    def model(self) -> str:
        """The newest version's name on a server (the OpenAI API's ``model``)."""
        if not self.versions:
            raise RuntimeError(f"adapter {self.name!r} has no version yet: refit it first")
        return version_name(self.name, self.versions[-1][0])

    def _retire(self) -> None:
        old, self.versions = self.versions[: -self.keep], self.versions[-self.keep :]
        if not old:
            return
        paths = [lora_path(self.name, refit) for refit, _ in old]
        for e in self.engines:
            try:
                for refit, lora_id in old:
                    _unregister(e, self.name, refit, lora_id)
                raise_for_replies(_replies(e, "reshard_lora_drop", json.dumps(paths)), "reshard_lora_drop")
            except Exception as err:  # the new version serves; an old one lingers
                log.warning("adapter %r: retiring versions %s on %r failed: %s", self.name, paths, e, err)


def _replies(engine: Any, method: str, *args: str) -> list[WorkerReply]:
    return [WorkerReply.parse(r) for r in engine.collective_rpc(method, args=args)]


def _register(engine: Any, name: str, refit: int, lora_id: int) -> None:
    """Make the version known to ``engine``: loaded into vLLM now, so that a
    broken version fails here and not in a generation step."""
    vname, path = version_name(name, refit), lora_path(name, refit)
    if isinstance(engine, HttpEngine):
        engine.post_json("/v1/load_lora_adapter", {"lora_name": vname, "lora_path": path})
        return
    from vllm.lora.request import LoRARequest

    if not engine.llm_engine.add_lora(LoRARequest(vname, lora_id, path)):
        raise ReshardError(f"engine {engine!r} did not load adapter version {vname} ({path})")


def _unregister(engine: Any, name: str, refit: int, lora_id: int) -> None:
    if isinstance(engine, HttpEngine):
        engine.post_json("/v1/unload_lora_adapter", {"lora_name": version_name(name, refit)})
        return
    engine.llm_engine.remove_lora(lora_id)
