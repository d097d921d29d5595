"""OpenRLHF: ``broadcast_to_vllm`` replaced by a reshard refit.

OpenRLHF 0.11.2 syncs weights in ``ActorPPOTrainer.broadcast_to_vllm``
(``openrlhf/trainer/ray/ppo_actor.py``), run on every DeepSpeed rank: each
parameter is gathered (``deepspeed.zero.GatheredParameters``) and rank 0
broadcasts it over an NCCL group it built with every vLLM worker
(``_init_vllm_sync_group``, called from ``ActorPPOTrainer.__init__``); each
worker's ``load_weights`` keeps its slice. The vLLM engines are Ray actors
(``RolloutRayActor``, built by ``create_vllm_engines``, which looks the
class up by its module-level name) whose workers carry OpenRLHF's fixed
extension (``WorkerWrap``). OpenRLHF has no registry for any of this, so the
integration patches four names, each with the smallest change:

1. driver: ``openrlhf.trainer.ray.vllm_engine.RolloutRayActor`` becomes
   :class:`ReshardRolloutRayActor` (OpenRLHF's actor plus ``reshard_rpc``,
   a pass-through to ``collective_rpc`` that returns the workers' replies),
   built with ``worker_extension_cls`` :class:`ReshardWorkerWrap`
   (OpenRLHF's ``WorkerWrap`` plus reshard's worker extension)
   (:func:`patch_engines`). Upstream: a ``collective_rpc`` method on
   ``RolloutRayActor`` and a configurable worker extension.
2. every DeepSpeed rank (:func:`patch_trainer`, installed by
   :func:`setup_worker_process`, Ray's ``worker_process_setup_hook``):
   ``ActorPPOTrainer._init_vllm_sync_group`` builds nothing (no NCCL group),
   and ``ActorPPOTrainer.broadcast_to_vllm`` is one ``Sender.push`` over the
   DeepSpeed engine (ZeRO-1/2/3: each rank sends views of its own
   partitions); rank 0 drives the engines (every worker pulls what it keeps,
   then the prefix caches are reset). Upstream: a weight-sync hook (a class
   to construct instead of the NCCL group and the per-parameter loop).

:func:`main` (``python -m reshard.integrations.openrlhf ARGS``) runs
OpenRLHF's ``train_ppo_ray`` with both applied. OpenRLHF's trainer side
imports flash-attn (CUDA only), so this machine runs only its engine half
(``tests/test_openrlhf.py``); the names patched here are checked to exist in
the pinned version.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from reshard.errors import ReshardError
from reshard.integrations.framework import LazyClasses, Pinned
from reshard.transport.config import format_address

__all__ = [
    "OPENRLHF_VERSION",
    "PATCHED",
    "ReshardRolloutRayActor",
    "ReshardWorkerWrap",
    "check_openrlhf_version",
    "main",
    "patch_engines",
    "patch_trainer",
    "refit_engines",
    "setup_worker_process",
]

log = logging.getLogger("reshard")

# Built on first access (module __getattr__ below), as they subclass OpenRLHF's classes.
ReshardWorkerWrap: type
ReshardRolloutRayActor: type

OPENRLHF_VERSION = "0.11.2"
"""The OpenRLHF version whose names this integration patches."""

PATCHED = (
    ("openrlhf.trainer.ray.vllm_engine", "RolloutRayActor"),
    ("openrlhf.trainer.ray.vllm_worker_wrap", "WorkerWrap"),
    ("openrlhf.trainer.ray.ppo_actor", "ActorPPOTrainer._init_vllm_sync_group"),
    ("openrlhf.trainer.ray.ppo_actor", "ActorPPOTrainer.broadcast_to_vllm"),
)
"""``(module, qualified name)`` of everything replaced or subclassed."""

WORKER_WRAP = "reshard.integrations.openrlhf.ReshardWorkerWrap"


_PIN = Pinned(
    module=__name__,
    framework="OpenRLHF",
    distribution="openrlhf",
    version=OPENRLHF_VERSION,
    read="it patches " + ", ".join(f"{m}.{n}" for m, n in PATCHED),
)
_LAZY = LazyClasses(__name__, _PIN)


def check_openrlhf_version() -> str:
    """The installed OpenRLHF version, or an error naming the one this integration needs."""
    return _PIN.check()


@_LAZY.builds("ReshardWorkerWrap")
def _worker_wrap_class() -> type:
    from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

    from reshard.adapters.vllm.extension import ReshardWorkerExtension

    class ReshardWorkerWrap(WorkerWrap, ReshardWorkerExtension):  # type: ignore[misc, valid-type]
        """OpenRLHF's vLLM worker extension with reshard's methods beside it."""

    return ReshardWorkerWrap


@_LAZY.builds("ReshardRolloutRayActor")
def _rollout_actor_class() -> type:
    from openrlhf.trainer.ray import vllm_engine

    base = _original_rollout_actor(vllm_engine)

    class ReshardRolloutRayActor(base):  # type: ignore[misc, valid-type]
        """OpenRLHF's ``RolloutRayActor`` plus a pass-through to ``collective_rpc``."""

        async def reshard_rpc(self, method: str, *args: Any) -> list[Any]:
            """Every worker's reply to ``method(*args)`` (reshard's extension methods)."""
            return await self.llm.collective_rpc(method, args=args)

    return ReshardRolloutRayActor


def _original_rollout_actor(vllm_engine: Any) -> type:
    actor = vllm_engine.RolloutRayActor
    actor = getattr(actor, "_reshard_original", actor)
    # ``@ray.remote`` wraps the class; the class itself is kept on the wrapper.
    return actor.__ray_metadata__.modified_class if hasattr(actor, "__ray_metadata__") else actor


class _ReshardActors:
    """What ``create_vllm_engines`` finds as ``RolloutRayActor``: OpenRLHF's
    call, ``RolloutRayActor.options(...).remote(**kwargs)``, builds
    :class:`ReshardRolloutRayActor` with reshard's worker extension."""

    def __init__(self, original: Any) -> None:
        import ray

        self._reshard_original = original
        self._remote: Any = ray.remote(_rollout_actor_class())

    def options(self, **options: Any) -> Any:
        remote = self._remote.options(**options)

        class _Options:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                given = kwargs.get("worker_extension_cls")
                if given not in (None, "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap", WORKER_WRAP):
                    raise ReshardError(f"the vLLM engines' worker extension is {given!r}; reshard replaces WorkerWrap")
                kwargs["worker_extension_cls"] = WORKER_WRAP
                return remote.remote(*args, **kwargs)

        return _Options()


def patch_engines() -> None:
    """In the driver, before ``create_vllm_engines``: engines are built as
    :class:`ReshardRolloutRayActor` with :class:`ReshardWorkerWrap`."""
    check_openrlhf_version()
    from openrlhf.trainer.ray import vllm_engine

    if not isinstance(vllm_engine.RolloutRayActor, _ReshardActors):
        vllm_engine.RolloutRayActor = _ReshardActors(vllm_engine.RolloutRayActor)


def patch_trainer() -> None:
    """In every DeepSpeed rank's process: no NCCL sync group, and
    ``broadcast_to_vllm`` is a reshard refit (:func:`refit_engines`)."""
    check_openrlhf_version()
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    if getattr(ActorPPOTrainer.broadcast_to_vllm, "_reshard", False):
        return

    def _init_vllm_sync_group(self: Any, backend: str) -> None:
        """reshard builds its own refit group on the first sync."""

    def broadcast_to_vllm(self: Any) -> None:
        refit_engines(self)

    broadcast_to_vllm._reshard = True  # type: ignore[attr-defined]
    ActorPPOTrainer._init_vllm_sync_group = _init_vllm_sync_group  # type: ignore[method-assign]
    ActorPPOTrainer.broadcast_to_vllm = broadcast_to_vllm  # type: ignore[method-assign]


def refit_engines(
    trainer: Any, *, address: str | None = None, timeout_s: float | None = None, job: str = "reshard-openrlhf"
) -> Any:
    """One refit of ``trainer.vllm_engines`` from ``trainer.actor.model``
    (OpenRLHF's ``ActorPPOTrainer``; every DeepSpeed rank, collectively).
    The sender is built on the first call; trainer rank 0 hosts the refit
    store (``address``, default ``$RESHARD_ADDRESS``, else this node and a
    free port, sent to the other ranks) and drives the engines. Returns this
    rank's :class:`reshard.RefitStats`."""
    import torch.distributed as dist

    from reshard.sender import Sender
    from reshard.transport.group import GroupConfig

    state = trainer.__dict__.get("_reshard")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    engines = list(trainer.vllm_engines or [])
    if state is None:
        if timeout_s is None:
            timeout_s = float(os.environ.get("RESHARD_TIMEOUT_S", "300"))
        address, workers = _rank0_setup(
            address or os.environ.get("RESHARD_ADDRESS"), lambda: _count_workers(trainer, engines), rank, world
        )
        config = GroupConfig(address=address, num_sources=world, num_destinations=workers, job=job, timeout_s=timeout_s)
        state = trainer.__dict__["_reshard"] = {
            "sender": Sender(trainer.actor.model, config=config, rank=rank),
            "engines": _RayEngines(engines) if rank == 0 else None,
            "refits": 0,
        }
    state["refits"] += 1
    return state["sender"].push(state["refits"], engines=state["engines"])


class _RayEngines:
    """OpenRLHF's engine actors as :class:`reshard.sender.engines.Engines`
    (rank 0 drives them): engine ``i``'s workers take the refit ranks after
    engine ``i - 1``'s."""

    def __init__(self, engines: list[Any]) -> None:
        self.engines = engines

    def init(self, config: Any) -> None:
        import ray

        from reshard.adapters.core.replies import WorkerReply, raise_for_replies
        from reshard.adapters.core.spec import GroupSpec

        offset = 0
        for e in self.engines:
            spec = GroupSpec.of(config, engine_offset=offset)
            replies = [WorkerReply.parse(r) for r in ray.get(e.reshard_rpc.remote("reshard_init", spec.to_json()))]
            raise_for_replies(replies, "reshard_init")
            offset += len(replies)
        if offset != config.num_destinations:
            raise ReshardError(f"the engines have {offset} workers, the refit group expects {config.num_destinations}")

    def refit(self, refit: int, *, method: str = "reshard") -> list[Any]:
        import ray

        from reshard.adapters.core.replies import WorkerReply, raise_for_replies

        refs = [e.reshard_rpc.remote("reshard_pull", str(refit), method) for e in self.engines]
        replies = [WorkerReply.parse(r) for rs in ray.get(refs) for r in rs]
        raise_for_replies(replies, "reshard_pull", version=refit)
        # Prefixes cached before were computed with the old weights.
        ray.get([e.reset_prefix_cache.remote() for e in self.engines])
        return replies


def _count_workers(trainer: Any, engines: list[Any]) -> int:
    import ray

    counts = ray.get([e.reshard_rpc.remote("reshard_status") for e in engines])
    return sum(len(c) for c in counts)


def _rank0_setup(address: str | None, count_workers: Callable[[], int], rank: int, world: int) -> tuple[str, int]:
    """Rank 0's store address (``address``, else this node and a free port)
    and engine worker count, on every rank. Rank 0 failing to find either
    fails every rank (none is left waiting in the broadcast)."""
    text, error = "", None
    if rank == 0:
        try:
            text = f"{_store_address(address)}|{count_workers()}"
        except Exception as e:
            error, text = e, f"!{type(e).__name__}: {e}"[: _TEXT_BYTES - 1]
    text = _from_rank0(text, world)
    if error is not None:
        raise error
    if text.startswith("!"):
        raise ReshardError(f"trainer rank {rank}: trainer rank 0 could not set up the refits: {text[1:]}")
    where, _, workers = text.rpartition("|")
    return where, int(workers)


def _store_address(address: str | None) -> str:
    if address is not None:
        return address
    import socket

    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind(("", 0))
        return format_address(host, s.getsockname()[1])


_TEXT_BYTES = 512


def _from_rank0(text: str, world: int) -> str:
    """Rank 0's ``text`` on every rank, as a fixed-size byte tensor on the
    default group's device (no pickled objects cross ranks)."""
    if world == 1:
        return text
    import torch
    import torch.distributed as dist

    data = text.encode()
    if len(data) >= _TEXT_BYTES:
        raise ReshardError(f"{text!r} is longer than the {_TEXT_BYTES - 1} bytes rank 0 can share")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    box = torch.zeros(_TEXT_BYTES, dtype=torch.uint8, device=device)
    if data:
        box[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(box, src=0)
    raw = bytes(box.cpu().tolist())
    return raw.split(b"\0", 1)[0].decode()


def setup_worker_process() -> None:
    """Ray's ``worker_process_setup_hook``: :func:`patch_trainer` as soon as
    OpenRLHF's actor module is imported in this process (nothing else is
    imported here)."""
    import importlib.abc
    import importlib.machinery

    name = "openrlhf.trainer.ray.ppo_actor"
    if name in sys.modules:
        patch_trainer()
        return

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader
            exec_module = loader.exec_module

            def exec_and_patch(module: Any) -> None:
                exec_module(module)
                patch_trainer()

            loader.exec_module = exec_and_patch  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _Finder())


def main(argv: list[str] | None = None) -> None:
    """``python -m reshard.integrations.openrlhf ARGS``: OpenRLHF's
    ``train_ppo_ray`` with ARGS, refit by reshard."""
    import runpy

    import ray

    check_openrlhf_version()
    if ray.is_initialized():
        raise ReshardError(
            "Ray is already initialized in this process: reshard's worker setup hook could not be installed "
            "(OpenRLHF's own NCCL sync would run); start from a process without Ray"
        )
    # train_ppo_ray's own environment (its ray.init is skipped once Ray is
    # up), and reshard's settings, which the trainer actors read.
    env = {
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true"),
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
        "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
        **{k: os.environ[k] for k in ("RESHARD_ADDRESS", "RESHARD_TIMEOUT_S") if k in os.environ},
    }
    ray.init(
        runtime_env={
            "worker_process_setup_hook": "reshard.integrations.openrlhf.setup_worker_process",
            "env_vars": env,
        }
    )
    patch_engines()
    sys.argv = ["openrlhf.cli.train_ppo_ray", *(sys.argv[1:] if argv is None else argv)]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")


# ``ReshardWorkerWrap`` and ``ReshardRolloutRayActor`` import OpenRLHF when
# first asked for (vLLM's worker extension and Ray's actors ask by name).
__getattr__ = _LAZY.getattr


if __name__ == "__main__":
    # Through the package module: the classes it builds must be importable
    # by their module name in Ray's worker processes.
    from reshard.integrations.openrlhf import main as _main

    _main()
