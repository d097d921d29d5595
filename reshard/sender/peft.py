"""PEFT policies: ``Sender(peft_model)`` publishes the merged weights.

A LoRA-trained policy is a frozen base plus small factors: for every target
layer, ``W' = W + s * B @ A`` (PEFT's ``merge_and_unload``). The reader
publishes ``W'`` under the base model's checkpoint names, read where the
trainer keeps ``W`` (FSDP2, FSDP1, DeepSpeed ZeRO-1/2/3, DDP, plain): for
every box of ``W`` this rank holds, the box of ``W'`` is computed when a
refit first reads it, ``W_box + s * (B[rows] @ A)[:, cols]``, into a copy
of the box (the trainer's weights are never written), so extra memory is the
boxes in flight. The factors are small: where a rank does not hold them
whole, every trainer rank gathers them (one ``all_gather`` over the
trainer's default group per read, :mod:`reshard.sender.gather`, counted in
:attr:`PeftPolicy.gathered_bytes`);
the base is never gathered. LoRA factors are not published; a module PEFT
trains whole (``modules_to_save``) is published from its trained copy.

Numerics: the delta is computed as PEFT computes it (``B @ A``, transposed
for ``fan_in_fan_out`` layers and embeddings, times the layer's scaling;
on CPU in float32 for half-precision factors, then cast back) and added in
place to the box in the base weight's dtype, as PEFT's merge adds it. Only
the rows of ``B @ A`` a box needs are computed: the dot products are those
of PEFT's whole-tensor merge, summed by the same BLAS, so the merged boxes
equal ``merge_and_unload``'s tensors bit for bit where the BLAS sums an
``r``-long dot product in the same order for every row count (tested on
this CPU for every trainer), and otherwise within ``r`` float32 roundings
of ``|B| |A|`` before the cast to the weights' dtype.

Refused at construction, naming the adapter type and module: PEFT methods
other than LoRA, DoRA and other LoRA variants, LoRA on parameters
(``target_parameters``), on convolutions, and trainable tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reshard.plan.box import Box
from reshard.plan.layout import Grid, Slot, grid_box
from reshard.plan.specs import GridSpec, PieceSpec
from reshard.sender.gather import gather_whole
from reshard.sender.readers import Description, ReadContext, TrainerReader
from reshard.transport.locals import LocalTensors
from reshard.transport.messages import local_view

if TYPE_CHECKING:
    import torch

__all__ = ["READER", "LoraLayerInfo", "PeftPolicy", "find_peft", "lora_layers", "merged_box"]

_FACTOR = "\x00lora\x00"
"""Marks a LoRA factor's name in the inner description (never published)."""


@dataclass(slots=True)
class LoraLayerInfo:
    """One LoRA layer of the policy, under its checkpoint name."""

    name: str
    """The base weight's checkpoint name (``model.layers.0.self_attn.q_proj.weight``)."""
    kind: str
    """``linear`` or ``embedding``."""
    fan_in_fan_out: bool
    adapters: list[tuple[str, float]]
    """``(adapter, scaling)`` to merge, in PEFT's order (already merged ones left out)."""
    bias: str | None = None
    """The base bias's checkpoint name when an adapter has a LoRA bias (``lora_bias``)."""
    factors: dict[str, Any] = field(default_factory=dict)
    """``A:<adapter>``, ``B:<adapter>``, ``b:<adapter>`` (B's bias): the whole factors."""


def merged_box(info: LoraLayerInfo, box: Box, base: torch.Tensor, *, bias: bool = False) -> None:
    """Add every adapter's delta to ``base``, the values of ``box`` of the
    base weight (or of its bias, ``bias=True``), in place, as PEFT's merge does."""
    import torch

    for adapter, scaling in info.adapters:
        if bias:
            b = info.factors.get(f"b:{adapter}")
            if b is not None:
                lo = box.offsets[0]
                base += b[lo : lo + box.sizes[0]].to(base.device) * scaling
            continue
        a, b = info.factors[f"A:{adapter}"], info.factors[f"B:{adapter}"]
        if b.device != base.device:  # (a policy whose locals live on several devices)
            a, b = a.to(base.device), b.to(base.device)
        dtype = b.dtype
        cast = b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
        if cast:
            a, b = a.float(), b.float()
        if base.dim() == 1:  # a 1-dim weight cannot carry LoRA; guarded at read time
            raise ValueError(f"{info.name!r}: a LoRA layer with a 1-dim weight")
        (r0, c0), (nr, nc) = box.offsets, box.sizes
        if info.kind == "embedding" or info.fan_in_fan_out:
            # delta = (B @ A).T: the rows of B @ A are the box's columns.
            delta = _rows(b, a, c0, nc)[:, r0 : r0 + nr].T
        else:
            delta = _rows(b, a, r0, nr)[:, c0 : c0 + nc]
        delta = delta * scaling
        if cast:
            delta = delta.to(dtype)
        base += delta


_ROW_BLOCK = 16
"""Rows of ``B @ A`` are computed in aligned blocks of this many: a product
of one row takes the BLAS's matrix-vector path, which sums a dot product in
another order than the whole-tensor product PEFT merges with."""


def _rows(b: torch.Tensor, a: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Rows ``start .. start + count`` of ``b @ a``, from aligned blocks of rows."""
    lo = start // _ROW_BLOCK * _ROW_BLOCK
    hi = min(b.shape[0], -(-(start + count) // _ROW_BLOCK) * _ROW_BLOCK)
    return (b[lo:hi] @ a)[start - lo : start - lo + count]


@dataclass(slots=True)
class _Merge:
    """A local tensor's boxes that take a delta."""

    info: LoraLayerInfo
    slot: Slot
    box: Box
    bias: bool


class PeftPolicy(LocalTensors):
    """The local tensors of a PEFT policy's rank: the trainer's own, and, for
    local tensors holding LoRA-targeted weights, merged copies computed on
    first read and kept while a small budget lasts (see the module docstring)."""

    lazy = True
    """Checked tensor by tensor as a refit reads them (merging them all up
    front would hold a merged copy of every targeted weight at once)."""

    def __init__(
        self,
        plain: Mapping[str, torch.Tensor],
        merges: Mapping[str, list[_Merge]],
        *,
        gathered_bytes: int,
        keep_bytes: int = 256 << 20,
    ) -> None:
        self.plain = dict(plain)
        self.merges = dict(merges)
        self.gathered_bytes = gathered_bytes
        """Bytes of LoRA factors this rank received gathering them, at the last read."""
        self.keep_bytes = keep_bytes
        self._kept: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.merged = 0
        """Local tensors merged so far (a refit reads each once per round it is in)."""

    def resolve(self, key: str) -> torch.Tensor:
        merges = self.merges.get(key)
        if merges is None:
            return self.plain[key]
        got = self._kept.get(key)
        if got is not None:
            self._kept.move_to_end(key)
            return got
        import torch

        out = self.plain[key].detach().clone()
        with torch.no_grad():
            for m in merges:
                merged_box(m.info, m.box, local_view(out, m.slot, m.box), bias=m.bias)
        self.merged += 1
        self._kept[key] = out
        held = sum(t.nbytes for t in self._kept.values())
        while len(self._kept) > 1 and held > self.keep_bytes:
            _, old = self._kept.popitem(last=False)
            held -= old.nbytes
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.plain)

    def __len__(self) -> int:
        return len(self.plain)

    @property
    def device(self) -> torch.device | None:
        return next(iter(self.plain.values())).device if self.plain else None


# -- reading a PEFT model ----------------------------------------------------------------


def _is_peft(model: Any) -> bool:
    """A PEFT ``PeftModel`` (FSDP2 makes a subclass of its class; its ``base_model``, a tuner, is not one)."""
    return any(c.__name__ == "PeftModel" and c.__module__.startswith("peft.") for c in type(model).__mro__)


def find_peft(model: Any) -> Any | None:
    """The PEFT model a trainer's model is or wraps (FSDP1 keeps it inside its root unit)."""
    if _is_peft(model):
        return model
    import torch

    if isinstance(model, torch.nn.Module):
        return next((m for m in model.modules() if _is_peft(m)), None)
    return None


def _clean(path: str) -> str:
    """A module path without trainer wrappers' segments (FSDP1 units)."""
    from reshard.sender.pieces import default_rename

    return (default_rename(path + ".x") or path + ".x")[:-2]


def lora_layers(model: Any, rank: int) -> tuple[dict[str, dict], dict[str, str]]:
    """Per LoRA module path (as ``named_modules`` names it), what to merge, and
    per ``modules_to_save`` wrapper path, its active adapter. Refuses what
    cannot be merged exactly."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora import layer as lora_layer

    for adapter, cfg in model.peft_config.items():
        kind = str(getattr(cfg, "peft_type", ""))
        if not kind.endswith("LORA") or kind.endswith(("ADALORA", "XLORA")):
            raise TypeError(
                f"rank {rank}: adapter {adapter!r} is a PEFT {kind.rsplit('.', 1)[-1]} adapter; reshard merges "
                "LoRA adapters only (merge it with merge_and_unload, or refit the base model)"
            )
        if getattr(cfg, "target_parameters", None):
            raise TypeError(
                f"rank {rank}: adapter {adapter!r} puts LoRA on parameters ({list(cfg.target_parameters)[:3]}), "
                "which reshard does not merge yet"
            )
        if getattr(cfg, "trainable_token_indices", None):
            raise TypeError(f"rank {rank}: adapter {adapter!r} trains token embeddings, which reshard does not merge")
    layers: dict[str, dict] = {}
    saved: dict[str, str] = {}
    for raw, mod in model.named_modules():
        path = _clean(raw)
        cls = type(mod).__name__
        if cls == "ModulesToSaveWrapper":
            saved[path] = mod.active_adapter if isinstance(mod.active_adapter, str) else mod.active_adapter[0]
            continue
        if cls == "TrainableTokensWrapper":
            raise TypeError(f"rank {rank}: module {path!r} trains token embeddings, which reshard does not merge")
        if not isinstance(mod, LoraLayer):
            continue
        active = [a for a in mod.active_adapters if a in mod.scaling]
        if type(mod) not in (lora_layer.Linear, lora_layer.Embedding):
            raise TypeError(
                f"rank {rank}: module {path!r} is a PEFT {cls} LoRA layer; reshard merges LoRA on linear layers "
                "and embeddings only"
            )
        for a in active:
            if a in mod.lora_variant:
                variant = type(mod.lora_variant[a]).__name__.removesuffix("Variant")
                raise TypeError(
                    f"rank {rank}: module {path!r} runs adapter {a!r} as {variant} (a LoRA variant such as DoRA), "
                    "which reshard cannot merge exactly; train plain LoRA or merge with merge_and_unload"
                )
        done = set(getattr(mod, "merged_adapters", ()))
        todo = [(a, float(mod.scaling[a])) for a in active if a not in done]
        if todo:
            layers[path] = {
                "kind": "embedding" if isinstance(mod, lora_layer.Embedding) else "linear",
                "fan_in_fan_out": bool(getattr(mod, "fan_in_fan_out", False)),
                "adapters": todo,
                "bias": any(getattr(mod, "lora_bias", {}).get(a, False) for a, _ in todo),
            }
    return layers, saved


def _renamer(
    layers: Mapping[str, dict], saved: Mapping[str, str], outer: Callable[[str], str | None] | None
) -> Callable[[str], str | None]:
    """Parameter names of the PEFT model -> checkpoint names (LoRA factors
    marked, not published; frozen originals of ``modules_to_save`` dropped)."""
    from reshard.sender.pieces import default_rename

    def rename(name: str) -> str | None:
        name = default_rename(name) or ""
        name = name.removeprefix("base_model.model.")
        for marker in (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B."):
            if marker in name:
                return _FACTOR + name
        if ".lora_" in name:
            return None  # magnitude vectors and the like: refused above, never published
        if ".original_module." in name:
            return None
        if ".modules_to_save." in name:
            path, _, rest = name.partition(".modules_to_save.")
            adapter, _, leaf = rest.partition(".")
            if saved.get("base_model.model." + path, adapter) != adapter:
                return None
            name = f"{path}.{leaf}"
        name = name.replace(".base_layer.", ".")
        return outer(name) if outer is not None else name

    return rename


def _my_box(g: GridSpec, rank: int) -> Box:
    mesh = g.mesh
    ranks = mesh.all_ranks()
    idx = ranks.index(rank)
    coord = []
    for n in reversed(mesh.shape):
        coord.append(idx % n)
        idx //= n
    grid = Grid(tensors=(0, 1, 1), mesh=mesh, shard=g.shard, block=g.block)
    return grid_box(grid, g.tensor.shape, tuple(reversed(coord)))


def _describe(source: Any, ctx: ReadContext) -> Description | None:
    from reshard.sender.pieces import default_rename

    model = find_peft(ctx.unwrap(source)[0])
    if model is None:
        return None
    layers, saved = lora_layers(model, ctx.rank)
    user = None if ctx.rename is None or ctx.rename is default_rename else ctx.rename
    pieces, grids, local = ctx.inner(source, _renamer(layers, saved, user))
    by_weight = _layer_infos(layers)
    parts, shapes, pieces, grids = _split_factors(pieces, grids, local, ctx.rank)
    # Merged into clones of the local tensors: on their device.
    device = next(iter(local.values())).device if local else "cpu"
    factors, gathered = gather_whole(parts, shapes, device=device)
    _attach(factors, by_weight, ctx.rank)
    merges = _merges(pieces, grids, local, by_weight, ctx.rank)
    return Description(pieces, grids, PeftPolicy(local, merges, gathered_bytes=gathered))


def _layer_infos(layers: Mapping[str, dict]) -> dict[str, LoraLayerInfo]:
    """The LoRA layers by the checkpoint name of their base weight."""
    out: dict[str, LoraLayerInfo] = {}
    for path, spec in layers.items():
        base = path.removeprefix("base_model.model.")
        info = LoraLayerInfo(
            name=f"{base}.weight", kind=spec["kind"], fan_in_fan_out=spec["fan_in_fan_out"], adapters=spec["adapters"]
        )
        if spec["bias"]:
            info.bias = f"{base}.bias"
        out[info.name] = info
    return out


def _split_factors(
    pieces: list[PieceSpec], grids: list[GridSpec], local: Mapping[str, torch.Tensor], rank: int
) -> tuple[dict, dict, list[PieceSpec], list[GridSpec]]:
    """The LoRA factors' boxes this rank holds (with their values) and their
    shapes, apart from the pieces and grids that are published."""
    parts: dict[str, list[tuple[Box, torch.Tensor]]] = {}
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    keep_pieces: list[PieceSpec] = []
    keep_grids: list[GridSpec] = []
    for p in pieces:
        if not p.tensor.name.startswith(_FACTOR):
            keep_pieces.append(p)
            continue
        slot = Slot(rank, p.box, p.local, p.local_shape, p.offset or (0,) * len(p.local_shape), p.dims)
        parts.setdefault(p.tensor.name, []).append((p.box, local_view(local[p.local], slot, p.box)))
        shapes[p.tensor.name] = (p.tensor.shape, p.tensor.dtype)
    for g in grids:
        if not g.tensor.name.startswith(_FACTOR):
            keep_grids.append(g)
            continue
        box = _my_box(g, rank)
        if not box.is_empty():
            parts.setdefault(g.tensor.name, []).append((box, local[g.tensor.name]))
        shapes[g.tensor.name] = (g.tensor.shape, g.tensor.dtype)
    return parts, shapes, keep_pieces, keep_grids


_MARKERS = ((".lora_A.", "A"), (".lora_B.", "B"), (".lora_embedding_A.", "A"), (".lora_embedding_B.", "B"))


def _attach(factors: Mapping[str, torch.Tensor], by_weight: Mapping[str, LoraLayerInfo], rank: int) -> None:
    """Hand every whole factor to its layer; every layer must have its A and B."""
    for fname, t in factors.items():
        name = fname.removeprefix(_FACTOR)
        for marker, key in _MARKERS:
            if marker not in name:
                continue
            path, _, rest = name.partition(marker)
            adapter = rest.split(".", 1)[0]
            owner = by_weight.get(f"{path}.weight")
            if owner is not None and key == "B" and rest.endswith(".bias"):
                owner.factors[f"b:{adapter}"] = t
            elif owner is not None and not rest.endswith(".bias"):
                owner.factors[f"{key}:{adapter}"] = t
            break
    for info in by_weight.values():
        for adapter, _ in info.adapters:
            if f"A:{adapter}" not in info.factors or f"B:{adapter}" not in info.factors:
                raise ValueError(
                    f"rank {rank}: the LoRA factors of {info.name!r} (adapter {adapter!r}) are held by no "
                    "trainer rank reshard can read"
                )


def _merges(
    pieces: list[PieceSpec],
    grids: list[GridSpec],
    local: Mapping[str, torch.Tensor],
    by_weight: Mapping[str, LoraLayerInfo],
    rank: int,
) -> dict[str, list[_Merge]]:
    """Per local tensor, the boxes of LoRA-targeted weights (or LoRA biases) it holds."""
    by_bias = {info.bias: info for info in by_weight.values() if info.bias}
    out: dict[str, list[_Merge]] = {}
    for p in pieces:
        target = by_weight.get(p.tensor.name) or by_bias.get(p.tensor.name)
        if target is not None:
            slot = Slot(rank, p.box, p.local, p.local_shape, p.offset or (0,) * len(p.local_shape), p.dims)
            out.setdefault(p.local, []).append(_Merge(target, slot, p.box, p.tensor.name == target.bias))
    for g in grids:
        target = by_weight.get(g.tensor.name) or by_bias.get(g.tensor.name)
        if target is None:
            continue
        box = _my_box(g, rank)
        if box.is_empty():
            continue
        lt = local[g.tensor.name]
        slot = Slot(rank, box, g.tensor.name, tuple(lt.shape), (0,) * lt.dim())
        out.setdefault(g.tensor.name, []).append(_Merge(target, slot, box, g.tensor.name == target.bias))
    return out


READER = TrainerReader(name="PEFT LoRA (merged)", describe=_describe)
"""A PEFT LoRA policy, under any trainer reshard reads, as merged weights."""
