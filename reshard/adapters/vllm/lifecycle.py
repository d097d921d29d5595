"""vLLM's layerwise reload lifecycle, as a refit needs it: the corrections
reshard applies so that a refit lands what a fresh engine would hold.

Each function exists because vLLM 0.32's own reload leaves something
stale or fails on CPU (the same code is in 0.33); each has a test:

- :func:`adopt_released_kernels`: a layer whose live tensor another layer
  released after loading (on CPUs with AMX, MLA attention packs its own
  copies of ``kv_b_proj.weight`` and replaces that weight with an empty
  tensor) cannot take the reloaded values by an in-place copy; vLLM's reload
  fails there ("the size of tensor a (0) must match ..."). The reloaded
  tensor becomes the kernel tensor's data instead, so the attention layer
  packs the new values when it is processed, as after a fresh load.
- :func:`restore_unprocessed`: leave the lifecycle after a dry run that
  wrote nothing, without processing any layer again (processing MLA
  attention then would read the released ``kv_b_proj``).
- :func:`repack_cpu_experts`: CPU MoE experts are prepacked only on the
  first load.
- :func:`followers`, :func:`reprocess`: a tied ``lm_head`` is never
  processed again by the reload, so its CPU-packed copy goes stale.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from reshard.errors import ReshardError

if TYPE_CHECKING:
    import torch

__all__ = [
    "adopt_released_kernels",
    "followers",
    "has_cpu_experts",
    "keep_live",
    "materialize_into",
    "release_held",
    "released_kernels_adopted",
    "repack_cpu_experts",
    "reprocess",
    "restore_unprocessed",
]

log = logging.getLogger(__name__)


def adopt_released_kernels(layer: torch.nn.Module, info: Any) -> list[str]:
    """Once ``layer`` is processed, before its values are copied into its
    live (kernel) tensors: every kernel tensor whose shape differs from the
    processed one (something released or replaced it after the last load)
    takes the processed tensor as its data, instead of an in-place copy that
    cannot fit. Returns the names adopted."""
    kernels = getattr(info, "kernel_tensors", None)
    if kernels is None:
        return []
    adopted = []
    for table in kernels:
        for name, kernel in table.items():
            fresh = getattr(layer, name, None)
            if fresh is None or fresh is kernel or fresh.is_meta or kernel.shape == fresh.shape:
                continue
            if kernel.is_cuda and kernel.numel():
                # A CUDA graph captured the kernel tensor's address: new data
                # under the same Python object would never reach it.
                raise ReshardError(
                    f"{type(layer).__name__}.{name}: its live tensor is {list(kernel.shape)}, the reloaded one "
                    f"{list(fresh.shape)}; on a GPU reshard copies into live tensors in place (CUDA graphs hold "
                    "their addresses) and cannot adopt a tensor of another shape"
                )
            kernel.data = fresh.data
            adopted.append(name)
    if adopted:
        log.debug("%s: released kernel tensors %s take the reloaded values", type(layer).__name__, adopted)
    return adopted


@contextlib.contextmanager
def released_kernels_adopted(seconds: dict[str, float] | None = None) -> Iterator[None]:
    """vLLM's own layerwise processing, with :func:`adopt_released_kernels`
    applied to every layer it processes, for the length of the block (a
    reload through vLLM's own ``reload_weights``; reshard's receiver calls
    the function itself). ``seconds["copy_back"]`` accumulates the time
    spent copying processed values into the live tensors."""
    from vllm.model_executor.model_loader.reload import layerwise

    original = layerwise._copy_and_restore_kernel_tensors

    def copy_and_restore(layer, info):
        t0 = time.perf_counter()
        adopt_released_kernels(layer, info)
        try:
            return original(layer, info)
        finally:
            if seconds is not None:
                seconds["copy_back"] = seconds.get("copy_back", 0.0) + time.perf_counter() - t0

    layerwise._copy_and_restore_kernel_tensors = copy_and_restore
    try:
        yield
    finally:
        layerwise._copy_and_restore_kernel_tensors = original


def restore_unprocessed(model: torch.nn.Module) -> None:
    """Leave the layerwise reload lifecycle after a dry run that wrote
    nothing: every layer gets its live tensors back and no layer is
    processed again."""
    from vllm.model_executor.model_loader.reload import layerwise

    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    for layer in model.modules():
        keep_live(layer)
    layerwise.LOADING_LAYERS.clear()


def keep_live(layer: torch.nn.Module) -> None:
    """Take ``layer`` out of a layerwise reload just begun: its live tensors
    back in place, its loaders unwrapped, nothing left for vLLM to process
    or restore at the end (a dry run, or a layer a refit writes in place)."""
    from vllm.model_executor.model_loader.reload import layerwise

    info = layerwise.LAYERWISE_INFO.get(layer)
    if info is None or not info.can_load():
        return
    if info.kernel_tensors is not None:
        layerwise._place_kernel_tensors(layer, info)
    for t in list(layer._parameters.values()) + list(layer._buffers.values()):
        if t is not None and hasattr(t, "weight_loader"):
            t.weight_loader = layerwise._get_original_loader(t)
    info.reset()


def followers(modules: dict[str, Any], updated: set[str]) -> list[str]:
    """Modules that share a live tensor with a module we update but load
    nothing themselves (a tied ``lm_head``). vLLM's reload never processes
    them again, so whatever they derived from the shared weight (the CPU
    ``lm_head`` packs its own copy for its matmul) goes stale."""
    owners: dict[int, set[str]] = {}
    for name, mod in modules.items():
        for t in list(mod._parameters.values()) + list(mod._buffers.values()):
            if t is not None and t.numel() and not t.is_meta:
                owners.setdefault(t.untyped_storage().data_ptr(), set()).add(name)
    out = set()
    for names in owners.values():
        if names & updated:
            out |= {n for n in names - updated if getattr(modules[n], "quant_method", None) is not None}
    return sorted(out)


def reprocess(module) -> None:
    qm = getattr(module, "quant_method", None)
    if qm is not None and hasattr(qm, "process_weights_after_loading"):
        qm.process_weights_after_loading(module)


def repack_cpu_experts(module) -> None:
    """vLLM 0.32 on CPU prepacks MoE expert weights into its grouped-GEMM
    layout only on the first load; on a weight update it copies the
    checkpoint-layout weights over the packed ones, and its own reload then
    serves garbage. Pack again, as the first load does."""
    experts = _cpu_experts(module)
    if experts is not None:
        experts.process_weights_after_loading(module)


def has_cpu_experts(module) -> bool:
    """Whether :func:`repack_cpu_experts` packs ``module``'s experts again."""
    return _cpu_experts(module) is not None


def _cpu_experts(module):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is not None and type(experts).__module__.endswith("cpu_moe"):
        return experts
    return None


def materialize_into(layer: torch.nn.Module, info: Any, prefix: str, pool: dict[str, torch.Tensor]) -> None:
    """vLLM's ``materialize_layer``, with each meta tensor of ``layer`` made a
    view of ``pool[<prefix>.<name>]`` where that buffer has its shape, strides
    and dtype (otherwise a fresh tensor, as vLLM makes). The pool's memory
    is kept from one refit to the next, so a receive writes into pages that
    are already mapped."""
    import torch
    from vllm.model_executor.model_loader.reload import meta

    if layer.__class__.__name__ in meta.SKIP_MODULES:
        return
    with info.restore_device:
        for name, tensor in list(layer._parameters.items()) + list(layer._buffers.items()):
            if tensor is None or name in meta.SKIP_TENSORS or not tensor.is_meta:
                continue
            buf = pool.get(f"{prefix}.{name}" if prefix else name)
            if (
                buf is None
                or buf.shape != tensor.shape
                or buf.stride() != tensor.stride()
                or buf.dtype != tensor.dtype
                or buf.device != torch.get_default_device()
            ):
                setattr(layer, name, meta.materialize_meta_tensor(tensor))
                continue
            out = buf.detach().view(buf.shape)
            out.__class__ = tensor.__class__
            out.__dict__ = tensor.__dict__.copy()
            setattr(layer, name, out)


def release_held(pool: dict[str, torch.Tensor], names: list[str]) -> int:
    """After a layer materialized from ``pool`` was processed: a buffer the
    engine still holds (its processing kept the tensor it was given instead
    of copying it) now belongs to the engine; the pool gets a fresh one, so
    the next refit does not write into what the engine serves."""
    import torch

    released = 0
    for name in names:
        buf = pool.get(name)
        # Two references are ours: the pool's tensor and the storage object read here.
        if buf is not None and torch._C._storage_Use_Count(buf.untyped_storage()._cdata) > 2:
            log.debug("%s: the engine kept the buffer it was loaded from; the pool takes a fresh one", name)
            pool[name] = torch.zeros_like(buf)
            released += 1
    return released
