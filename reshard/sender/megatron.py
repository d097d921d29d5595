"""Megatron-Core trainers as senders: the Megatron trainer reader.

Every trainer rank describes what its own parameter slices hold, in
checkpoint (Hugging Face) terms, and sends only those: no gather on the
trainer. The description is read from Megatron's own objects:

- tensor-parallel cuts from the parameters' ``tensor_model_parallel``,
  ``partition_dim`` attributes and the ranks in ``parallel_state``;
- the fused ``linear_qkv`` from ``TransformerConfig`` (``num_attention_heads``,
  ``num_query_groups``, ``kv_channels``): rows grouped by query group, each
  group ``[its q heads, one k head, one v head]``; a TP rank holds a
  contiguous ``1/TP`` of those rows, so one local tensor is several pieces of
  q, k and v (also when ``TP > num_query_groups``, where a rank holds part of
  a group);
- gated ``linear_fc1``: a rank holds ``[gate_r; up_r]`` (what
  ``partition_stride=2`` says), two pieces;
- vocab padding: the rows past the checkpoint's ``vocab_size`` are not sent;
- pipeline stages: a layer's global index is its ``layer_number - 1``;
- experts: a local expert's global index is ``MoELayer.local_expert_indices``;
  experts are cut over expert-TP (``expert_tensor_parallel``), not TP.

Call order (every trainer rank, after ``parallel_state.initialize_model_parallel``
and after anything that replaces ``param.data``, e.g. DDP's contiguous
buffers; the sender reads parameters in place, so in-place optimizer updates
need nothing):

1. ``sender = Sender(MegatronSource(model=model, hf_config=cfg), config=GroupConfig(...))``
   (what ``reshard.adapters.megatron.megatron_sender`` builds)
2. ``sender.push(n)`` each refit, while engine workers pull ``n``.
3. ``sender.close()``.

Covered: the local and Transformer Engine specs of GPTModel (dense,
GQA, qkv bias, qk-norm, MoE with SequentialMLP / TEGroupedMLP / the legacy
GroupedMLP ``weight1``/``weight2``, shared experts and their gate, router
expert bias, MLA), for Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE and
DeepSeek-V2/V3. See ``docs/megatron.md`` for what is not.

This is a built-in trainer reader (:data:`READER`): ``Sender`` runs it
for every trainer, so it imports only ``plan`` and the reader contract,
and Megatron lazily; a Megatron tensor-parallel shard passed as a plain
module is refused here, naming :class:`MegatronSource`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reshard.plan.box import Box, full_box
from reshard.plan.layout import TensorMeta
from reshard.plan.specs import PieceSpec
from reshard.sender.readers import Description, ReadContext, TrainerReader

if TYPE_CHECKING:
    import torch

__all__ = [
    "READER",
    "MegatronRanks",
    "MegatronSource",
    "checkpoint_recipe",
    "megatron_pieces",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronRanks:
    """This rank's coordinates in the cuts that matter for its parameters."""

    tp_rank: int = 0
    tp_size: int = 1
    etp_rank: int = 0
    """Expert-tensor-parallel rank (experts are cut over this, not TP)."""
    etp_size: int = 1

    def __post_init__(self) -> None:
        for r, n, what in ((self.tp_rank, self.tp_size, "tp"), (self.etp_rank, self.etp_size, "etp")):
            if not 0 <= r < n:
                raise ValueError(f"{what} rank {r} outside 0..{n - 1}")

    @classmethod
    def current(cls) -> MegatronRanks:
        """Read from ``megatron.core.parallel_state`` (must be initialised)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("megatron.core.parallel_state is not initialised; call initialize_model_parallel first")
        return cls(
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
        )


# -- names -------------------------------------------------------------------

# Megatron suffix inside a layer (global form: experts carry their global
# index) -> (kind, checkpoint suffixes). ``{shared}`` is the family's
# shared-expert module name; ``\1`` refers to the pattern's group.
_LAYER_RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (r"input_layernorm\.weight", "copy", ("input_layernorm.weight",)),
    (r"self_attention\.linear_qkv\.layer_norm_weight", "copy", ("input_layernorm.weight",)),
    (r"pre_mlp_layernorm\.weight", "copy", ("post_attention_layernorm.weight",)),
    (r"mlp\.linear_fc1\.layer_norm_weight", "copy", ("post_attention_layernorm.weight",)),
    (
        r"self_attention\.linear_qkv\.(weight|bias)",
        "qkv",
        (r"self_attn.q_proj.\1", r"self_attn.k_proj.\1", r"self_attn.v_proj.\1"),
    ),
    (r"self_attention\.linear_proj\.(weight|bias)", "copy", (r"self_attn.o_proj.\1",)),
    (r"self_attention\.k_layernorm\.weight", "copy", ("self_attn.k_norm.weight",)),
    # MLA (DeepSeek-V2/V3); q_layernorm is handled in checkpoint_recipe.
    (r"self_attention\.linear_q_proj\.weight", "copy", ("self_attn.q_proj.weight",)),
    (r"self_attention\.linear_q_down_proj\.weight", "copy", ("self_attn.q_a_proj.weight",)),
    (r"self_attention\.linear_q_up_proj\.weight", "copy", ("self_attn.q_b_proj.weight",)),
    (r"self_attention\.linear_q_up_proj\.layer_norm_weight", "copy", ("self_attn.q_a_layernorm.weight",)),
    (r"self_attention\.linear_kv_down_proj\.weight", "copy", ("self_attn.kv_a_proj_with_mqa.weight",)),
    (r"self_attention\.kv_layernorm\.weight", "copy", ("self_attn.kv_a_layernorm.weight",)),
    (r"self_attention\.linear_kv_up_proj\.weight", "copy", ("self_attn.kv_b_proj.weight",)),
    (r"self_attention\.linear_kv_up_proj\.layer_norm_weight", "copy", ("self_attn.kv_a_layernorm.weight",)),
    # MLPs: dense, routed experts, shared experts.
    (r"mlp\.linear_fc1\.weight", "gated", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    (r"mlp\.linear_fc2\.weight", "copy", ("mlp.down_proj.weight",)),
    (r"mlp\.router\.weight", "copy", ("mlp.gate.weight",)),
    (r"mlp\.router\.expert_bias", "copy", ("mlp.gate.e_score_correction_bias",)),
    (
        r"mlp\.experts\.(\d+)\.linear_fc1\.weight",
        "gated",
        (r"mlp.experts.\1.gate_proj.weight", r"mlp.experts.\1.up_proj.weight"),
    ),
    (r"mlp\.experts\.(\d+)\.linear_fc2\.weight", "copy", (r"mlp.experts.\1.down_proj.weight",)),
    (
        r"mlp\.shared_experts\.linear_fc1\.weight",
        "gated",
        ("mlp.{shared}.gate_proj.weight", "mlp.{shared}.up_proj.weight"),
    ),
    (r"mlp\.shared_experts\.linear_fc2\.weight", "copy", ("mlp.{shared}.down_proj.weight",)),
    (r"mlp\.shared_experts\.gate_weight", "copy", ("mlp.shared_expert_gate.weight",)),
    # Multi-token prediction layers (``mtp.layers.{i}``, numbered after the
    # decoder's: DeepSeek-V3-style checkpoints, ``model.layers.{num_layers + i}``).
    (r"enorm\.weight", "copy", ("enorm.weight",)),
    (r"hnorm\.weight", "copy", ("hnorm.weight",)),
    (r"eh_proj\.weight", "copy", ("eh_proj.weight",)),
    (r"final_layernorm\.weight", "copy", ("shared_head.norm.weight",)),
)
_LAYER_RES = tuple((re.compile(p + "$"), kind, out) for p, kind, out in _LAYER_RULES)
_TOP_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",)),
    "output_layer.weight": ("vocab", ("lm_head.weight",)),
    "decoder.final_layernorm.weight": ("copy", ("model.norm.weight",)),
}
_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Families whose shared expert is one module named in the singular.
_SINGULAR_SHARED = ("qwen2_moe",)


def checkpoint_recipe(name: str, *, model_type: str = "", mla: bool = False) -> tuple[str, tuple[str, ...]] | None:
    """How a Megatron parameter in global form (global layer and expert
    indices: ``decoder.layers.5.mlp.experts.17.linear_fc1.weight``) maps to
    checkpoint tensors: ``(kind, names)`` with ``kind`` one of ``copy``,
    ``vocab`` (padded rows dropped), ``qkv`` (q, k, v) and ``gated`` (gate,
    up); ``None`` when the name is not a model weight reshard knows."""
    top = _TOP_RULES.get(name)
    if top is not None:
        return top
    m = _LAYER_NAME.match(name)
    if m is None:
        return None
    layer, rest = m.group(1), m.group(2)
    prefix = f"model.layers.{layer}."
    if rest == "self_attention.q_layernorm.weight":
        return "copy", (prefix + ("self_attn.q_a_layernorm.weight" if mla else "self_attn.q_norm.weight"),)
    shared = "shared_expert" if model_type in _SINGULAR_SHARED else "shared_experts"
    for pat, kind, outs in _LAYER_RES:
        mm = pat.match(rest)
        if mm is not None:
            return kind, tuple(prefix + mm.expand(o).replace("{shared}", shared) for o in outs)
    return None


# -- regions and segments ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Region:
    """Box ``box`` of the full (unsharded) Megatron tensor sits in the local
    tensor at ``offset``; full dim ``i`` runs along local dim ``dims[i]``."""

    box: Box
    offset: tuple[int, ...]
    dims: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class _Segment:
    """Box ``box`` of the full Megatron tensor is checkpoint tensor ``name``
    (shape ``shape``) from ``origin`` on."""

    name: str
    shape: tuple[int, ...]
    box: Box
    origin: tuple[int, ...]


def _regions(
    full: tuple[int, ...], dim: int | None, stride: int, rank: int, size: int, *, base=None, dims=()
) -> list[_Region]:
    """The boxes of the full tensor a rank holds when ``dim`` is cut ``size``
    ways with ``stride`` (Megatron's ``partition_stride``: the dim is
    ``stride`` equal blocks, each cut ``size`` ways, and a rank's blocks sit
    one after the other locally)."""
    nd = len(full)
    base = tuple(base) if base is not None else (0,) * nd
    if dim is None or (size == 1 and stride == 1):
        return [_Region(full_box(full), base, dims)]
    n = full[dim]
    if n % (stride * size):
        raise ValueError(f"dim {dim} of size {n} does not cut into {stride} x {size} parts")
    part = n // (stride * size)
    out = []
    for j in range(stride):
        offs = [0] * nd
        sizes = list(full)
        offs[dim] = j * (n // stride) + rank * part
        sizes[dim] = part
        local = list(base)
        local[dims[dim] if dims else dim] += j * part
        out.append(_Region(Box(tuple(offs), tuple(sizes)), tuple(local), dims))
    return out


def _segments(kind: str, names: tuple[str, ...], full: tuple[int, ...], cfg: Any, vocab: int) -> list[_Segment]:
    nd = len(full)
    zero = (0,) * nd
    tail = full[1:]
    if kind == "copy":
        return [_Segment(names[0], full, full_box(full), zero)]
    if kind == "vocab":
        if vocab > full[0]:
            raise ValueError(f"{names[0]}: checkpoint vocabulary {vocab} exceeds Megatron's {full[0]} rows")
        shape = (vocab, *tail)
        return [_Segment(names[0], shape, full_box(shape), zero)]
    if kind == "gated":
        if full[0] % 2:
            raise ValueError(f"{names[0]}: gated linear_fc1 with an odd row count {full[0]}")
        f = full[0] // 2
        shape = (f, *tail)
        return [
            _Segment(names[0], shape, Box(zero, shape), zero),
            _Segment(names[1], shape, Box((f, *zero[1:]), shape), zero),
        ]
    if kind == "qkv":
        heads = int(cfg.num_attention_heads)
        groups = int(cfg.num_query_groups or heads)
        hd = int(cfg.kv_channels)
        if getattr(cfg, "attention_output_gate", False):
            raise ValueError("linear_qkv with attention_output_gate is not supported")
        if heads % groups or full[0] != (heads + 2 * groups) * hd:
            raise ValueError(
                f"{names[0]}: linear_qkv has {full[0]} rows, expected ({heads} + 2 x {groups}) x {hd} "
                "(num_attention_heads, num_query_groups, kv_channels)"
            )
        qpg = heads // groups
        q_shape, kv_shape = (heads * hd, *tail), (groups * hd, *tail)
        out = []
        for g in range(groups):
            start = g * (qpg + 2) * hd
            for name, shape, at, rows, origin in (
                (names[0], q_shape, start, qpg * hd, g * qpg * hd),
                (names[1], kv_shape, start + qpg * hd, hd, g * hd),
                (names[2], kv_shape, start + (qpg + 1) * hd, hd, g * hd),
            ):
                out.append(_Segment(name, shape, Box((at, *zero[1:]), (rows, *tail)), (origin, *zero[1:])))
        return out
    raise ValueError(f"unknown recipe kind {kind!r}")


def _pieces_of(
    regions: Iterable[_Region], segments: Iterable[_Segment], local: str, local_shape: tuple[int, ...], dtype: str
) -> list[PieceSpec]:
    out = []
    segments = list(segments)
    for reg in regions:
        for seg in segments:
            inter = reg.box.intersect(seg.box)
            if inter is None:
                continue
            box = Box(
                tuple(i - s + o for i, s, o in zip(inter.offsets, seg.box.offsets, seg.origin, strict=True)),
                inter.sizes,
            )
            off = list(reg.offset)
            for d, (i, r) in enumerate(zip(inter.offsets, reg.box.offsets, strict=True)):
                off[reg.dims[d] if reg.dims else d] += i - r
            out.append(PieceSpec(TensorMeta(seg.name, seg.shape, dtype), box, local, local_shape, tuple(off), reg.dims))
    return out


# -- reading a model ---------------------------------------------------------


def _unwrap(module: Any) -> Any:
    # DDP, Float16Module and friends keep the model in ``.module``.
    while not hasattr(module, "decoder") and hasattr(module, "module"):
        module = module.module
    return module


def _hf_dict(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return dict(hf_config.to_dict())
    raise TypeError(f"hf_config must be a dict or a transformers config, got {type(hf_config).__name__}")


_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_TE_GROUPED = re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$")
_LEGACY_GROUPED = re.compile(r"^mlp\.experts\.weight([12])$")


def _named_tensors(chunk: Any) -> list[tuple[str, Any, bool]]:
    """(name, tensor, is_parameter): parameters and persistent buffers."""
    out = [(n, p, True) for n, p in chunk.named_parameters()]
    persistent = set(chunk.state_dict(keep_vars=True))
    seen = {id(p) for _, p, _ in out}
    out += [(n, b, False) for n, b in chunk.named_buffers() if n in persistent and id(b) not in seen]
    return out


def megatron_pieces(
    model: Any, *, hf_config: Any, ranks: MegatronRanks | None = None
) -> tuple[list[PieceSpec], dict[str, torch.Tensor]]:
    """(pieces, local tensors) of this rank's Megatron model chunk(s).

    ``model``: a GPTModel, possibly wrapped (DDP, Float16Module), or a list
    of virtual-pipeline chunks. ``hf_config``: the checkpoint's config (dict
    or transformers config); ``model_type``, ``vocab_size`` and
    ``tie_word_embeddings`` are read. ``ranks``: default
    :meth:`MegatronRanks.current`. Local tensors are the parameters
    themselves (detached, same storage), named as in ``named_parameters``
    (``chunk{i}.`` prefixed when there are several chunks).
    """
    if ranks is None:
        ranks = MegatronRanks.current()
    hf = _hf_dict(hf_config)
    chunks = [_unwrap(c) for c in (model if isinstance(model, (list, tuple)) else [model])]
    model_type = str(hf.get("model_type", ""))
    vocab = int(hf.get("vocab_size") or 0)
    pieces: list[PieceSpec] = []
    tensors: dict[str, torch.Tensor] = {}
    for ci, chunk in enumerate(chunks):
        cfg = chunk.config
        mla = bool(getattr(cfg, "multi_latent_attention", False))
        shared_emb = bool(getattr(chunk, "share_embeddings_and_output_weights", False))
        tied = hf.get("tie_word_embeddings")
        tied = shared_emb if tied is None else bool(tied)
        if tied and not shared_emb:
            raise ValueError("the checkpoint ties embeddings and LM head; the Megatron model does not")
        for name, t, is_param in _named_tensors(chunk):
            mtp = _mtp_layer(chunk, name, cfg) if name.startswith("mtp.") else None
            lt, entries = _describe(chunk, name, t, ranks=ranks, cfg=cfg, mtp=mtp)
            local = name if len(chunks) == 1 else f"chunk{ci}.{name}"
            dtype = str(t.dtype).removeprefix("torch.")
            for gname, full, regions in entries:
                if gname == "output_layer.weight" and tied:
                    continue  # the last stage's copy of the embedding; the first stage sends that
                recipe = checkpoint_recipe(gname, model_type=model_type, mla=mla)
                if recipe is None:
                    if is_param:
                        raise ValueError(f"Megatron parameter {name!r} (global {gname!r}) has no checkpoint mapping")
                    continue
                kind, names = recipe
                if kind == "gated" and not getattr(cfg, "gated_linear_unit", False):
                    raise ValueError(f"{name!r}: only gated (SwiGLU) linear_fc1 layers are supported")
                if kind == "vocab" and not vocab:
                    raise ValueError("hf_config needs vocab_size to drop Megatron's vocabulary padding")
                segs = _segments(kind, names, full, cfg, vocab)
                if gname == "embedding.word_embeddings.weight" and shared_emb and not tied:
                    # Megatron ties, the checkpoint does not: the embedding is the LM head too.
                    segs += _segments("vocab", ("lm_head.weight",), full, cfg, vocab)
                tensors[local] = lt
                pieces += _pieces_of(regions, segs, local, tuple(lt.shape), dtype)
    return pieces, tensors


_Entry = tuple[str, tuple[int, ...], list[_Region]]
_MTP_NAME = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")


def _mtp_layer(chunk: Any, name: str, cfg: Any) -> tuple[str, Any]:
    """A multi-token prediction parameter (``mtp.layers.{i}.*``) in global
    form: the decoder layer after the last (``decoder.layers.{num_layers + i}.*``,
    as DeepSeek-V3-style checkpoints number MTP layers), and the transformer
    layer inside it (``None`` for its own norms and projection)."""
    m = _MTP_NAME.match(name)
    if m is None:
        raise ValueError(f"Megatron parameter {name!r}: not an MTP layer's (mtp.layers.<i>.<name>)")
    i, rest = int(m.group(1)), m.group(2)
    layer = chunk.mtp.layers[i]
    index = int(cfg.num_layers) + i
    for inner in ("mtp_model_layer.", "transformer_layer."):
        if rest.startswith(inner):
            return f"decoder.layers.{index}.{rest[len(inner) :]}", getattr(layer, inner[:-1])
    return f"decoder.layers.{index}.{rest}", None


def _describe(
    chunk: Any, name: str, t: Any, *, ranks: MegatronRanks, cfg: Any, mtp: tuple[str, Any] | None = None
) -> tuple[Any, list[_Entry]]:
    """(local tensor, [(global name, full shape, regions)]) of one parameter
    or buffer (``mtp``: its global form and transformer layer, see :func:`_mtp_layer`)."""
    m = _LAYER_NAME.match(name)
    if mtp is not None:
        gname, layer = mtp
        rest = gname.split(".", 3)[3]
    elif m is None:
        gname, rest, layer = name, name, None
    else:
        layer = chunk.decoder.layers[int(m.group(1))]
        rest = m.group(2)
        # layer_number is 1-based and global: it already has the pipeline
        # (and virtual-pipeline) offset in it.
        gname = f"decoder.layers.{int(layer.layer_number) - 1}.{rest}"
    expert = rest.startswith("mlp.experts.")
    rank, size = (ranks.etp_rank, ranks.etp_size) if expert else (ranks.tp_rank, ranks.tp_size)
    if expert and layer is not None:
        indices = [int(i) for i in layer.mlp.local_expert_indices]
        prefix = gname[: len(gname) - len(rest)]
        if (mm := _LOCAL_EXPERT.match(rest)) is not None:
            gname = f"{prefix}mlp.experts.{indices[int(mm.group(1))]}.{mm.group(2)}"
        elif (mm := _TE_GROUPED.match(rest)) is not None:
            gname = f"{prefix}mlp.experts.{indices[int(mm.group(2))]}.linear_fc{mm.group(1)}.weight"
        elif (mm := _LEGACY_GROUPED.match(rest)) is not None:
            return _legacy_grouped(prefix, int(mm.group(1)), t, indices, cfg, rank, size)
    dim: int | None = None
    stride = 1
    if getattr(t, "tensor_model_parallel", False):
        dim = int(getattr(t, "partition_dim", 0))
        stride = int(getattr(t, "partition_stride", 1))
    if dim == 0 and gname.endswith("linear_fc1.weight") and getattr(cfg, "gated_linear_unit", False):
        # The forward splits each rank's output in two, [gate_r; up_r], whatever the attribute says.
        stride = 2
    full = [int(s) for s in t.shape]
    if dim is not None:
        full[dim] *= size
    return t.detach(), [(gname, tuple(full), _regions(tuple(full), dim, stride, rank, size))]


def _legacy_grouped(
    prefix: str, which: int, t: Any, indices: list[int], cfg: Any, rank: int, size: int
) -> tuple[Any, list[_Entry]]:
    """Legacy GroupedMLP (mcore <= 0.16): ``weight1`` is ``[H, E_local x 2F/etp]``,
    used as ``view(E_local, H, 2F/etp)`` (expert ``e``'s fc1, transposed);
    ``weight2`` is ``[E_local x F/etp, H]``, used as ``view(E_local, F/etp, H)``
    (fc2, transposed). Pieces point into that view."""
    hidden = int(cfg.hidden_size)
    n_local = len(indices)
    view = t.detach().view(n_local, hidden, -1) if which == 1 else t.detach().view(n_local, -1, hidden)
    per = int(view.shape[2] if which == 1 else view.shape[1])
    entries: list[_Entry] = []
    for pos, e in enumerate(indices):
        if which == 1:
            full = (per * size, hidden)  # fc1 [2F, H], rows along local dim 2, [gate_r; up_r]
            regs = _regions(full, 0, 2, rank, size, base=(pos, 0, 0), dims=(2, 1))
        else:
            full = (hidden, per * size)  # fc2 [H, F], cut on dim 1 (local dim 1)
            regs = _regions(full, 1, 1, rank, size, base=(pos, 0, 0), dims=(2, 1))
        entries.append((f"{prefix}mlp.experts.{e}.linear_fc{which}.weight", full, regs))
    return view, entries


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronSource:
    """This rank's Megatron-Core model as ``Sender(source)`` reads it:
    ``Sender(MegatronSource(model=model, hf_config=hf), config=...)``.

    ``model``: a GPTModel, possibly wrapped (DDP, Float16Module), or a list
    of virtual-pipeline chunks; ``hf_config``: the checkpoint's config;
    ``ranks``: default :meth:`MegatronRanks.current` (see
    :func:`megatron_pieces`). Read again at every push, like any trainer."""

    model: Any
    hf_config: Any
    ranks: MegatronRanks | None = None


def _describe_source(source: Any, ctx: ReadContext) -> Description | None:
    if not isinstance(source, MegatronSource):
        return None
    pieces, tensors = megatron_pieces(source.model, hf_config=source.hf_config, ranks=source.ranks)
    return Description(pieces, [], tensors)


def _refuse_shard(name: str, t: torch.Tensor, ctx: ReadContext) -> str | None:
    if not getattr(t, "tensor_model_parallel", False):
        return None
    return (
        f"rank {ctx.rank}: {name!r} of {ctx.where} (shape {list(t.shape)}) is a Megatron-Core tensor-parallel "
        "shard; pass Sender a reshard.sender.megatron.MegatronSource(model=model, hf_config=...), which knows "
        "how it is cut"
    )


READER = TrainerReader(name="Megatron-Core (MegatronSource)", describe=_describe_source, refuse=_refuse_shard)
"""Megatron's TP/PP/EP/ETP cuts, fused QKV and gated MLP, from its own
parallel state: each rank publishes only its own slices; a shard passed
without them is refused."""
