"""The ``vllm.general_plugins`` entry point: registers the ``reshard`` backend
and makes an engine core report which adapter versions its requests use.

vLLM loads general plugins in the API server, the engine core and every
worker, before the model is built; after that
``--weight-transfer-config '{"backend": "reshard"}'`` creates
:class:`reshard.adapters.vllm.backend.ReshardEngine` in each worker, and
``WeightTransferTrainerFactory`` knows the trainer side. A trainer process
that never starts an engine does not load plugins: importing
:mod:`reshard.adapters.vllm.backend` (for ``ReshardTrainerInitInfo``)
registers the backend there. In the engine core's process the plugin
installs the report adapter-only refits retire old versions by
(:func:`reshard.adapters.vllm.lora_versions.install_core_report`).
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
    from reshard.adapters.vllm.lora_versions import install_core_report

    install_core_report()
    _init_cpu_amx()


def _init_cpu_amx() -> None:
    """vLLM's CPU workers started by its multiprocess executor run bf16
    matmuls through oneDNN's AMX kernels without asking the kernel for AMX
    tile state first, and die of SIGILL on AMX CPUs; the first load of every
    worker runs this plugin, so ask here (a no-op elsewhere)."""
    try:
        import torch

        init = getattr(torch.cpu, "_init_amx", None)
        if init is not None and not torch.cuda.is_available():
            init()
    except Exception:  # never let a hardware probe break an engine's start
        pass
