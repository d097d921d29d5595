"""Learn where vLLM puts every checkpoint box, from vLLM's own loaders.

A dry run, once per engine worker (see :mod:`reshard.adapters.core.recording`):
inside vLLM's layerwise reload lifecycle every parameter is a meta tensor of
its checkpoint-loading shape, so the model's own ``load_weights`` runs on
meta stand-ins for the checkpoint tensors and every write is recorded. No
memory is used: it is all meta. Afterwards the lifecycle is finalized and the
model is back to its live weights.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from reshard.adapters.core.recording import LearnedLayout, record_loads
from reshard.plan.layout import TensorMeta

if TYPE_CHECKING:
    import torch

__all__ = ["learn_layout"]


@contextlib.contextmanager
def _quiet(names: Iterable[str]):
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels, strict=True):
            lg.setLevel(lv)


def learn_layout(model: torch.nn.Module, model_config, tensors: Iterable[TensorMeta]) -> LearnedLayout:
    """Dry-run ``model.load_weights`` on meta tensors and record where each
    checkpoint box lands. The model is back to its live weights afterwards."""
    from vllm.model_executor.model_loader.reload import layerwise

    params: dict[int, tuple[str, torch.Tensor]] = {}
    layers: dict[str, list[str]] = defaultdict(list)
    quiet = ["vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload"]
    layerwise.initialize_layerwise_reload(model)
    try:
        for mod_name, mod in model.named_modules():
            for pname, p in list(mod._parameters.items()) + list(mod._buffers.items()):
                if p is None:
                    continue
                full = f"{mod_name}.{pname}" if mod_name else pname
                key = p.untyped_storage()._cdata
                if key not in params:
                    params[key] = (full, p)
                    layers[mod_name].append(full)
                # The dry run calls vLLM's loaders directly, not the reload wrappers.
                if hasattr(p, "weight_loader"):
                    p.weight_loader = layerwise._get_original_loader(p)
        # Some parameters (``bias``) stay live during a reload: the recorder
        # performs no write into any of them.
        return record_loads(params, layers, tensors, model.load_weights, strict=False)  # type: ignore[arg-type]
    finally:
        with _quiet(quiet):
            layerwise.finalize_layerwise_reload(model, model_config)
