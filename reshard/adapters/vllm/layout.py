"""Learn where vLLM puts every checkpoint box, from vLLM's own loaders.

A dry run, once per engine worker (see :mod:`reshard.adapters.core.recording`):
inside vLLM's layerwise reload lifecycle every parameter is a meta tensor of
its checkpoint-loading shape, so the model's own ``load_weights`` runs on
meta stand-ins for the checkpoint tensors and every write is recorded. No
memory is used: it is all meta. Afterwards every layer gets its live tensors
back, and none is processed again (see
:func:`reshard.adapters.vllm.lifecycle.restore_unprocessed`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from reshard.adapters.core.recording import LearnedLayout, record_loads
from reshard.adapters.vllm.lifecycle import restore_unprocessed
from reshard.plan.layout import TensorMeta

if TYPE_CHECKING:
    import torch

__all__ = ["learn_layout"]


def learn_layout(model: torch.nn.Module, tensors: Iterable[TensorMeta]) -> LearnedLayout:
    """Dry-run ``model.load_weights`` on meta tensors and record where each
    checkpoint box lands. The model is back to its live weights afterwards,
    and no layer is processed again (nothing was written)."""
    from vllm.model_executor.model_loader.reload import layerwise

    params: dict[int, tuple[str, torch.Tensor]] = {}
    layers: dict[str, list[str]] = defaultdict(list)
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
        restore_unprocessed(model)
