"""Driving adapter-only refits (:mod:`reshard.adapters.vllm.lora`) from a
trainer: :class:`VllmAdapters`, for ``Sender(LoraAdapter(model)).push(n,
engines=VllmAdapters([llm], "policy", adapter))``.

After each refit, :meth:`VllmAdapters.request` is the ``LoRARequest`` of the
new version (offline engines: ``llm.generate(..., lora_request=...)``) and
:meth:`VllmAdapters.model` its name on servers (the OpenAI API's ``model``).
Servers run with ``--enable-lora``, ``VLLM_SERVER_DEV_MODE=1``,
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` and reshard's worker extension.

One refit, on every engine (each call into an engine is short, so it keeps
generating throughout but for the registration):

1. stage: each worker first drops the versions older than the ``keep``
   newest that no request names, as its engine core reports them
   (:mod:`reshard.adapters.vllm.lora_versions`), then starts receiving the
   new version in a thread of its own; a worker that would hold more than
   ``max_versions`` versions refuses the refit on every rank (trainer ranks
   included) before any byte moves, naming the requests that hold old
   versions;
2. the driver polls until every worker has it (each keeps it then);
3. commit: the version is registered in vLLM (a version that cannot load
   fails the refit here, not in a generation step) and becomes the one
   :meth:`VllmAdapters.request` hands out; servers stop accepting the
   version that left the ``keep`` newest.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from reshard.adapters.core.fanout import fan_out
from reshard.adapters.core.replies import WorkerReply, raise_for_replies
from reshard.adapters.core.spec import GroupSpec
from reshard.adapters.vllm.driver import HttpEngine
from reshard.adapters.vllm.lora_versions import RETIRE, STAGE, install_core_report, lora_path, version_name
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
    from. ``keep``: the newest versions handed out to new requests (a
    ``LoRARequest`` or server model name taken before a refit stays valid
    for ``keep - 1`` more). An older version lives on as long as any request
    (waiting, running or preempted) names it, however many refits later,
    and is freed at the first refit (or :meth:`retire`) after its last
    request finished. ``max_versions`` (default ``keep + 2``): versions each
    worker holds at most; a refit that would exceed it is refused on every
    rank before any byte moves, naming the requests that hold old versions,
    and the newest version keeps serving. Each version costs each worker its
    slices of the adapter (``kept_bytes`` in the replies), in host memory.
    Each refit's replies say ``lora_name``, ``lora_path``, bytes received,
    and the versions the worker holds (``versions``, ``versions_bytes``,
    ``held``: versions requests keep alive, by request id).

    ``poll_s``: the longest wait between two polls of the workers while
    they receive (each poll is one short call between two engine steps).

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
        max_versions: int | None = None,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        colocated: bool = False,
        poll_s: float = 0.01,
    ) -> None:
        if not name or "/" in name or "@" in name:
            raise ValueError(f"adapter name {name!r} must be non-empty and contain no '/' or '@'")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        max_versions = keep + 2 if max_versions is None else max_versions
        if max_versions <= keep:
            raise ValueError(
                f"max_versions={max_versions} leaves no room for a new version beside the keep={keep} newest"
            )
        if poll_s <= 0:
            raise ValueError(f"poll_s must be positive, got {poll_s}")
        self.engines = [HttpEngine(e) if isinstance(e, str) else e for e in engines]
        if not self.engines:
            raise ValueError("VllmAdapters needs at least one engine")
        self.name = name
        self.spec = adapter.spec() if isinstance(adapter, LoraAdapter) else AdapterSpec.parse(adapter)
        self.keep = keep
        self.max_versions = max_versions
        self.budget_bytes = budget_bytes
        self.colocated = colocated
        self.poll_s = poll_s
        self.config: GroupConfig | None = None
        self.versions: list[tuple[int, int]] = []
        """``(refit, offline lora id)`` of the ``keep`` newest versions, oldest first."""
        self.held: dict[str, list[str]] = {}
        """Older versions requests keep alive (version name -> request ids), as
        the last retire found them on any worker."""
        self.versions_bytes = 0
        """Bytes of the versions the busiest worker holds, as last reported."""
        self._staging: tuple[int, int] | None = None
        self._staged: list[WorkerReply] = []

    # -- Engines -------------------------------------------------------------------

    def init(self, config: GroupConfig) -> None:
        if not all(isinstance(e, HttpEngine) for e in self.engines):
            # An engine core in this process reports its requests' adapters
            # (reshard's plugin does it in an engine core process of its own).
            install_core_report()
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
        """Refit ``refit`` of the adapter into every engine as a new version
        (:meth:`stage`, :meth:`staged` until every worker has it,
        :meth:`commit`); the engines keep generating throughout, but for the
        registration. A failure leaves the previous version serving."""
        t0 = time.perf_counter()
        self.stage(refit, method=method)
        wait = self.poll_s / 4
        while not self.staged(refit):
            time.sleep(wait)
            wait = min(self.poll_s, wait * 2)
        replies = self.commit(refit)
        for r in replies:
            r.stats["engine_seconds"] = time.perf_counter() - t0
        return replies

    def stage(self, refit: int, *, method: str = "reshard") -> list[WorkerReply]:
        """Start every engine's workers receiving refit ``refit`` (trainer
        ranks push it at the same time) and return at once; the engines keep
        generating. Each worker first retires what no request uses (as
        :meth:`retire`, in the same call). A worker without room for another
        version refuses the refit: every rank raises
        :class:`reshard.RefitError` (step ``enter``), surfaced here by
        :meth:`staged`."""
        if self.config is None:
            raise RuntimeError("VllmAdapters.init must run before a refit")
        with _IDS_LOCK:
            lora_id = next(_IDS)
        self._staging = (refit, lora_id)
        self._staged = []
        keep = self._keep()
        replies: list[WorkerReply] = []
        for e in self.engines:
            rs = _replies(e, STAGE, self.name, str(refit), str(lora_id), method, str(self.max_versions), keep)
            raise_for_replies(rs, STAGE, version=refit)
            replies += rs
        self._retired(replies)
        return replies

    def staged(self, refit: int) -> bool:
        """Whether every worker of every engine holds refit ``refit`` (one
        short call per engine; a worker keeps the version once it has it);
        raises the refit's error if it failed."""
        if self._staging is None or self._staging[0] != refit:
            raise RuntimeError(f"adapter {self.name!r}: refit {refit} was not staged")
        replies: list[WorkerReply] = []
        for e in self.engines:
            rs = _replies(e, "reshard_lora_staged", self.name, str(refit))
            raise_for_replies(rs, STAGE, version=refit)
            replies += rs
        done = all(r.stats.get("staged") for r in replies)
        if done:
            self._staged = replies
        return done

    def commit(self, refit: int) -> list[WorkerReply]:
        """Register staged refit ``refit`` on every engine (a version that
        cannot load fails the refit here; inside a generation step it would
        kill the engine), then hand it out; returns every worker's account
        of the refit (``register_seconds``: the registration, the only part
        that stops the engines)."""
        if self._staging is None or self._staging[0] != refit or not self._staged:
            raise RuntimeError(f"adapter {self.name!r}: refit {refit} was not staged (or is still being received)")
        lora_id = self._staging[1]
        replies, self._staging, self._staged = self._staged, None, []
        t0 = time.perf_counter()
        fan_out(self.engines, lambda e: _register(e, self.name, refit, lora_id), name="reshard-lora-register")
        for r in replies:
            r.stats["register_seconds"] = time.perf_counter() - t0
        self.versions.append((refit, lora_id))
        old, self.versions = self.versions[: -self.keep], self.versions[-self.keep :]
        for e in self.engines:
            for gone, _ in old:
                _unregister(e, self.name, gone)
        self.versions_bytes = max(int(r.stats.get("versions_bytes", 0)) for r in replies)
        log.info(
            "adapter %r refit %d: %s on %d worker(s), %.1f MB received; %d version(s) kept, %.1f MB per worker",
            self.name,
            refit,
            version_name(self.name, refit),
            len(replies),
            sum(int(r.stats.get("bytes_received", 0)) for r in replies) / 1e6,
            max(len(r.stats.get("versions", ())) for r in replies),
            self.versions_bytes / 1e6,
        )
        return replies

    def retire(self) -> list[WorkerReply]:
        """Free, on every worker, the versions older than the ``keep`` newest
        that no request names now (the engine core's account, taken between
        two steps); :attr:`held` says which requests keep the others alive.
        Every refit starts with it; call it to free memory between refits."""
        if self.config is None:
            raise RuntimeError("VllmAdapters.init must run before a retire")
        keep = self._keep()
        replies: list[WorkerReply] = []
        for e in self.engines:
            rs = _replies(e, RETIRE, self.name, keep)
            raise_for_replies(rs, RETIRE)
            replies += rs
        self._retired(replies)
        return replies

    def _keep(self) -> str:
        """The paths of the versions handed out (never retired), as JSON."""
        return json.dumps([lora_path(self.name, refit) for refit, _ in self.versions])

    def _retired(self, replies: list[WorkerReply]) -> None:
        """Take in the workers' accounts of a retire."""
        held: dict[str, list[str]] = {}
        for r in replies:
            if not r.stats.get("reported", False):
                log.warning(
                    "adapter %r: engine rank %d got no report of which requests use its versions, so none is "
                    "freed (is reshard's vLLM plugin loaded in its engine core?)",
                    self.name,
                    r.rank,
                )
            for version, ids in dict(r.stats.get("held", {})).items():
                held.setdefault(version, [])
                held[version] += [i for i in ids if i not in held[version]]
        self.held = held
        if replies:
            self.versions_bytes = max(int(r.stats.get("versions_bytes", 0)) for r in replies)

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


def _unregister(engine: Any, name: str, refit: int) -> None:
    """A server stops accepting requests that name a version which left the
    ``keep`` newest (an offline engine takes no request by name); its
    tensors stay until no request names it (:meth:`VllmAdapters.retire`)."""
    if not isinstance(engine, HttpEngine):
        return
    try:
        engine.post_json("/v1/unload_lora_adapter", {"lora_name": version_name(name, refit)})
    except Exception as err:  # the new version serves; the old name lingers
        log.warning("adapter %r: unloading %s from %r failed: %s", name, version_name(name, refit), engine, err)
