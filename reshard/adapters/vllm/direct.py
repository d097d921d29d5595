"""Which layers of a vLLM worker take a refit's bytes in place, outside the
layerwise reload lifecycle.

vLLM's reload gives every layer fresh parameters, loads them, runs
``process_weights_after_loading`` and copies the result into the live
tensors the engine reads. For a layer whose live tensors *are* its
checkpoint-loading tensors (an RMSNorm weight, an embedding or untied head
on CPU), that is a fresh allocation and a copy of bytes that could have
landed where the engine reads them. Such a layer is *direct*: a refit
receives into its live tensors and, where it has a ``quant_method``, runs
that method's processing on the live layer afterwards, so whatever the
engine derives from the weights (the CPU head's packed oneDNN copy) is
derived again from the new values.

The choice is made per layer from what this engine did, never from a table
(:func:`direct_layers`):

1. the learned pieces tile each of its parameters exactly (:meth:`LearnedLayout.whole`)
   and no loader tensor writes it (those need the engine's loader);
2. every tensor the layer holds is one of those parameters, and the live
   tensor has the checkpoint-loading shape and dtype, contiguous (a linear
   layer whose weight was released after packing, an fp8 weight, a padded
   vocabulary all fail here);
3. it is not an attention layer vLLM processes at the end, and no
   correction of reshard's applies to it (CPU MoE experts, packed again by
   :func:`reshard.adapters.vllm.lifecycle.repack_cpu_experts`, not by their
   ``quant_method``);
4. if it has a ``quant_method``: its processing, run once at start-up on a
   copy of the layer (clones of its tensors, never the live ones), leaves
   every tensor the same object with the same bytes. Processing that
   repacks, quantizes, casts or replaces a tensor makes the layer go
   through the lifecycle.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from reshard.adapters.vllm.lifecycle import has_cpu_experts

if TYPE_CHECKING:
    import torch

    from reshard.adapters.core.recording import LearnedLayout

__all__ = ["direct_layers", "process_live"]

log = logging.getLogger(__name__)


def direct_layers(modules: Mapping[str, Any], learned: LearnedLayout, whole: frozenset[str]) -> frozenset[str]:
    """The module names of the layers that take their bytes in place (see
    the module docstring for the rule)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    dtypes = {p.local: p.local_dtype or p.tensor.dtype for p in learned.pieces}
    loader = learned.loader_params
    out = set()
    for name, params in learned.layers.items():
        module = modules[name]
        if is_deferred_attention_layer(module) or has_cpu_experts(module):
            continue
        if any(p not in whole or p in loader for p in params):
            continue
        own = {f"{name}.{k}" if name else k: t for k, t in _tensors(module).items()}
        if set(own) != set(params):
            continue
        if not all(_plain(t, learned.local_shapes.get(p), dtypes.get(p)) for p, t in own.items()):
            continue
        if _has_processing(module) and not _processing_keeps(module):
            continue
        out.add(name)
    if out:
        log.debug("layers that take their bytes in place: %s", sorted(out))
    return frozenset(out)


def process_live(module: Any) -> None:
    """Run ``module``'s processing on its live tensors, as vLLM's reload
    does after loading a layer (for a direct layer, whose processing was
    proven to leave its tensors as they are)."""
    if not _has_processing(module):
        return
    if hasattr(module, "_already_called_process_weights_after_loading"):
        delattr(module, "_already_called_process_weights_after_loading")
    module.quant_method.process_weights_after_loading(module)
    if hasattr(module, "update_param_tp_status"):
        module.update_param_tp_status()


def _tensors(module: Any) -> dict[str, torch.Tensor]:
    return {k: t for k, t in list(module._parameters.items()) + list(module._buffers.items()) if t is not None}


def _plain(t: torch.Tensor, shape: tuple[int, ...] | None, dtype: str | None) -> bool:
    return (
        shape is not None
        and not t.is_meta
        and t.is_contiguous()
        and tuple(t.shape) == tuple(shape)
        and str(t.dtype).removeprefix("torch.") == dtype
    )


def _has_processing(module: Any) -> bool:
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    return isinstance(getattr(module, "quant_method", None), QuantizeMethodBase)


def _processing_keeps(module: Any) -> bool:
    """Whether ``module``'s processing leaves every tensor it holds the same
    object with the same bytes, tried on a copy of the module whose tensors
    are clones (the live module and its tensors are not touched)."""
    import torch

    cls: Any = type(module)
    shadow = cls.__new__(cls)
    shadow.__dict__.update(module.__dict__)
    clones: dict[str, torch.Tensor] = {}
    for table in ("_parameters", "_buffers"):
        fresh: dict[str, torch.Tensor | None] = {}
        for k, t in getattr(module, table).items():
            if t is None:
                fresh[k] = t
                continue
            c = t.detach().clone()
            if isinstance(t, torch.nn.Parameter):
                c = torch.nn.Parameter(c, requires_grad=False)
            c.__class__ = t.__class__
            c.__dict__ = dict(t.__dict__)
            fresh[k] = clones[k] = c
        shadow.__dict__[table] = fresh
    before = {k: (c, c.data_ptr(), c.detach().clone()) for k, c in clones.items()}
    try:
        with torch.no_grad():
            process_live(shadow)
    except Exception as e:  # the lifecycle runs it as vLLM does
        log.debug("%s: processing a copy failed (%s); it goes through the lifecycle", type(module).__name__, e)
        return False
    now = _tensors(shadow)
    for k, (c, ptr, values) in before.items():
        t = now.get(k)
        if t is not c or t.data_ptr() != ptr or t.dtype != values.dtype or not torch.equal(t, values):
            return False
    return set(now) == set(before)
