"""The state an engine derived from its weights, as digests to compare.

After a refit, an engine must be indistinguishable from a fresh one loaded
from the same weights, in everything its forward pass reads, not only in
its parameters: engines derive state at load time (repacked kernel weights,
absorbed MLA matrices, a router's copy of a bias, a tied head's packed copy)
and a refit that updates a parameter but not what was derived from it
serves a mix. :func:`model_state` walks a model and digests:

- every parameter and buffer of every module;
- every tensor held in plain attributes of a module, and inside the helper
  objects it keeps (a ``quant_method``, an attention ``impl``, an MoE
  kernel), in lists, tuples, dicts and the closures of functions it keeps
  (a CPU linear layer's ``cpu_linear`` closes over its packed weight);
- for every layer with a linear ``quant_method``, the output of
  ``quant_method.apply`` on a fixed input: packed kernel handles that are no
  tensor at all (oneDNN) are compared by what they compute.

Paths are module paths (``model.layers.1.mlp.experts.w13_weight``,
``model.layers.0.self_attn.attn.impl._w_uk_packed``,
``lm_head.<apply>``). :func:`compare_states` names the tensors that differ
in the order the model holds them, so the first one is where to look.

What is left out, because it differs between two engines serving the same
weights: KV caches (``kv_cache``), scratch buffers whose content is whatever
the last forward pass left, and tensors that hold a native handle's address
(oneDNN's ``handler_tensor``; what the handle computes is compared by the
probe) (``SCRATCH``).
"""

from __future__ import annotations

import hashlib
import types
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["DRAFTER", "SCRATCH", "compare_states", "engine_model_state", "model_state"]

SCRATCH = frozenset({"kv_cache", "kv_caches", "workspace", "workspace13", "workspace2", "_workspace", "handler_tensor"})
"""Attribute names never compared: per-request state, scratch buffers, native handles."""

_MAX_DEPTH = 4
_MODULE_INTERNALS = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    }
)


def digest(t: torch.Tensor) -> str:
    """``dtype[shape]:hash`` of a tensor's values (empty and meta tensors by shape)."""
    import torch

    if t.numel() == 0:
        # Holds nothing a forward pass could read (a weight released after
        # packing), whatever its dtype.
        return f"empty{list(t.shape)}"
    head = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
    if t.is_meta:
        return head
    data = t.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    raw = data.contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{head}:{hashlib.blake2b(raw.tobytes(), digest_size=12).hexdigest()}"


def model_state(model: torch.nn.Module, *, probe: bool = True) -> dict[str, str]:
    """Digest of every tensor ``model``'s forward pass may read, by path
    (see the module docstring). ``probe``: also digest each linear layer's
    output on a fixed input."""
    import torch

    out: dict[str, str] = {}
    seen: set[int] = set()
    walked: set[int] = set()
    with torch.no_grad():
        for name, mod in model.named_modules():
            prefix = f"{name}." if name else ""
            for kind in ("_parameters", "_buffers"):
                for pname, t in getattr(mod, kind).items():
                    if t is not None and pname not in SCRATCH:
                        _record(out, seen, prefix + pname, t)
            for attr, value in vars(mod).items():
                if attr in _MODULE_INTERNALS or attr in SCRATCH:
                    continue
                for path, t in _tensors(value, prefix + attr, 0, walked):
                    _record(out, seen, path, t)
            if probe:
                y = _probe(mod)
                if y is not None:
                    out[prefix + "<apply>"] = digest(y)
    return out


DRAFTER = "drafter:"
"""The prefix of a drafter's paths in :func:`engine_model_state`."""


def engine_model_state(
    model: torch.nn.Module, drafter: torch.nn.Module | None = None, *, probe: bool = True
) -> dict[str, str]:
    """:func:`model_state` of an engine's target ``model`` and of its
    speculative ``drafter`` (paths under :data:`DRAFTER`; its modules shared
    with the target by reference are digested under both), so equal to a
    fresh engine's means both are."""
    out = model_state(model, probe=probe)
    if drafter is not None:
        out.update({DRAFTER + k: v for k, v in model_state(drafter, probe=probe).items()})
    return out


def _record(out: dict[str, str], seen: set[int], path: str, t: torch.Tensor) -> None:
    # A tensor held in several places (a tied weight, a router's reference to
    # its gate's bias) is one tensor: digested once, under its first path.
    if id(t) in seen:
        return
    seen.add(id(t))
    out[path] = digest(t)


def _tensors(value: Any, path: str, depth: int, walked: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors reachable from ``value`` (not through modules, which are
    walked on their own); each object is walked once per model."""
    import torch

    if isinstance(value, torch.Tensor):
        yield path, value
        return
    if depth >= _MAX_DEPTH or id(value) in walked:
        return
    if isinstance(value, list | tuple):
        walked.add(id(value))
        for i, v in enumerate(value):
            yield from _tensors(v, f"{path}.{i}", depth + 1, walked)
    elif isinstance(value, Mapping):
        walked.add(id(value))
        for k, v in value.items():
            if isinstance(k, str | int) and k not in SCRATCH:
                yield from _tensors(v, f"{path}.{k}", depth + 1, walked)
    elif isinstance(value, types.FunctionType):
        walked.add(id(value))
        for var, cell in zip(value.__code__.co_freevars, value.__closure__ or (), strict=False):
            try:
                inner = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            yield from _tensors(inner, f"{path}.<{var}>", depth + 1, walked)
    elif _is_helper(value):
        walked.add(id(value))
        for attr, v in vars(value).items():
            if attr not in SCRATCH:
                yield from _tensors(v, f"{path}.{attr}", depth + 1, walked)


def _is_helper(value: Any) -> bool:
    """An object whose attributes may hold derived tensors (a quant method,
    an attention impl, an MoE kernel, a router): anything with a
    ``__dict__`` that is not a module, a class, a bound method or one of
    torch's or the standard library's own objects."""
    import torch

    if isinstance(value, torch.nn.Module | type | types.ModuleType | types.MethodType) or not hasattr(
        value, "__dict__"
    ):
        return False
    mod = type(value).__module__ or ""
    return not mod.startswith(("builtins", "functools", "torch", "enum", "logging", "threading"))


def _probe(mod: torch.nn.Module) -> torch.Tensor | None:
    """``quant_method.apply(mod, x)`` on a fixed input, for linear layers and
    language-model heads (their packed weights may be no tensor at all)."""
    import torch

    qm = getattr(mod, "quant_method", None)
    apply = getattr(qm, "apply", None)
    if apply is None:
        return None
    n_in = getattr(mod, "input_size_per_partition", None)
    if n_in is None and type(mod).__name__ == "ParallelLMHead":
        n_in = getattr(mod, "embedding_dim", None)
    weight = getattr(mod, "weight", None)
    if not isinstance(n_in, int) or n_in <= 0 or not isinstance(weight, torch.Tensor):
        return None
    dtype = weight.dtype if weight.is_floating_point() else torch.get_default_dtype()
    g = torch.Generator().manual_seed(n_in)
    x = torch.randn(3, n_in, generator=g).to(dtype=dtype, device=weight.device)  # host: moved
    try:
        return apply(mod, x)
    except Exception:  # a layer that cannot run alone (a collective, a fused input)
        return None


def compare_states(ours: Mapping[str, str], reference: Mapping[str, str]) -> list[str]:
    """Paths whose digest differs, or that one side lacks, in ``reference``'s
    order (then those only ``ours`` has); empty when the states are equal."""
    out = [p for p, d in reference.items() if ours.get(p) != d]
    out += [p for p in ours if p not in reference]
    return out
