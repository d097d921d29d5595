"""The ``vllm.general_plugins`` entry point: registers the ``reshard`` backend.

vLLM loads general plugins in the API server, the engine core and every
worker, before the model is built; after that
``--weight-transfer-config '{"backend": "reshard"}'`` creates
:class:`reshard.adapters.vllm.backend.ReshardEngine` in each worker, and
``WeightTransferTrainerFactory`` knows the trainer side.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    # Plugins may be loaded more than once per process; registering twice raises.
    if "reshard" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("reshard", "reshard.adapters.vllm.backend", "ReshardEngine")
    trainer_registry = getattr(WeightTransferTrainerFactory, "_registry", {})
    if "reshard" not in trainer_registry:
        WeightTransferTrainerFactory.register_engine("reshard", "reshard.adapters.vllm.backend", "ReshardTrainerEngine")
