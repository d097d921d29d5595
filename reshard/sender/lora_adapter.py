"""Adapter-only refits: ``Sender(LoraAdapter(peft_model))`` publishes a PEFT
LoRA adapter's factors, not the model.

Each trainer rank publishes the boxes of every ``A`` and ``B`` it holds
(whole under DDP, shards under FSDP2, FSDP1 or ZeRO-3: read by the same
trainer readers as any parameter), under the names PEFT saves an adapter
with (``base_model.model.<module>.lora_A.weight``), so an engine serving the
base model with LoRA enabled pulls into its LoRA slots exactly the slices
each of its workers keeps (:mod:`reshard.adapters.vllm.lora`). Nothing is
gathered and no file is written. :meth:`LoraAdapter.spec` says what an
engine needs to know beside the factors: the adapter's config (ranks,
alphas, rank-stabilized or not) and the modules it adapts.

Refused, naming the adapter and module: what :mod:`reshard.sender.peft`
refuses, and ``modules_to_save`` (a whole trained module is no adapter
slot; refit such a policy merged).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from reshard.sender.peft import find_peft, lora_layers
from reshard.sender.readers import Description, ReadContext, TrainerReader

__all__ = ["READER", "AdapterSpec", "LoraAdapter"]


class AdapterSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine needs beside an adapter's factors (wire type, JSON)."""

    config: str
    """The adapter's PEFT config as JSON (what ``adapter_config.json`` holds)."""
    modules: tuple[str, ...]
    """The modules the adapter adapts, as PEFT names them in a saved adapter
    (``model.layers.0.self_attn.q_proj``)."""
    version: int = 1

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def parse(cls, value: str | bytes | dict[str, Any] | AdapterSpec) -> AdapterSpec:
        if isinstance(value, AdapterSpec):
            return value
        if isinstance(value, str | bytes):
            return msgspec.json.decode(value, type=cls)
        return msgspec.convert(value, cls)

    def config_dict(self) -> dict[str, Any]:
        return dict(json.loads(self.config))


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A PEFT model's adapter ``adapter``, as ``Sender`` publishes it for
    adapter-only refits: ``Sender(LoraAdapter(model), config=...)``. ``model``:
    the model as the trainer wrapped it."""

    model: Any
    adapter: str = "default"

    def spec(self) -> AdapterSpec:
        """The adapter's config and modules (see :class:`AdapterSpec`)."""
        # Inside any trainer's wrappers: they are modules, which find_peft searches.
        peft = find_peft(self.model)
        if peft is None:
            raise TypeError(f"{type(self.model).__name__} is no PEFT model")
        cfg = peft.peft_config[self.adapter]
        data = cfg.to_dict()
        for k, v in list(data.items()):
            if isinstance(v, set):
                data[k] = sorted(v)
        modules = tuple(
            sorted(
                path.removeprefix("base_model.model.")
                for path, spec in lora_layers(peft, 0)[0].items()
                if self.adapter in {a for a, _ in spec["adapters"]}
            )
        )
        return AdapterSpec(config=json.dumps(data, default=str, sort_keys=True), modules=modules)


def _describe(source: Any, ctx: ReadContext) -> Description | None:
    if not isinstance(source, LoraAdapter):
        return None
    from reshard.sender.pieces import default_rename

    peft = find_peft(ctx.unwrap(source.model)[0])
    if peft is None:
        raise TypeError(
            f"rank {ctx.rank}: {type(source.model).__name__} is no PEFT model: nothing to send as an adapter"
        )
    _, saved = lora_layers(peft, ctx.rank)
    if saved:
        raise TypeError(
            f"rank {ctx.rank}: the policy trains {sorted(saved)[:3]} whole (modules_to_save), which no LoRA slot "
            "holds; refit it merged (Sender(model)) instead of adapter-only"
        )
    marker = f".{source.adapter}."

    def rename(name: str) -> str | None:
        name = default_rename(name) or ""
        for kind in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
            tag = f".{kind}{marker}"
            if tag in name:
                if name.endswith(".bias"):
                    raise TypeError(
                        f"rank {ctx.rank}: {name!r} is a LoRA bias (lora_bias), which vLLM's LoRA slots do not hold"
                    )
                return name.replace(tag, f".{kind}.")
            if name.endswith(f".{kind}.{source.adapter}"):  # embeddings' factors are parameters, not modules
                return name.removesuffix(f".{source.adapter}")
        return None

    described = ctx.inner(source.model, rename)
    if not described.pieces and not described.grids:
        raise TypeError(f"rank {ctx.rank}: the policy has no LoRA factors of adapter {source.adapter!r}")
    return described


READER = TrainerReader(name="PEFT LoRA adapter (adapter-only)", describe=_describe)
"""A PEFT adapter's factors, for engines that hold adapters in LoRA slots."""
