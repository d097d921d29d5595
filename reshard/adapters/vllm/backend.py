"""vLLM's native weight-transfer API with reshard behind it:
``--weight-transfer-config '{"backend": "reshard"}'``.

Registered by the ``vllm.general_plugins`` entry point (``plugin.py``) in
engine processes, and by importing this module in trainer processes, so no
user code runs inside vLLM. The worker side (:class:`ReshardEngine`) and the
trainer side (:class:`ReshardTrainerEngine`) follow vLLM's contract, so
vLLM's own weight-sync clients drive them: ``HTTPVLLMWeightSyncClient``
(a server started with ``VLLM_SERVER_DEV_MODE=1``), ``RayVLLMWeightSyncClient``,
or an offline ``LLM``.

- ``init_weight_transfer_engine(init_info)`` on every worker, ``init_info``
  a :class:`ReshardInitInfo` as a dict (``address``, ``num_sources``,
  ``num_destinations`` and optionally ``job``, ``generation``,
  ``engine_offset``, ``timeout_s``, ``budget_bytes``, ``domain``,
  ``atomic``, ``checksums``). The worker learns its layout from vLLM's
  loaders.
- per refit: ``start_weight_update`` (nothing yet: the model is touched only
  once every rank agreed on the plan), ``update_weights({"refit": n})`` (the
  whole pull, while trainer ranks push), then ``finish_weight_update``.
- a two-phase refit (``ReshardTrainerInitInfo(two_phase=True)``) splits the
  update in two calls: ``update_weights({"refit": n, "phase": "stage"})``
  starts receiving into staging buffers and returns at once, so the engine
  keeps serving on its old weights while trainer ranks push; once they are
  done, ``update_weights({"refit": n, "phase": "commit"})`` applies the
  staged weights (a server is paused around it by the trainer engine, with
  requests in flight finishing first). A staging failure surfaces at the
  commit, with the serving weights untouched.

**Replies never go stale**: see :mod:`reshard.adapters.vllm.guard`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferInitRequest,
    WeightTransferUpdateInfo,
    WeightTransferUpdateRequest,
)

from reshard.adapters.core.replies import raise_from_text
from reshard.adapters.core.spec import GroupSpec
from reshard.adapters.vllm.guard import executor_rank, install_worker_guard
from reshard.errors import MixedWeightsError, ReshardError
from reshard.sender.engines import push_beside
from reshard.transport.config import GROUP, TRAINER, settings
from reshard.transport.wire import MAX_MESSAGE_BYTES

if TYPE_CHECKING:
    from reshard.transport.group import GroupConfig

__all__ = [
    "ReshardEngine",
    "ReshardInitInfo",
    "ReshardTrainerEngine",
    "ReshardTrainerInitInfo",
    "ReshardUpdateInfo",
    "executor_rank",
    "weight_sync_client",
]


class ReshardInitInfo(WeightTransferInitInfo):
    """The worker side's init info: the fields of
    :class:`reshard.adapters.core.spec.GroupSpec` as keywords, but the job
    token (workers read ``$RESHARD_TOKEN`` from their own environment).
    vLLM builds it from the request's dict; unknown or mistyped keys are a
    ``TypeError`` naming them, which vLLM reports as an invalid init_info."""

    spec: GroupSpec

    def __init__(self, **fields: Any) -> None:
        if "token" in fields:
            raise TypeError("the job token never travels in init_info: workers read $RESHARD_TOKEN")
        try:
            self.spec = GroupSpec.parse(fields)
        except msgspec.ValidationError as e:
            raise TypeError(f"{e}") from None

    def __repr__(self) -> str:
        return f"ReshardInitInfo({self.spec!r})"


_PHASES = ("pull", "stage", "commit")


@dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    refit: int
    method: str = "reshard"
    phase: str = "pull"
    """``pull`` (the whole refit in this call), or a two-phase refit's
    ``stage`` (start receiving into staging buffers) and ``commit`` (apply)."""

    def __post_init__(self) -> None:
        if self.phase not in _PHASES:
            raise ValueError(f"unknown update phase {self.phase!r}; use one of {', '.join(_PHASES)}")


class ReshardEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
    """The worker side: one per vLLM worker."""

    receiver: Any = None
    init_info_cls = ReshardInitInfo
    update_info_cls = ReshardUpdateInfo
    reshard_guarded: ClassVar[bool] = True
    """The worker guard acts for workers whose engine says this."""
    supports_draft_weight_update = True
    worker: Any = None
    """The vLLM worker this engine serves (set by the worker guard): where its drafter is found."""
    draft_session: bool = False
    """The open session is vLLM's draft session (``start_draft_weight_update``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        install_worker_guard()

    def set_weight_update_target(self, model: Any, model_config: Any) -> None:
        """vLLM's draft session retargets the engine at the drafter: its
        refits then pull the drafter's layout alone (sliced, see
        :meth:`reshard.adapters.vllm.receiver.VllmReceiver.pull_drafter`)."""
        super().set_weight_update_target(model, model_config)
        self.draft_session = model is not self._default_model

    def reset_weight_update_target(self) -> None:
        super().reset_weight_update_target()
        self.draft_session = False

    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        import torch.distributed as dist

        from reshard.adapters.vllm.drafter import find_drafter
        from reshard.adapters.vllm.receiver import VllmReceiver

        self.shutdown()
        spec = init_info.spec
        worker_rank = dist.get_rank() if dist.is_initialized() else 0
        self.receiver = VllmReceiver(
            self.model,
            self.model_config,
            config=spec.config(),
            rank=spec.rank_of(worker_rank),
            device=self.device,
            budget_bytes=spec.budget_bytes,
            atomic=spec.atomic,
            vllm_config=self.vllm_config,
            drafter=find_drafter(self.worker) if self.worker is not None else None,
            draft=spec.draft,
        )

    def start_weight_update(self) -> None:
        if self.receiver is None:
            raise RuntimeError("init_weight_transfer_engine must succeed before a weight update")
        if self.draft_session and self.receiver.draft_mode in ("", "frozen"):
            raise ReshardError(
                "no drafter to update: "
                + ("the drafter was declared frozen (draft='frozen')" if self.receiver.draft_mode else "none")
            )

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        refit, method = update_info.refit, update_info.method
        if self.draft_session:
            if update_info.phase != "pull":
                raise ReshardError(f"a draft session refits in one phase, not {update_info.phase!r}")
            self.receiver.pull_drafter(refit, method=method)
        elif update_info.phase == "stage":
            self.receiver.stage(refit, method=method)
        elif update_info.phase == "commit":
            self.receiver.commit(refit, wait_s=self.receiver.timeout_s)
        else:
            self.receiver.pull(refit, method=method)

    def finish_weight_update(self) -> None:
        """Nothing left: the pull already finalized vLLM's reload lifecycle."""

    def shutdown(self) -> None:
        r = self.receiver
        self.receiver = None
        if r is not None:
            r.close()


# -- the trainer side -----------------------------------------------------------


@dataclass
class ReshardTrainerInitInfo(TrainerInitInfo):
    """Trainer side: the refit group, and how engine workers are numbered.

    The group settings are :class:`~reshard.transport.group.GroupConfig`'s
    fields of scopes ``group`` and ``trainer``, with their defaults (see
    there; ``tests/test_group_settings.py`` pins them), but ``backend``: this
    class attribute names vLLM's weight-transfer backend, so the process
    group's is ``group_backend``."""

    backend: ClassVar[str] = "reshard"
    address: str = ""
    num_sources: int = 1
    num_destinations: int = 1
    job: str = "reshard"
    generation: int = 0
    timeout_s: float = 300.0
    group_backend: str = "auto"
    checksums: bool = False
    max_metadata_bytes: int = MAX_MESSAGE_BYTES
    worker_init: dict[str, Any] = field(default_factory=dict)
    """Extra worker-side init keys (``engine_offset``, ``budget_bytes``, ``domain``, ``atomic``)."""
    two_phase: bool = False
    """Refit in two phases: workers receive into staging buffers while the
    engine serves, then apply with generation paused only for that."""
    shared_memory: bool = False
    """Colocated trainer ranks and workers on one host move bytes directly:
    CPU tensors through shared memory, CUDA tensors by CUDA IPC (workers read
    the trainer's GPU tensors); see ``GroupConfig.shared_memory``."""
    export_sources: bool = False
    """With ``shared_memory``: the trainer's CPU tensors move into shared
    memory once and colocated workers read them directly (one copy); see
    ``GroupConfig.export_sources``."""
    pause_mode: str | None = None
    """How a server pauses around a two-phase commit (vLLM's ``/pause``
    modes); ``None``: the mode that fails no request on the server's vLLM
    version (:func:`reshard.adapters.vllm.driver.pause_mode_for`)."""
    delta: bool = False
    """Delta refits: only the elements that changed since the last refit
    move (``GroupConfig.delta``, ``docs/delta.md``)."""
    delta_budget_bytes: int | None = None
    """Bound on each trainer rank's snapshot of what it sent last (``GroupConfig.delta_budget_bytes``)."""
    replica_size: int | None = None
    """Engine worker ranks per replica (``GroupConfig.replica_size``)."""
    min_replicas: int | None = None
    """The fewest replicas a refit may run with (``GroupConfig.min_replicas``)."""
    join_timeout_s: float | None = None
    replica_timeout_s: float | None = None

    def group_config(self) -> GroupConfig:
        """The :class:`GroupConfig` this trainer rank joins with (the driver
        hosts the store itself, before the workers dial in)."""
        from reshard.transport.group import GroupConfig

        return GroupConfig(
            **settings(self, GROUP, TRAINER, exclude=("backend",)), backend=self.group_backend, host_store=False
        )


class _OfflineClient:
    """An offline ``LLM`` as a weight-sync client: vLLM's clients take bare
    dicts, ``LLM``'s methods take them wrapped in request objects."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def start_draft_weight_update(self) -> None:
        self.llm.start_draft_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


def weight_sync_client(client: Any) -> Any:
    """``client`` as vLLM's ``VLLMWeightSyncClient`` protocol (bare dicts):
    an offline ``LLM`` is wrapped; vLLM's HTTP and Ray clients pass as they are."""
    from vllm.entrypoints.rl.offline import RLOfflineMixin

    return _OfflineClient(client) if isinstance(client, RLOfflineMixin) else client


class ReshardTrainerEngine(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    """Every trainer rank holds a :class:`reshard.Sender`; rank 0 also drives
    the engine through vLLM's weight-sync client, concurrently with the push."""

    init_info_cls = ReshardTrainerInitInfo
    sender: Any
    refits: int = 0
    two_phase: bool = False
    pause_mode: str = "wait"

    @classmethod
    def trainer_init(
        cls, init_info: ReshardTrainerInitInfo, *, client, source=None, draft=None, draft_names: str = "draft."
    ) -> ReshardTrainerEngine:
        """``draft``: a speculative drafter trained beside the policy,
        published with it under the engine's drafter names (see
        :class:`reshard.Sender`): refit with the target
        (``worker_init={"draft": "refit"}``, the default), or in vLLM's
        draft sessions (:meth:`send_draft_weights`, with
        ``worker_init={"draft": "separate"}``). (vLLM's factory passes no
        ``draft``: call this class's ``trainer_init`` for one.)"""
        from reshard.sender import Sender
        from reshard.transport.group import serve_store

        module = getattr(source, "_module", source)
        if module is None:
            raise ValueError("the reshard trainer engine needs a source module (vLLM's ModuleSource or an nn.Module)")
        if init_info.pause_mode not in (None, "wait", "keep", "abort"):
            raise ValueError(f"pause_mode must be wait, keep, abort or None, got {init_info.pause_mode!r}")
        self = cls(client=weight_sync_client(client), source=source, is_sender=init_info.is_sender)
        cfg = init_info.group_config()
        draft = getattr(draft, "_module", draft)
        self.sender = Sender(module, config=cfg, rank=init_info.rank, draft=draft, draft_names=draft_names)
        self.refits = 0
        self.two_phase = init_info.two_phase
        self.pause_mode = init_info.pause_mode or _server_pause_mode(self.client)
        if self.is_sender:
            worker = GroupSpec.of(cfg, **init_info.worker_init).init_info()
            # The store lives in this process; create it before the workers dial in.
            serve_store(cfg)
            self.client.init_weight_transfer_engine(worker)
        return self

    def send_weights(self) -> None:
        self._send(draft=False)

    def send_draft_weights(self) -> None:
        """Refit the engine's drafter alone, in vLLM's draft session
        (``start_draft_weight_update``, update, finish; every trainer rank,
        collectively): each worker pulls the drafter's slices it keeps, the
        trainer ranks push what they publish (the policy's bytes do not
        move). Needs a ``draft`` at :meth:`trainer_init`."""
        self._send(draft=True)

    def _send(self, *, draft: bool) -> None:
        """One refit: this rank pushes; the driving rank also drives the
        engine's session beside the push (the target's, or the drafter's)."""
        self.refits += 1
        refit = self.refits
        push = functools.partial(self.sender.push, refit)
        if not self.is_sender:
            push()
            return
        push_beside(push, functools.partial(self._drive, refit, draft=draft), cancel=self.sender.cancel)

    def _drive(self, refit: int, pushed: threading.Event, *, draft: bool = False) -> None:
        """The engine's side of refit ``refit``, through vLLM's weight-sync client."""
        client = self.client
        if draft:
            _call(_draft_start(client))
            _call(client.update_weights, asdict(ReshardUpdateInfo(refit=refit)))
            _call(client.finish_weight_update)
            reset_prefix_cache(client)
            return
        _call(client.start_weight_update)
        if not self.two_phase:
            _call(client.update_weights, asdict(ReshardUpdateInfo(refit=refit)))
            _call(client.finish_weight_update)
            # Cached prefixes were computed with the old weights.
            reset_prefix_cache(client)
            return
        _call(client.update_weights, asdict(ReshardUpdateInfo(refit=refit, phase="stage")))
        # The engine serves on its old weights while the workers receive;
        # the commit raises if staging failed.
        pushed.wait()
        with paused(client, self.pause_mode):
            _call(client.update_weights, asdict(ReshardUpdateInfo(refit=refit, phase="commit")))
            _call(client.finish_weight_update)
            reset_prefix_cache(client, running=self.pause_mode == "keep")

    def shutdown(self) -> None:
        self.sender.close()


def _draft_start(client: Any):
    """``client``'s start of a draft session: its own method where it has
    one, else vLLM's ``POST /start_draft_weight_update`` (vLLM 0.32's HTTP
    client has no method for it)."""
    start = getattr(client, "start_draft_weight_update", None)
    if start is not None:
        return start
    post = getattr(client, "_post", None)
    if post is None:
        raise ReshardError(f"{type(client).__name__} cannot start vLLM's draft session")

    def start_draft_weight_update() -> None:
        post("/start_draft_weight_update")

    return start_draft_weight_update


def _call(fn, *args: Any) -> None:
    """Call a weight-sync client method. A failure the workers reported
    becomes the typed error they reported (:func:`raise_from_text`: a
    :class:`MixedWeightsError` where weights now mix); another HTTP error
    carries the server's answer (vLLM's HTTP client raises
    ``requests.HTTPError`` naming only the status)."""
    try:
        fn(*args)
    except Exception as e:
        response = getattr(e, "response", None)
        text = getattr(response, "text", None)
        try:
            raise_from_text(text or str(e), fn.__name__)
        except ReshardError as typed:
            raise typed from e
        if not text:
            raise
        raise ReshardError(f"{fn.__name__}: {e}: {text[:4000]}") from e


@contextlib.contextmanager
def paused(client: Any, mode: str) -> Iterator[None]:
    """Pause a server's generation (vLLM's ``POST /pause?mode=...``, a
    dev-mode route) for the block, and resume it after, unless the block
    failed leaving old and new weights mixed. Other clients run the block as
    it is: an offline ``LLM`` does not generate meanwhile, and the engine
    runs the update calls between its steps."""
    base_url = getattr(client, "base_url", None)
    if base_url is None:
        yield
        return
    import requests

    timeout = getattr(client, "timeout", 300)
    requests.post(f"{base_url}/pause", params={"mode": mode}, timeout=timeout).raise_for_status()
    try:
        yield
    except MixedWeightsError:
        raise
    except BaseException:
        requests.post(f"{base_url}/resume", timeout=timeout).raise_for_status()
        raise
    requests.post(f"{base_url}/resume", timeout=timeout).raise_for_status()


def _server_pause_mode(client: Any) -> str:
    """The pause mode for ``client``'s server (see :func:`reshard.adapters.vllm.driver.pause_mode_for`)."""
    from reshard.adapters.vllm.driver import HttpEngine, pause_mode_for

    base_url = getattr(client, "base_url", None)
    if base_url is None:
        return "wait"  # an offline engine or Ray actors: never paused
    return pause_mode_for(HttpEngine(base_url, timeout_s=getattr(client, "timeout", 300)).version())


def reset_prefix_cache(client: Any, *, running: bool = False) -> None:
    """Drop the engine's cached prefixes (computed with the old weights), or
    raise if it cannot (see :func:`reshard.adapters.vllm.driver.flush_prefix_cache`):
    ``POST /reset_prefix_cache`` for vLLM's HTTP client (a dev-mode route, as
    the weight-transfer routes are), ``reset_prefix_cache()`` for an offline
    ``LLM`` or every Ray actor."""
    from reshard.adapters.vllm.driver import HttpEngine, flush_prefix_cache

    if isinstance(client, _OfflineClient):
        flush_prefix_cache(client.llm)
        return
    base_url = getattr(client, "base_url", None)
    if base_url is not None:
        flush_prefix_cache(HttpEngine(base_url, timeout_s=getattr(client, "timeout", 300)), running=running)
        return
    handles = getattr(client, "handles", None)
    if handles is not None:
        for h in handles:
            flush_prefix_cache(_RayEngine(h))


class _RayEngine:
    """One Ray engine actor, as :func:`flush_prefix_cache` calls it."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __repr__(self) -> str:
        return f"RayEngine({self.handle!r})"

    def reset_prefix_cache(self, running: bool = False) -> bool:
        import ray

        call = self.handle.reset_prefix_cache
        return ray.get(call.remote(running) if running else call.remote())


def _register() -> None:
    from reshard.adapters.vllm.plugin import register

    register()


# A trainer process that never starts an engine never loads vLLM's plugins:
# importing this module (for ReshardTrainerInitInfo) registers the backend.
_register()
