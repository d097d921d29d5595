"""vLLM's native weight-transfer API with reshard behind it:
``--weight-transfer-config '{"backend": "reshard"}'``.

Registered by the ``vllm.general_plugins`` entry point (``plugin.py``), so
no user code runs inside vLLM. The worker side (:class:`ReshardEngine`) and
the trainer side (:class:`ReshardTrainerEngine`) follow vLLM's contract:

- ``init_weight_transfer_engine({"init_info": {...}})`` on every worker:
  ``address``, ``num_sources``, ``num_destinations`` and optionally ``job``,
  ``generation``, ``engine_offset``, ``timeout_s``, ``budget_bytes``,
  ``domain``, ``atomic``. The worker learns its layout from vLLM's loaders.
- per refit: ``start_weight_update`` (nothing yet: the model is touched only
  once every rank agreed on the plan), ``update_weights({"update_info":
  {"refit": n}})`` (the whole pull, while trainer ranks push), then
  ``finish_weight_update``.

It shares :class:`~reshard.adapters.vllm.receiver.VllmReceiver` with the
worker extension.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

__all__ = ["ReshardEngine", "ReshardInitInfo", "ReshardTrainerEngine", "ReshardTrainerInitInfo", "ReshardUpdateInfo"]


@dataclass
class ReshardInitInfo(WeightTransferInitInfo):
    address: str
    num_sources: int
    num_destinations: int
    job: str = "reshard"
    generation: int = 0
    engine_offset: int = 0
    timeout_s: float = 300.0
    budget_bytes: int = 256 << 20
    domain: str | None = None
    atomic: bool = False


@dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    refit: int
    method: str = "reshard"


class ReshardEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
    """The worker side: one per vLLM worker."""

    receiver: Any = None
    failed: bool = False
    init_info_cls = ReshardInitInfo
    update_info_cls = ReshardUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        import torch.distributed as dist

        from reshard.adapters.vllm.receiver import VllmReceiver
        from reshard.transport.group import GroupConfig

        old = getattr(self, "receiver", None)
        if old is not None:
            old.close()
        cfg = GroupConfig(
            address=init_info.address,
            num_sources=init_info.num_sources,
            num_destinations=init_info.num_destinations,
            job=init_info.job,
            generation=init_info.generation,
            timeout_s=init_info.timeout_s,
            domain=init_info.domain,
            host_store=False,
        )
        worker_rank = dist.get_rank() if dist.is_initialized() else 0
        self.receiver = VllmReceiver(
            self.model,
            self.model_config,
            config=cfg,
            rank=init_info.num_sources + init_info.engine_offset + worker_rank,
            device=self.device,
            budget_bytes=init_info.budget_bytes,
            atomic=init_info.atomic,
        )

    def start_weight_update(self) -> None:
        if getattr(self, "receiver", None) is None:
            raise RuntimeError("init_weight_transfer_engine must run before a weight update")

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        import torch.distributed as dist

        try:
            self.receiver.pull(update_info.refit, method=update_info.method)
        except Exception:
            # vLLM 0.32's multiprocess executor stops reading replies at the
            # first worker that raised; the others' replies would then answer
            # the next call. Every rank holds the same error (reshard raises
            # one error on every rank), so only the last worker raises it.
            world = dist.get_world_size() if dist.is_initialized() else 1
            rank = dist.get_rank() if dist.is_initialized() else 0
            if rank == world - 1:
                raise
            self.failed = True

    def finish_weight_update(self) -> None:
        """Nothing left: the pull already finalized vLLM's reload lifecycle."""

    def shutdown(self) -> None:
        r = getattr(self, "receiver", None)
        if r is not None:
            r.close()
            self.receiver = None


@dataclass
class ReshardTrainerInitInfo(TrainerInitInfo):
    """Trainer side: the refit group, and how engine workers are numbered."""

    backend: ClassVar[str] = "reshard"
    address: str = ""
    num_sources: int = 1
    num_destinations: int = 1
    job: str = "reshard"
    generation: int = 0
    timeout_s: float = 300.0
    worker_init: dict[str, Any] = field(default_factory=dict)
    """Extra worker-side init keys (``engine_offset``, ``budget_bytes``, ``domain``)."""


class ReshardTrainerEngine(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    """Every trainer rank holds a :class:`reshard.Sender`; rank 0 also drives
    the engine through vLLM's weight-sync client, concurrently with the push."""

    init_info_cls = ReshardTrainerInitInfo
    sender: Any
    refits: int = 0

    @classmethod
    def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client, source=None) -> ReshardTrainerEngine:
        from reshard.sender import Sender
        from reshard.transport.group import GroupConfig, serve_store

        module = getattr(source, "_module", source)
        if module is None:
            raise ValueError("the reshard trainer engine needs a source module (vLLM's ModuleSource or an nn.Module)")
        self = cls(client=client, source=source, is_sender=init_info.is_sender)
        cfg = GroupConfig(
            address=init_info.address,
            num_sources=init_info.num_sources,
            num_destinations=init_info.num_destinations,
            job=init_info.job,
            generation=init_info.generation,
            timeout_s=init_info.timeout_s,
            host_store=False,
        )
        if self.is_sender:
            worker = {
                "address": init_info.address,
                "num_sources": init_info.num_sources,
                "num_destinations": init_info.num_destinations,
                "job": init_info.job,
                "generation": init_info.generation,
                "timeout_s": init_info.timeout_s,
                **init_info.worker_init,
            }
            # The store lives in this process; create it before the workers dial in.
            serve_store(cfg)
            client.init_weight_transfer_engine({"init_info": worker})
        self.sender = Sender(module, config=cfg, rank=init_info.rank)
        self.refits = 0
        return self

    def send_weights(self) -> None:
        self.refits += 1
        refit = self.refits
        errors: list[BaseException] = []
        driver = None
        if self.is_sender:

            def drive() -> None:
                try:
                    self.client.start_weight_update()
                except BaseException as e:  # re-raised below
                    errors.append(e)
                    return
                try:
                    self.client.update_weights({"update_info": asdict(ReshardUpdateInfo(refit=refit))})
                except BaseException as e:  # re-raised below
                    errors.append(e)
                    _close_failed_update(self.client)
                    return
                try:
                    self.client.finish_weight_update()
                except BaseException as e:  # re-raised below
                    errors.append(e)

            driver = threading.Thread(target=drive, name="reshard-drive-engine", daemon=True)
            driver.start()
        try:
            self.sender.push(refit)
        finally:
            if driver is not None:
                driver.join()
        if errors:
            raise errors[0]

    def shutdown(self) -> None:
        self.sender.close()


def _close_failed_update(client) -> None:
    """Close the update session on the workers that did not raise.

    A failed pull raises only on the last worker (see
    :meth:`ReshardEngine.receive_weights`), and vLLM marks the session closed
    only where ``update_weights`` raised; the other workers would refuse the
    next ``start_weight_update``. ``finish_weight_update`` closes theirs (the
    reshard engine's finish is a no-op, the model was restored by the pull)
    and raises on the last worker, which has nothing open: that error is
    expected. Drivers other than :class:`ReshardTrainerEngine` do the same.
    """
    with contextlib.suppress(Exception):
        client.finish_weight_update()
