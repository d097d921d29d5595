"""TRL: ``GRPOTrainer`` (and TRL's other vLLM trainers) refit by reshard.

TRL 1.16.0 syncs weights in ``VLLMGeneration.sync_weights``: it gathers one
full parameter at a time on every rank and broadcasts it from rank 0 over
vLLM's NCCL weight-transfer engine (server mode; its constructor refuses to
start without CUDA), or hands it to the colocated engine's ``load_weights``
(colocate mode). ``VLLMGeneration`` is built by its module-level name in the
trainer's module (``trl.trainer.grpo_trainer``), and ``sync_weights`` is
called from ``_generate_single_turn`` and ``_generate`` whenever the global
step moved. So the hook is that class:

- :class:`ReshardVLLMGeneration` (built on first use, a subclass of TRL's)
  never creates TRL's NCCL communicator; in colocate mode it builds TRL's
  ``LLM`` with reshard's worker extension; its ``sync_weights`` is one
  ``Sender.push`` on every rank, the sender built on the first sync (after
  Accelerate wrapped the model) from the trainer's ``model_wrapped``
  (FSDP2, FSDP1, DeepSpeed ZeRO, DDP or a plain module: each rank sends
  views of its own shards, nothing is gathered).
- :func:`with_reshard` (``ReshardGRPOTrainer = with_reshard(GRPOTrainer)``)
  makes a trainer class build that instead of TRL's while its constructor
  runs.

Usage (every trainer rank, as with ``GRPOTrainer``)::

    from reshard.integrations.trl import ReshardGRPOTrainer, ReshardOptions

    trainer = ReshardGRPOTrainer(
        model=path, reward_funcs=reward, train_dataset=ds,
        args=GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://engine:8000", ...),
        reshard=ReshardOptions(address="trainer-0:51216"),   # optional
    )
    trainer.train()

Server mode: a plain vLLM server started with ``VLLM_SERVER_DEV_MODE=1`` and
``--worker-extension-cls reshard.adapters.vllm.ReshardWorkerExtension``
(TRL's client only uses vLLM's own routes). Rank 0 drives it: pause, every
worker pulls its slices while every trainer rank pushes, prefix cache reset,
resume. Colocate mode: every rank's engine worker (TRL builds one per rank,
``external_launcher``) pulls its slices from every trainer rank.

The frameworks are imported lazily; the TRL version is checked
(:data:`TRL_VERSION`) and another version is refused with its name.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reshard.adapters.core.spec import GroupSpec
from reshard.adapters.vllm.driver import HttpEngine, VllmEngines, flush_prefix_cache, init_workers, pull_workers
from reshard.errors import ReshardError
from reshard.integrations.framework import LazyClasses, Pinned
from reshard.sender import Sender
from reshard.transport.config import format_address
from reshard.transport.group import GroupConfig

if TYPE_CHECKING:
    from reshard.adapters.core.replies import WorkerReply
    from reshard.sender.engines import EngineStats
    from reshard.transport.session import RefitStats

__all__ = [
    "EXTENSION",
    "TRL_VERSION",
    "ColocatedEngine",
    "ReshardGRPOTrainer",
    "ReshardOptions",
    "ReshardRLOOTrainer",
    "ReshardVLLMGeneration",
    "TrlRefits",
    "check_trl_version",
    "count_server_workers",
    "with_reshard",
]

log = logging.getLogger("reshard")

# Built on first access (module __getattr__ below), as they subclass TRL's classes.
ReshardGRPOTrainer: type
ReshardRLOOTrainer: type
ReshardVLLMGeneration: type

TRL_VERSION = "1.16.0"
"""The TRL version this integration patches (its hook names and call sites were read there)."""

EXTENSION = "reshard.adapters.vllm.ReshardWorkerExtension"
"""The vLLM worker extension the engines run (``--worker-extension-cls``)."""


_PIN = Pinned(
    module=__name__,
    framework="TRL",
    distribution="trl",
    version=TRL_VERSION,
    read="VLLMGeneration, its _init_vllm and sync_weights, the trainers' module-level VLLMGeneration name",
    no_deps=False,
)
_LAZY = LazyClasses(__name__, _PIN)


def check_trl_version() -> str:
    """The installed TRL version, or an error naming the one this integration needs."""
    return _PIN.check()


@dataclass(kw_only=True, slots=True)
class ReshardOptions:
    """How a TRL trainer's refits run (``reshard=`` of a :func:`with_reshard` trainer)."""

    address: str | None = None
    """``host:port`` of the refit store, hosted by trainer rank 0; every
    trainer rank and every engine worker must reach it. ``None``: host
    ``$MASTER_ADDR`` (else ``127.0.0.1``), port TRL's ``vllm_group_port``
    (the port of the NCCL group TRL would have built). Set it when the
    engines run on another host than ``$MASTER_ADDR`` names."""
    job: str = "reshard-trl"
    """Keeps this job's keys apart from others on the store."""
    timeout_s: float = 300.0
    """Bound on every wait of a refit (joining, agreeing, each round)."""
    pause_mode: str | None = None
    """Server mode: ``wait``, ``keep``, ``abort``, or ``None`` (per server
    version, see :func:`reshard.adapters.vllm.driver.pause_mode_for`)."""
    two_phase: bool = False
    """Server mode: workers receive while the server keeps generating;
    generation pauses only to apply."""
    atomic: bool = False
    """A refit that fails leaves every old weight in place (one more copy of
    each worker's weights during the refit)."""
    shared_memory: bool | None = None
    """Move bytes between ranks on one host through ``/dev/shm`` (CPU) or
    CUDA IPC (GPU). ``None``: on in colocate mode on GPUs, where each trainer
    rank shares its GPU with its engine worker and no NCCL group can join
    them; off otherwise."""
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    """Colocate mode: more arguments for the ``LLM`` TRL builds (TRL 1.16
    passes no ``dtype``, for one); they override TRL's."""
    sync: bool = True
    """``False``: never refit. Generation then runs on the engine's initial
    weights and drifts from the policy; for measuring what a sync buys (not
    with ``vllm_enable_sleep_mode``, whose level-2 sleep discards those
    weights)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """More :class:`reshard.GroupConfig` fields (``checksums``, ``token``, ...)."""
    lora: str = "merged"
    """A PEFT policy (``peft_config``): ``merged`` refits the engines' base
    weights with the merged policy (:mod:`reshard.sender.peft`);
    ``adapter`` refits only the adapter into the engines' LoRA slots
    (:mod:`reshard.adapters.vllm.lora`: engines started with LoRA enabled,
    servers also with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``), and TRL's
    generation then uses the newest version."""
    lora_name: str = "policy"
    """The adapter's name on the engines (``lora="adapter"``; each version is ``<name>@<refit>``)."""

    def __post_init__(self) -> None:
        if self.lora not in ("merged", "adapter"):
            raise ValueError(f"ReshardOptions.lora {self.lora!r}: use 'merged' or 'adapter'")
        if self.pause_mode not in (None, "wait", "keep", "abort"):
            raise ValueError(f"ReshardOptions.pause_mode {self.pause_mode!r}: use 'wait', 'keep', 'abort' or None")
        if self.timeout_s <= 0:
            raise ValueError(f"ReshardOptions.timeout_s must be positive, got {self.timeout_s}")
        taken = {"address", "num_sources", "num_destinations", "job", "timeout_s", "shared_memory"} & set(self.extra)
        if taken:
            raise ValueError(f"ReshardOptions.extra sets {sorted(taken)}, which reshard derives or has fields for")


def count_server_workers(engine: HttpEngine) -> int:
    """How many workers the vLLM server behind ``engine`` runs (asked through
    reshard's worker extension, which must be loaded)."""
    try:
        replies = engine.collective_rpc("reshard_status")
    except ReshardError as e:
        raise ReshardError(
            f"the vLLM server {engine.url} cannot be refit by reshard: start it with VLLM_SERVER_DEV_MODE=1 and "
            f"--worker-extension-cls {EXTENSION} ({e})"
        ) from e
    if not replies:
        raise ReshardError(f"the vLLM server {engine.url} reported no workers")
    return len(replies)


class ColocatedEngine:
    """The engine colocated with one trainer rank (TRL's colocate mode: an
    offline ``LLM`` per rank under ``external_launcher``, one worker in this
    process). Implements :class:`reshard.sender.engines.Engines`; the
    worker's refit rank is ``num_sources`` + its vLLM rank (the launcher's
    ``RANK``), so the engines of all ranks add up to ``num_destinations``."""

    def __init__(self, llm: Any, *, atomic: bool = False) -> None:
        self.llm = llm
        self.atomic = atomic
        self.workers: list[WorkerReply] = []

    def init(self, config: GroupConfig) -> None:
        spec = GroupSpec.of(config, atomic=self.atomic, with_token=True)
        self.workers = init_workers(self.llm, spec)

    def refit(self, refit: int, *, method: str = "reshard") -> list[WorkerReply]:
        replies = pull_workers(self.llm, refit, method=method)
        # Cached prefixes were computed with the old weights.
        flush_prefix_cache(self.llm)
        return replies


class TrlRefits:
    """One trainer rank's refits under TRL: the sender (built on the first
    sync, from the model as the trainer wrapped it), the engines this rank
    drives, and what every refit did."""

    def __init__(self, generation: Any, options: ReshardOptions) -> None:
        self.generation = generation
        self.options = options
        self.model_source: Callable[[], Any] = lambda: generation.model
        """The model to read: the trainer's ``model_wrapped`` once a trainer owns this."""
        self.sender: Sender | None = None
        self.engines: Any = None
        self.refits = 0
        """Refits pushed so far."""
        self.stats: list[RefitStats] = []
        """This rank's account of each refit."""
        self.engine_stats: list[list[EngineStats]] = []
        """Per refit, the account of every engine worker this rank drove
        (server mode: rank 0 drives every worker; colocate: its own)."""
        self.lora_request: Any = None
        """Adapter-only refits, colocate mode: the ``LoRARequest`` TRL's generation uses."""

    def address(self) -> str:
        if self.options.address is not None:
            return self.options.address
        host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
        return format_address(host, int(self.generation.group_port))

    def _shared_memory(self) -> bool:
        if self.options.shared_memory is not None:
            return self.options.shared_memory
        import torch

        return self.generation.mode == "colocate" and torch.cuda.is_available()

    def _build(self) -> Sender:
        gen = self.generation
        acc = gen.accelerator
        rank, world = int(acc.process_index), int(acc.num_processes)
        source = self.model_source()
        adapter = None
        if self.options.lora == "adapter":
            from reshard.sender.lora_adapter import LoraAdapter

            adapter = LoraAdapter(source)
        if gen.mode == "server":
            workers, error = 0, None
            if acc.is_main_process:
                engine = HttpEngine(gen.vllm_client.base_url)
                try:
                    workers = count_server_workers(engine)
                except Exception as e:
                    workers, error = -1, e  # every rank raises, none waits for the others
                if adapter is not None:
                    self.engines = _adapters([engine], self.options.lora_name, adapter, colocated=False)
                else:
                    self.engines = VllmEngines(
                        [engine], pause_mode=self.options.pause_mode, two_phase=self.options.two_phase,
                        atomic=self.options.atomic,
                    )  # fmt: skip
            workers = _from_main_process(acc, workers)
            if error is not None:
                raise error
            if workers < 0:
                raise ReshardError(f"trainer rank {rank}: trainer rank 0 could not set up the vLLM server's refits")
        elif gen.mode == "colocate":
            # One worker per rank: TRL's colocated engines run under
            # external_launcher, each rank one worker of its TP group.
            workers = world
            if adapter is not None:
                self.engines = _adapters([gen.llm], self.options.lora_name, adapter, colocated=True)
            else:
                self.engines = ColocatedEngine(gen.llm, atomic=self.options.atomic)
        else:
            raise ValueError(f"vllm_mode {gen.mode!r}: reshard refits 'server' and 'colocate' engines")
        config = GroupConfig(
            address=self.address(),
            num_sources=world,
            num_destinations=workers,
            job=self.options.job,
            timeout_s=self.options.timeout_s,
            shared_memory=self._shared_memory(),
            **self.options.extra,
        )
        self.sender = sender = Sender(source if adapter is None else adapter, config=config, rank=rank)
        log.info(
            "reshard: trainer rank %d of %d refits %d %s engine worker(s) through %s",
            rank, world, workers, gen.mode, config.address,
        )  # fmt: skip
        return sender

    def sync(self) -> None:
        """Refit the engines to the policy as it is now (every rank, collectively)."""
        if not self.options.sync:
            return
        sender = self.sender if self.sender is not None else self._build()
        n = self.refits + 1
        stats = sender.push(n, engines=self.engines)
        if self.options.lora == "adapter" and self.engines is not None:
            # TRL's generation takes the new version from here on.
            if self.generation.mode == "server":
                self.generation.vllm_client.model = self.engines.model()
            else:
                self.lora_request = self.engines.request()
        self.refits = n
        self.stats.append(stats)
        self.engine_stats.append(list(sender.engine_stats))

    def close(self) -> None:
        """Leave the refit group (the engines keep their weights)."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None


def _from_main_process(accelerator: Any, value: int) -> int:
    """``value`` as the main process has it, on every process."""
    if int(accelerator.num_processes) == 1:
        return value
    import torch
    from accelerate.utils import broadcast

    t = torch.tensor([value], dtype=torch.int64, device=accelerator.device)
    return int(broadcast(t, from_process=0).item())


_SWAP_LOCK = threading.RLock()


@contextlib.contextmanager
def _swapped(module: Any, name: str, value: Any) -> Iterator[None]:
    """``module.name`` is ``value`` inside the block (one swap at a time)."""
    with _SWAP_LOCK:
        original = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, original)


@_LAZY.builds("ReshardVLLMGeneration")
def _generation_class() -> type:
    """:class:`ReshardVLLMGeneration`, a subclass of TRL's ``VLLMGeneration``."""
    from trl.generation import vllm_generation as tvg

    class ReshardVLLMGeneration(tvg.VLLMGeneration):  # type: ignore[misc, valid-type]
        """TRL's ``VLLMGeneration`` with every weight sync a reshard refit
        (see :mod:`reshard.integrations.trl`). ``reshard``: the options."""

        def __init__(self, *args: Any, reshard: ReshardOptions | None = None, **kwargs: Any) -> None:
            # TRL's constructor starts the engine side (_init_vllm): the
            # refits object must exist before it.
            self.reshard = TrlRefits(self, ReshardOptions() if reshard is None else reshard)
            super().__init__(*args, **kwargs)

        def _init_vllm(self) -> None:
            if self.mode == "server":
                # TRL's own, minus init_communicator: no NCCL group (which
                # needs CUDA) and no weight-transfer engine on the server.
                if self.accelerator.is_main_process:
                    base_url = self.server_base_url
                    if base_url is None:
                        base_url = f"http://{self.server_host}:{self.server_port}"
                    self.vllm_client = tvg.VLLMClient(
                        base_url=base_url, group_port=self.group_port, connection_timeout=self.server_timeout
                    )
                self.accelerator.wait_for_everyone()
            elif self.mode == "colocate":
                # TRL builds the LLM with its own arguments; reshard adds its
                # worker extension.
                with _swapped(tvg, "LLM", _with_extension(tvg.LLM, self.reshard.options.llm_kwargs)):
                    super()._init_vllm()
                if self.reshard.options.lora == "adapter":
                    _generate_with_adapter(self.llm, self.reshard)
            else:
                super()._init_vllm()

        def sync_weights(self) -> None:
            # What TRL does first: a sleeping colocated engine gets its weight
            # memory back (a level-2 sleep dropped the weights; the refit
            # writes every one).
            if self.mode == "colocate" and self.enable_sleep_mode:
                tvg.empty_cache()
                self.llm.wake_up(tags=["weights"])
                self._llm_weights_sleeping = False
            self.reshard.sync()

    return ReshardVLLMGeneration


def _adapters(engines: list[Any], name: str, adapter: Any, *, colocated: bool) -> Any:
    from reshard.adapters.vllm.adapters import VllmAdapters

    return VllmAdapters(engines, name, adapter, colocated=colocated)


def _generate_with_adapter(llm: Any, refits: TrlRefits) -> None:
    """TRL's colocated ``llm.generate`` calls take the adapter's newest
    version (adapter-only refits: the engine's base weights stay the base)."""
    original = llm.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        if refits.lora_request is not None:
            kwargs.setdefault("lora_request", refits.lora_request)
        return original(*args, **kwargs)

    llm.generate = generate


def _with_extension(llm_cls: Any, extra: dict[str, Any]) -> Callable[..., Any]:
    def build(*args: Any, **kwargs: Any) -> Any:
        kwargs.update(extra)
        given = kwargs.get("worker_extension_cls")
        if given and given != EXTENSION:
            raise ValueError(f"the colocated LLM already has worker_extension_cls={given!r}; reshard needs {EXTENSION}")
        kwargs["worker_extension_cls"] = EXTENSION
        return llm_cls(*args, **kwargs)

    return build


def with_reshard(trainer_cls: type) -> type:
    """A subclass of the TRL trainer class ``trainer_cls`` (one that builds
    ``VLLMGeneration`` by its module-level name: ``GRPOTrainer``,
    ``RLOOTrainer``, ...) whose vLLM weight syncs are reshard refits. Its
    constructor takes ``reshard=ReshardOptions(...)`` besides the trainer's
    own arguments; the instance has ``reshard`` (a :class:`TrlRefits`),
    ``sync_weights()`` and ``close_reshard()``."""
    check_trl_version()
    from trl.generation.vllm_generation import VLLMGeneration

    # The TRL class in trainer_cls's ancestry whose module builds
    # VLLMGeneration by name (a user's subclass of GRPOTrainer inherits it).
    module = next(
        (
            m
            for m in (sys.modules.get(c.__module__) for c in trainer_cls.__mro__)
            if m is not None and getattr(m, "VLLMGeneration", None) is VLLMGeneration
        ),
        None,
    )
    if module is None:
        raise TypeError(
            f"{trainer_cls.__qualname__} ({trainer_cls.__module__}) does not build TRL's VLLMGeneration by name, "
            "nor does any class it derives from; reshard cannot replace its weight sync"
        )
    generation_cls = _generation_class()

    class Trainer(trainer_cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, reshard: ReshardOptions | None = None, **kwargs: Any) -> None:
            options = ReshardOptions() if reshard is None else reshard

            def build(*a: Any, **kw: Any) -> Any:
                return generation_cls(*a, reshard=options, **kw)

            with _swapped(module, "VLLMGeneration", build):
                super().__init__(*args, **kwargs)
            gen = getattr(self, "vllm_generation", None)
            if not getattr(self, "use_vllm", False) or gen is None:
                raise ValueError(
                    f"{type(self).__name__} refits vLLM engines with reshard: set use_vllm=True in its config"
                )
            # Read the model as the trainer wrapped it (FSDP1 and DeepSpeed
            # wrap it in another object when training starts).
            gen.reshard.model_source = lambda: self.model_wrapped

        @property
        def reshard(self) -> TrlRefits:
            """This rank's refits (``refits``, ``stats``, ``engine_stats``, ``sender``)."""
            return self.vllm_generation.reshard

        def sync_weights(self) -> None:
            """Refit the engines to the policy now, e.g. after ``train()``
            (every rank, collectively; TRL syncs before each generation)."""
            self.vllm_generation.sync_weights()

        def close_reshard(self) -> None:
            """Leave the refit group (the engines keep their weights)."""
            self.vllm_generation.reshard.close()

    Trainer.__name__ = Trainer.__qualname__ = f"Reshard{trainer_cls.__name__}"
    Trainer.__module__ = __name__
    Trainer.__doc__ = (
        f"TRL's {trainer_cls.__name__} with every vLLM weight sync a reshard refit (see reshard.integrations.trl)."
    )
    return Trainer


@_LAZY.builds("ReshardGRPOTrainer")
def _grpo_trainer() -> type:
    import trl

    return with_reshard(trl.GRPOTrainer)


@_LAZY.builds("ReshardRLOOTrainer")
def _rloo_trainer() -> type:
    import trl

    return with_reshard(trl.RLOOTrainer)


# ``ReshardGRPOTrainer``, ``ReshardRLOOTrainer`` and ``ReshardVLLMGeneration``
# import TRL when first asked for.
__getattr__ = _LAZY.getattr
