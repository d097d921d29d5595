"""verl: weight syncs that stay sliced, through verl's own hooks.

verl 0.9.1 syncs weights with a ``CheckpointEngineManager``: each actor
worker hands its checkpoint engine ``engine.get_per_tensor_param()``, a
generator of *full* tensors (FSDP2 ``full_tensor()`` per parameter; FSDP1
unshards the whole state dict first), and the rollout side hands full
tensors to the vLLM workers' ``load_weights``. A plain backend behind that
interface receives full tensors, so it cannot keep slices sliced. verl has
three hooks that fit better, and this module uses them, no patch of verl's
code:

1. ``actor_rollout_ref.rollout.checkpoint_engine.backend=reshard`` with
   ``custom_backend_module=reshard.integrations.verl_backend``: verl imports
   the module in every worker and builds :class:`ReshardCheckpointEngine`
   from its own ``CheckpointEngineRegistry``. In each actor worker it holds
   a :class:`reshard.Sender` over the training engine's module (FSDP1 flat
   parameters or FSDP2 DTensors: each rank sends views of its own shards).
2. ``actor_rollout_ref.rollout.checkpoint_manager_class=reshard.integrations.verl.ReshardCheckpointManager``:
   verl's trainer builds this subclass of its ``CheckpointEngineManager``;
   only ``update_weights`` differs. It never calls ``get_per_tensor_param``:
   it runs the push in every actor worker (Ray's ``__ray_call__``, as verl's
   own ``vLLMReplica.launch_servers`` reaches its workers) while every
   rollout replica pulls.
3. ``actor_rollout_ref.rollout.engine_kwargs.vllm.weight_transfer_config={backend: reshard}``,
   forwarded to vLLM verbatim: the vLLM workers run reshard's native
   weight-transfer backend (:mod:`reshard.adapters.vllm.backend`), driven
   through verl's server actors' ``collective_rpc`` (``init_weight_transfer_engine``,
   then per refit ``start_weight_update``, ``update_weights``,
   ``finish_weight_update``), as verl's own delta path drives vLLM. Each
   worker learns from vLLM's loaders which slices it keeps and pulls only
   those.

An update (``ReshardCheckpointManager.update_weights``) keeps verl's
order: abort and park requests, release the KV cache, refit, reset the
prefix caches, restore the KV cache, resume generation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import socket
from typing import Any

from reshard.adapters.core.spec import GroupSpec
from reshard.errors import ReshardError
from reshard.integrations.framework import LazyClasses, Pinned
from reshard.transport.config import GROUP, TRAINER, GroupConfig, format_address, scope_fields, settings

__all__ = [
    "BACKEND",
    "GROUP_SETTINGS",
    "VERL_VERSION",
    "ReshardCheckpointEngine",
    "ReshardCheckpointManager",
    "VerlOptions",
    "check_verl_version",
    "lora_unmerged",
    "register",
    "setup_worker_process",
]

log = logging.getLogger("reshard")

# Built on first access (module __getattr__ below), as they subclass verl's classes.
ReshardCheckpointEngine: type
ReshardCheckpointManager: type

VERL_VERSION = "0.9.1"
"""The verl version this integration was written against (its checkpoint-engine
registry, manager, worker and server-actor methods were read there)."""

BACKEND = "reshard"
"""The name of reshard's backend in verl's ``CheckpointEngineRegistry``."""

MANAGER = "reshard.integrations.verl.ReshardCheckpointManager"

_NEEDS_MANAGER = (
    f"verl's checkpoint-engine backend {BACKEND!r} moves slices, not the full tensors verl's own "
    f"CheckpointEngineManager passes through send_weights/receive_weights: set "
    f"actor_rollout_ref.rollout.checkpoint_manager_class={MANAGER}"
)


_PIN = Pinned(
    module=__name__,
    framework="verl",
    distribution="verl",
    version=VERL_VERSION,
    read="CheckpointEngineRegistry, CheckpointEngineManager.update_weights, the vLLM server actors' collective_rpc",
)
_LAZY = LazyClasses(__name__, _PIN)


def check_verl_version() -> str:
    """The installed verl version, or an error naming the one this integration needs."""
    return _PIN.check()


_DERIVED = ("address", "num_sources", "num_destinations", "generation")
"""The group settings the manager derives: the actors and replicas it
drives, a fresh generation at every join, the store's address (an option of
its own, :attr:`VerlOptions.address`)."""


_RENAMED = {"backend": "group_backend"}
"""Settings a verl user cannot give by their own name: verl builds the
backend with ``CheckpointEngineRegistry.new(backend, **engine_kwargs.reshard)``,
where a ``backend`` key collides with verl's own argument (vLLM's trainer
init info spells it ``group_backend`` too)."""

GROUP_SETTINGS = {
    _RENAMED.get(n, n): n for n in scope_fields(GROUP, TRAINER) if n not in (*_DERIVED, "job", "timeout_s")
}
"""The :class:`reshard.GroupConfig` settings a verl user sets in
``engine_kwargs.reshard`` besides :class:`VerlOptions`' own fields (key ->
setting): every setting all ranks share or the actors hold, but those the
manager derives."""


@dataclasses.dataclass(kw_only=True, slots=True)
class VerlOptions:
    """``actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.reshard``:
    the fields below, and any other :class:`reshard.GroupConfig` setting
    every rank shares or the actors hold (``checksums``, ``shared_memory``,
    ``delta``, ``delta_budget_bytes``, ...), by name (``backend`` as
    ``group_backend``: :data:`GROUP_SETTINGS`)."""

    address: str | None = None
    """``host:port`` of the refit store, hosted by actor rank 0; every actor
    and every vLLM worker must reach it. ``None``: actor rank 0's node
    address and a free port there."""
    job: str = "reshard-verl"
    timeout_s: float = 300.0
    """Bound on every wait of a refit (joining, agreeing, each round)."""
    atomic: bool = False
    """A refit that fails leaves every old weight in the engines (one more
    copy of each worker's weights during the refit)."""
    group: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The other group settings (:data:`GROUP_SETTINGS`), by their ``GroupConfig`` names."""

    def __post_init__(self) -> None:
        settable = list(GROUP_SETTINGS.values())
        unknown = sorted(set(self.group) - set(settable))
        if unknown:
            raise ValueError(f"VerlOptions.group: {unknown} are no group settings a verl user sets; known: {settable}")
        if self.timeout_s <= 0:
            raise ValueError(f"engine_kwargs.reshard.timeout_s must be positive, got {self.timeout_s}")
        # Bad values fail where verl builds the options, not at the first refit.
        self.config(address=self.address or "localhost:1", num_sources=1, num_destinations=1, generation=0)

    @classmethod
    def of(cls, kwargs: Any) -> VerlOptions:
        """The options from verl's ``engine_kwargs.reshard`` (flat keys)."""
        own = {f.name for f in dataclasses.fields(cls)} - {"group"}
        given = dict(kwargs or {})
        unknown = sorted(set(given) - own - set(GROUP_SETTINGS))
        if unknown:
            raise ValueError(
                f"checkpoint_engine.engine_kwargs.reshard has unknown keys {unknown}; "
                f"known: {sorted(own | set(GROUP_SETTINGS))}"
            )
        group = {setting: given.pop(key) for key, setting in GROUP_SETTINGS.items() if key in given}
        return cls(**given, group=group)

    def config(self, *, address: str, num_sources: int, num_destinations: int, generation: int) -> GroupConfig:
        """The refit group's settings for the actors and replicas the manager drives."""
        return GroupConfig(
            address=address,
            num_sources=num_sources,
            num_destinations=num_destinations,
            generation=generation,
            job=self.job,
            timeout_s=self.timeout_s,
            **self.group,
        )


def lora_unmerged(model_config: Any, rank: int = 0) -> None:
    """Refuse a LoRA policy verl would serve unmerged. With
    ``actor_rollout_ref.model.lora_rank > 0`` (or ``model.lora.rank``) and
    ``model.lora.merge=False``, verl's vLLM rollout applies the adapter
    itself, with LoRA requests on top of the base weights, fed by its own
    adapter sync; reshard's backend refits the merged policy into the base
    weights (:mod:`reshard.sender.peft`), which would apply the adapter
    twice. With ``merge=True`` it is what verl expects."""
    if model_config is None:
        return
    lora = getattr(model_config, "lora", None) or {}
    get = lora.get if hasattr(lora, "get") else (lambda k, d=None: getattr(lora, k, d))
    ranked = int(getattr(model_config, "lora_rank", 0) or 0) > 0 or int(get("rank", 0) or 0) > 0
    if ranked and not get("merge", False):
        raise ReshardError(
            f"actor rank {rank}: verl trains a LoRA adapter with actor_rollout_ref.model.lora.merge=False, so its "
            "vLLM rollout would apply the adapter on top of the base weights; reshard's verl backend refits the "
            "merged policy (no gather of the base): set actor_rollout_ref.model.lora.merge=True"
        )


def register() -> None:
    """Register :class:`ReshardCheckpointEngine` as ``reshard`` in verl's
    ``CheckpointEngineRegistry`` (importing ``reshard.integrations.verl_backend``,
    verl's ``custom_backend_module``, does this in every worker)."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    CheckpointEngineRegistry.register(BACKEND)(_engine_class())


@_LAZY.builds("ReshardCheckpointEngine")
def _engine_class() -> type:
    from verl.checkpoint_engine import CheckpointEngine

    class ReshardCheckpointEngine(CheckpointEngine):  # type: ignore[misc, valid-type]
        """reshard's backend in verl's registry. In an actor worker it holds
        the :class:`reshard.Sender` over the training engine's shards; the
        interface verl's own manager drives (full tensors through
        ``send_weights``) is refused, naming the manager to use."""

        wire_format = "reshard"

        def __init__(self, bucket_size: int = 0, is_master: bool = False, **kwargs: Any) -> None:
            self.options = VerlOptions.of(kwargs)
            self.is_master = is_master
            self.sender: Any = None
            self.engine: Any = None

        # -- verl's interface, for its own manager: refused -------------------

        def prepare(self) -> dict[str, Any]:
            raise ReshardError(_NEEDS_MANAGER)

        @classmethod
        def build_topology(cls, *args: Any, **kwargs: Any) -> Any:
            raise ReshardError(_NEEDS_MANAGER)

        def init_process_group(self, **kwargs: Any) -> None:
            raise ReshardError(_NEEDS_MANAGER)

        def finalize(self) -> None:
            raise ReshardError(_NEEDS_MANAGER)

        async def send_weights(self, weights: Any, global_steps: int | None = None) -> Any:
            raise ReshardError(_NEEDS_MANAGER)

        async def receive_weights(self, global_steps: int | None = None) -> Any:
            raise ReshardError(_NEEDS_MANAGER)

        # -- the trainer side, driven by ReshardCheckpointManager ---------------

        def serve(self, engine: Any, group: dict[str, Any], rank: int) -> None:
            """Hold a sender over ``engine``'s module (a verl training engine:
            ``FSDPEngine.module``, FSDP1 or FSDP2), as refit rank ``rank``."""
            from reshard.sender import Sender
            from reshard.transport.group import GroupConfig

            module = getattr(engine, "module", None)
            if module is None:
                raise TypeError(
                    f"actor rank {rank}: the training engine {type(engine).__name__} has no 'module'; reshard's "
                    "verl backend reads FSDP engines (FSDP1 or FSDP2)"
                )
            lora_unmerged(getattr(engine, "model_config", None), rank)
            self.close()
            self.engine = engine
            # Refit rank 0 hosts the store (GroupConfig's default).
            self.sender = Sender(module, config=GroupConfig(**group), rank=rank)

        def push(self, refit: int) -> dict[str, Any]:
            """Send refit ``refit`` (every actor, while every vLLM worker pulls);
            this rank's account as a dict."""
            if self.sender is None:
                raise RuntimeError("ReshardCheckpointEngine.serve must run before a push")
            with _params_on_device(self.engine):
                stats = self.sender.push(refit)
            return stats.as_dict()

        def cancel(self, reason: str) -> None:
            """Make this rank's refit in progress fail at once (the engines failed)."""
            if self.sender is not None:
                self.sender.cancel(reason)

        def close(self) -> None:
            if self.sender is not None:
                self.sender.close()
                self.sender = None

    return ReshardCheckpointEngine


class _params_on_device:
    """A verl engine that offloads parameters to host memory between steps
    has them on its device for the block (as verl's own sync does)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.moved = False

    def __enter__(self) -> None:
        if getattr(self.engine, "is_param_offload_enabled", False):
            from verl.utils.device import get_device_name

            self.engine.to(get_device_name(), model=True, optimizer=False, grad=False)
            self.moved = True

    def __exit__(self, *exc: Any) -> None:
        if self.moved:
            self.engine.to("cpu", model=True, optimizer=False, grad=False)


# -- vLLM 0.32 under verl 0.9.1 ---------------------------------------------------


def setup_worker_process() -> None:
    """Ray's ``worker_process_setup_hook`` for verl jobs on vLLM 0.32 and
    newer (``ray_kwargs.ray_init.runtime_env.worker_process_setup_hook``):
    verl 0.9.1 (which pins vLLM 0.24) aborts requests before a weight sync
    with ``AsyncLLM.pause_generation(wait_for_inflight_requests=False, ...)``;
    since vLLM 0.32 that call takes ``mode="abort"`` (or ``"wait"``) and
    rejects the old keyword. This makes ``pause_generation`` accept it again,
    in this process, when the installed vLLM lacks it. The upstream fix:
    verl passing ``mode=`` to vLLM 0.32 and newer."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return
    import inspect

    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.pause_generation
    params = inspect.signature(original).parameters
    if "wait_for_inflight_requests" in params or "mode" not in params:
        return

    @functools.wraps(original)
    async def pause_generation(self: Any, *args: Any, wait_for_inflight_requests: bool | None = None, **kwargs: Any):
        if wait_for_inflight_requests is not None and "mode" not in kwargs:
            kwargs["mode"] = "wait" if wait_for_inflight_requests else "abort"
        return await original(self, *args, **kwargs)

    AsyncLLM.pause_generation = pause_generation  # type: ignore[method-assign]


# -- functions run inside the actor workers (Ray's __ray_call__) ---------------


def _store_address(worker: Any) -> str:
    """``host:port`` on actor rank 0's node, a port free there now."""
    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return format_address(host, port)


def _backend_of(worker: Any) -> Any:
    backend = getattr(worker, "checkpoint_engine", None)
    if backend is None or type(backend).__name__ != "ReshardCheckpointEngine":
        raise ReshardError(
            f"actor worker {getattr(worker, 'rank', '?')} has checkpoint engine {type(backend).__name__}: set "
            f"actor_rollout_ref.rollout.checkpoint_engine.backend={BACKEND} and "
            "custom_backend_module=reshard.integrations.verl_backend"
        )
    return backend


def _serve(worker: Any, group: dict[str, Any]) -> None:
    actor = getattr(worker, "actor", None)
    engine = getattr(actor, "engine", None)
    if engine is None:
        raise ReshardError(f"actor worker {worker.rank} has no training engine (worker.actor.engine)")
    _backend_of(worker).serve(engine, group, rank=int(worker.rank))


def _push(worker: Any, refit: int) -> dict[str, Any]:
    return _backend_of(worker).push(refit)


def _cancel(worker: Any, reason: str) -> None:
    _backend_of(worker).cancel(reason)


# -- the manager -----------------------------------------------------------------


@_LAZY.builds("ReshardCheckpointManager")
def _manager_class() -> type:
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.utils.ray_utils import auto_await

    class ReshardCheckpointManager(CheckpointEngineManager):  # type: ignore[misc, valid-type]
        """verl's ``CheckpointEngineManager`` with ``update_weights`` a
        reshard refit (see :mod:`reshard.integrations.verl`)."""

        def __init__(self, config: Any, actor_wg: Any, replicas: list[Any]) -> None:
            if config.backend != BACKEND:
                raise ReshardError(
                    f"{MANAGER} drives reshard's backend, but checkpoint_engine.backend is {config.backend!r}: "
                    f"set it to {BACKEND!r} (with custom_backend_module=reshard.integrations.verl_backend)"
                )
            super().__init__(config, actor_wg, replicas)
            self.options = VerlOptions.of((config.engine_kwargs or {}).get(BACKEND, {}))
            self.refits = 0
            """Refits done so far."""
            self.last_stats: list[dict[str, Any]] = []
            """Every actor rank's account of the last refit (``RefitStats.as_dict``)."""
            self._joined: tuple[int, ...] | None = None
            self._generation = 0

        def add_replicas(self, replicas: list[Any]) -> None:
            super().add_replicas(replicas)
            self._joined = None  # the next update joins a new group

        def remove_replicas(self, replicas: list[Any]) -> None:
            super().remove_replicas(replicas)
            self._joined = None

        @auto_await
        async def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
            """Refit every replica to the actor's weights (verl's order: abort
            and park requests, release the KV cache, refit, reset prefix
            caches, restore the KV cache, resume generation)."""
            await self.abort_replicas()
            await self.release_kv_cache_replicas()
            if self._joined != tuple(id(r) for r in self.replicas):
                await self._join()
            refit = self.refits + 1
            self.last_stats = await self._refit(refit)
            self.refits = refit
            await asyncio.gather(*[r.clear_kv_cache() for r in self.replicas])
            if global_steps is not None:
                await asyncio.gather(
                    *[s.set_global_steps.remote(global_steps) for r in self.replicas for s in r.servers]
                )
            await self.resume_kv_cache_replicas()
            await self.resume_generation_replicas()
            sent = sum(int(s.get("bytes_sent", 0)) for s in self.last_stats)
            seconds = max((float(s.get("total_seconds", 0.0)) for s in self.last_stats), default=0.0)
            return {"reshard/bytes_sent": sent, "reshard/seconds": seconds}

        async def _join(self) -> None:
            """Senders on every actor (rank 0 hosts the store), then every
            replica's workers learn their layouts (refit ranks after the
            actors', replica after replica)."""
            for r in self.replicas:
                if int(getattr(r.config, "data_parallel_size", 1) or 1) != 1:
                    raise ReshardError(
                        f"rollout replica {r.replica_rank} has data_parallel_size "
                        f"{r.config.data_parallel_size}: collective_rpc reaches one data-parallel shard only; "
                        "run one replica per data-parallel rank instead"
                    )
            workers = self.actor_wg.workers
            address = self.options.address
            if address is None:
                address = await workers[0].__ray_call__.remote(_store_address)
            self._generation += 1
            config = self.options.config(
                address=address,
                num_sources=len(workers),
                num_destinations=sum(int(r.world_size) for r in self.replicas),
                generation=self._generation,
            )
            # Actors: every shared and trainer setting (each reads its own
            # token from its environment; rank 0 hosts the store).
            group = settings(config, GROUP, TRAINER)
            await asyncio.gather(*[w.__ray_call__.remote(_serve, group) for w in workers])
            offset = 0
            inits: list[Any] = []
            for r in self.replicas:
                info = GroupSpec.of(config, engine_offset=offset, atomic=self.options.atomic).init_info()
                rpc: Any = r.servers[0].collective_rpc
                inits.append(rpc.remote("init_weight_transfer_engine", kwargs={"init_info": info}))
                offset += int(r.world_size)
            await asyncio.gather(*inits)
            self._joined = tuple(id(r) for r in self.replicas)
            log.info(
                "reshard: %d actor ranks refit %d replicas (%d vLLM workers) through %s",
                len(workers), len(self.replicas), offset, address,
            )  # fmt: skip

        async def _refit(self, refit: int) -> list[dict[str, Any]]:
            workers = self.actor_wg.workers
            pushes = [asyncio.ensure_future(_await(w.__ray_call__.remote(_push, refit))) for w in workers]
            pulls = [asyncio.ensure_future(_pull(r, refit)) for r in self.replicas]
            done, _ = await asyncio.wait([*pushes, *pulls], return_when=asyncio.FIRST_EXCEPTION)
            failed = next((f for f in done if not f.cancelled() and f.exception() is not None), None)
            if failed is not None:
                # The other ranks would wait for the failed one until the
                # timeout: a cancel on every actor aborts the refit group.
                what = "an actor rank" if failed in pushes else "a rollout replica"
                e = failed.exception()
                await asyncio.gather(
                    *[w.__ray_call__.remote(_cancel, f"{what} failed: {e}") for w in workers],
                    return_exceptions=True,
                )
                await asyncio.gather(*pushes, *pulls, return_exceptions=True)
                raise ReshardError(f"reshard refit {refit}: {what} failed: {e}") from e
            return list(await asyncio.gather(*pushes))

    return ReshardCheckpointManager


async def _await(ref: Any) -> Any:
    return await ref


async def _pull(replica: Any, refit: int) -> None:
    """Refit ``refit`` into ``replica``'s vLLM workers through its server
    actor (node 0's, which owns the engine): vLLM's weight-transfer calls,
    reshard's backend behind them."""
    server = replica.servers[0]
    await server.collective_rpc.remote("start_weight_update")
    await server.collective_rpc.remote("update_weights", kwargs={"update_info": {"refit": refit}})
    await server.collective_rpc.remote("finish_weight_update")


# ``ReshardCheckpointManager`` and ``ReshardCheckpointEngine`` import verl
# when first asked for (verl's ``load_class_from_fqn`` asks).
__getattr__ = _LAZY.getattr
