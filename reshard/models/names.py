"""Checkpoint names for transformers modules.

Canonical names are checkpoint (safetensors) names: what engines'
``load_weights`` consume. transformers 5 fuses some tensors in its modeling
code (MoE experts become one ``mlp.experts.gate_up_proj`` of shape
``[E, 2I, H]``) and undoes that when it loads a checkpoint, following its
per-architecture conversion mapping. We read that same mapping backwards:
each fused model parameter splits into the checkpoint tensors it was built
from, each at an offset inside the parameter. No per-model tables here.

Supported conversions (everything the mapping uses for MoE experts today):
``MergeModulelist(dim=0)`` over ``*``-indexed sources, optionally followed
by ``Concatenate(dim=d)`` of several sources; renamings whose patterns are
plain dotted strings. A parameter that matches anything else raises.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CheckpointNames", "CheckpointPiece"]


@dataclass(frozen=True, slots=True)
class CheckpointPiece:
    """Checkpoint tensor ``name`` (shape ``shape``) sits inside a model
    parameter at ``offset``; checkpoint dim ``i`` runs along parameter dim
    ``dims[i]`` (``()``: the same dims, no offset)."""

    name: str
    shape: tuple[int, ...]
    offset: tuple[int, ...] = ()
    dims: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class _Rule:
    target: str
    sources: tuple[str, ...]
    concat_dim: int | None


_PLAIN = re.compile(r"^[\w.*]+$")


class CheckpointNames:
    """Maps transformers parameter names to checkpoint pieces for one architecture."""

    def __init__(self, model_type: str | None) -> None:
        self.model_type = model_type
        self._rules: list[_Rule] = []
        self._renames: list[tuple[str, str]] = []
        self._opaque: list[str] = []
        if model_type:
            self._load(model_type)

    def _load(self, model_type: str) -> None:
        try:
            from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        except ImportError:  # older transformers: no fused modeling names
            return
        for t in get_checkpoint_conversion_mapping(model_type) or ():
            ops = list(getattr(t, "operations", []) or [])
            sources = list(t.source_patterns)
            targets = list(t.target_patterns)
            op_names = [type(o).__name__ for o in ops]
            if not ops:
                for s, g in zip(sources, targets, strict=False):
                    if _PLAIN.match(s) and _PLAIN.match(g):
                        self._renames.append((s, g))
                    else:
                        self._opaque.append(g)
                continue
            if len(targets) != 1:
                raise ValueError(f"{model_type}: conversion to {targets} has several targets")
            if op_names == ["MergeModulelist"] and len(sources) == 1 and ops[0].dim == 0:
                self._rules.append(_Rule(targets[0], tuple(sources), None))
            elif op_names == ["MergeModulelist", "Concatenate"] and ops[0].dim == 0:
                self._rules.append(_Rule(targets[0], tuple(sources), ops[1].dim))
            else:
                # Recorded, and raised only if a parameter actually uses it.
                self._rules.append(_Rule(targets[0], (), -1))

    def split(self, name: str, shape: Sequence[int]) -> list[CheckpointPiece]:
        """The checkpoint tensors that model parameter ``name`` is made of."""
        shape = tuple(shape)
        for pattern in self._opaque:
            if re.search(pattern, name):
                raise ValueError(
                    f"{self.model_type}: parameter {name!r} was renamed from the checkpoint by the pattern "
                    f"{pattern!r}, which reshard cannot reverse; pass a rename function"
                )
        for rule in self._rules:
            tgt = rule.target
            if not name.endswith(tgt):
                continue
            prefix = name[: len(name) - len(tgt)]
            if prefix and not (prefix.endswith(".") or tgt.startswith(".")):
                continue
            if rule.concat_dim == -1:
                raise ValueError(
                    f"{self.model_type}: parameter {name!r} comes from a checkpoint conversion reshard "
                    "cannot reverse; publish its pieces explicitly"
                )
            n_exp = shape[0]
            inner = shape[1:]
            k = len(rule.sources)
            cd = rule.concat_dim
            if cd is not None:
                ci = cd - 1  # concat dim in the per-expert tensor
                if inner[ci] % k:
                    raise ValueError(f"{name!r}: dim {cd} of shape {list(shape)} does not split into {k} sources")
                part = inner[ci] // k
            out = []
            for e in range(n_exp):
                for j, src in enumerate(rule.sources):
                    ck_shape = list(inner)
                    offset = [e] + [0] * len(inner)
                    if cd is not None:
                        ck_shape[ci] = part
                        offset[cd] = j * part
                    out.append(
                        CheckpointPiece(
                            name=self._unrename(prefix + src.replace("*", str(e))),
                            shape=tuple(ck_shape),
                            offset=tuple(offset),
                            dims=tuple(range(1, len(shape))),
                        )
                    )
            return out
        return [CheckpointPiece(self._unrename(name), shape)]

    def _unrename(self, name: str) -> str:
        for src, tgt in self._renames:
            name = name.replace(tgt, src)
        return name
