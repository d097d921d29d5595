"""Layout rules for planning at scale: how trainers and vLLM shard a model.

These rules describe layouts by name pattern so ``reshard plan`` can cost a
cluster that does not exist yet. At run time layouts are never taken from
here: senders read DTensor placements or the Megatron adapter's pieces, and
receivers learn their layout from the engine's own loaders; a test checks
the vLLM rules below against layouts learned from a real vLLM.

Trainer rules
-------------
- ``fsdp=N``: every tensor ``Shard(0)`` over N ranks (FSDP2; torch.chunk).
- ``tp=,pp=,ep=,etp=,dp=``: Megatron-Core. Column-parallel (q/k/v, gate,
  up, q_b, kv_b) cut dim 0, row-parallel (o, down) cut dim 1, vocab cut
  dim 0 over the vocabulary padded to a multiple of ``128 * tp``; norms,
  routers and MLA down-projections replicate (Transformer Engine spec; the
  local spec cuts the latter on dim 0). With fewer KV heads than ``tp``
  each rank holds a contiguous ``1/tp`` of Megatron's fused ``linear_qkv``
  (per query group ``[q heads, k, v]``), so q, k and v are cut where those
  rows fall; layouts that are no grid raise. Layers split over pipeline
  stages as evenly as possible (earlier stages take the remainder); the
  embedding sits on the first stage, final norm and LM head on the last.
  Experts are spread over ``ep`` ranks, each expert cut ``etp`` ways.
  Rank order is Megatron's default ``tp-cp-ep-dp-pp`` (tp fastest).
  ``dp`` defaults to the smallest value with ``tp*dp`` a multiple of
  ``ep*etp``.

Engine rules (vLLM 0.32)
------------------------
``tp=T,dp=D`` is D replicas of a T-way tensor-parallel engine. q/k/v fuse
into ``qkv_proj`` (KV heads replicated when fewer than T), gate/up into
``gate_up_proj``, experts into ``FusedMoE`` stacks
(``experts.routed_experts.w13_weight`` / ``w2_weight``), DeepSeek's
``q_a_proj`` + ``kv_a_proj_with_mqa`` into a replicated
``fused_qkv_a_proj``; vocab-parallel layers pad the vocabulary to a
multiple of 64. ``ep=on`` turns on expert parallelism (experts spread over
all T*D ranks, not cut).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from reshard.plan.box import chunk_range
from reshard.plan.index import LayoutSet, gc_paused
from reshard.plan.layout import Grid, Layout, LocalTensor, Mesh, TensorMeta

__all__ = ["EngineSpec", "SideLayouts", "TrainerSpec", "engine_layouts", "trainer_layouts"]

_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<kind>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj", "w1", "w3")
_ROW = ("o_proj", "down_proj", "w2")
_REPLICATED_LINEAR = ("q_a_proj", "kv_a_proj_with_mqa", "gate", "shared_expert_gate")


def _parse(text: str, allowed: Iterable[str]) -> dict[str, int]:
    allowed = set(allowed)
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise ValueError(f"bad parallel spec {text!r}: {part!r} is not key=value")
        k, v = (x.strip() for x in part.split("=", 1))
        if k not in allowed:
            raise ValueError(
                f"bad parallel spec {text!r}: unknown degree {k!r} (allowed: {', '.join(sorted(allowed))})"
            )
        if v in ("on", "true"):
            out[k] = -1
            continue
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"bad parallel spec {text!r}: {k}={v!r} is not an integer") from None
        if n < 1:
            raise ValueError(f"bad parallel spec {text!r}: {k} must be >= 1")
        out[k] = n
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerSpec:
    """Trainer parallel degrees: FSDP, or Megatron TP/PP/EP/ETP/DP."""

    fsdp: int = 0
    """FSDP2 world size (every tensor Shard(0)); 0 for a Megatron layout."""
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 0
    """Data-parallel degree; 0 derives the smallest that fits ``ep * etp``."""

    def __post_init__(self) -> None:
        if self.fsdp and (self.tp, self.pp, self.ep, self.etp) != (1, 1, 1, 1):
            raise ValueError("fsdp=N combines with no Megatron degree (tp, pp, ep, etp)")
        if not self.fsdp and (self.tp * self.dp_size) % (self.ep * self.etp):
            raise ValueError(
                f"tp*dp = {self.tp * self.dp_size} is not a multiple of ep*etp = {self.ep * self.etp} "
                "(Megatron carves expert parallelism out of tp x dp)"
            )

    @classmethod
    def parse(cls, text: str) -> TrainerSpec:
        return cls(**_parse(text, ("fsdp", "tp", "pp", "ep", "etp", "dp")))

    @property
    def dp_size(self) -> int:
        if self.dp:
            return self.dp
        need = self.ep * self.etp
        return max(1, -(-need // self.tp)) if need > self.tp else 1

    @property
    def world(self) -> int:
        return self.fsdp or self.tp * self.pp * self.dp_size

    def __str__(self) -> str:
        if self.fsdp:
            return f"fsdp={self.fsdp}"
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp_size}"]
        if self.ep > 1:
            parts += [f"ep={self.ep}", f"etp={self.etp}"]
        return ",".join(parts)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSpec:
    """vLLM engine layout: ``dp`` replicas of ``tp``-way tensor parallelism."""

    tp: int = 1
    dp: int = 1
    ep: bool = False
    """Expert parallelism over all ``tp * dp`` ranks (vLLM ``enable_expert_parallel``)."""

    @classmethod
    def parse(cls, text: str) -> EngineSpec:
        d = _parse(text, ("tp", "dp", "ep"))
        ep = d.pop("ep", 0)
        spec = cls(tp=d.get("tp", 1), dp=d.get("dp", 1), ep=bool(ep))
        if ep not in (0, -1, 1) and ep != spec.world:
            raise ValueError(f"vLLM's expert parallel size is tp*dp = {spec.world}; got ep={ep} (use ep=on)")
        return spec

    @property
    def world(self) -> int:
        return self.tp * self.dp

    def __str__(self) -> str:
        return f"tp={self.tp},dp={self.dp}" + (",ep=on" if self.ep else "")


@dataclass(slots=True)
class SideLayouts:
    """One side's grids (one shared table), its ranks, and its pipeline stages."""

    table: tuple[TensorMeta, ...]
    grids: list[Grid]
    ranks: range
    stages: list[tuple[int, list[str]]] = field(default_factory=list)
    """(root rank, tensor names) per pipeline stage: gather-and-broadcast's roots."""

    def layout_set(self, role: str, *, check_ranks: Iterable[int] | None = None) -> LayoutSet:
        s = LayoutSet(role, check_ranks=check_ranks)
        with gc_paused():
            for g in self.grids:
                s.add_grid(self.table, g)
            s.finish()
        return s

    def layout_of(self, rank: int) -> Layout:
        """The layout ``rank`` would publish: the shared table and its grids."""
        grids = tuple(g for g in self.grids if _in_mesh(g.mesh, rank))
        return Layout(rank=rank, tensors=self.table, grids=grids)


def _in_mesh(mesh: Mesh, rank: int) -> bool:
    if mesh.ranks:
        return rank in mesh.ranks
    # Affine meshes: solve coordinate by coordinate (strides are positive here).
    strides = mesh.strides or tuple(_prod(mesh.shape[i + 1 :]) for i in range(len(mesh.shape)))
    rest = rank - mesh.start
    if rest < 0:
        return False
    for s, st in sorted(zip(mesh.shape, strides, strict=True), key=lambda x: -x[1]):
        c = rest // st
        if c >= s:
            return False
        rest -= c * st
    return rest == 0


def _prod(xs: Iterable[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


class _Builder:
    """Collects (tensor, grid-without-tensors, position) and emits one table
    with each grid's tensors in a contiguous range."""

    def __init__(self) -> None:
        self.groups: dict[tuple, list[tuple[int, TensorMeta]]] = {}

    def add(self, meta: TensorMeta, key: tuple, pos: int = 0) -> None:
        self.groups.setdefault(key, []).append((pos, meta))

    def build(self) -> tuple[tuple[TensorMeta, ...], list[Grid]]:
        table: list[TensorMeta] = []
        grids: list[Grid] = []
        for key, members in self.groups.items():
            members.sort(key=lambda x: x[0])
            mesh, shard, block, local, offset, step, dims = key
            if step and [p for p, _ in members] != list(range(len(members))):
                raise ValueError(f"stacked tensors of {members[0][1].name!r} are not positions 0..n-1")
            start = len(table)
            table.extend(m for _, m in members)
            grids.append(
                Grid(
                    tensors=(start, len(table), 1),
                    mesh=mesh,
                    shard=shard,
                    block=block,
                    local=local,
                    offset=offset,
                    step=step,
                    dims=dims,
                )
            )
        return tuple(table), grids


def _spec(ndim: int, dim: int | None, axis: int) -> tuple[tuple[int, ...], ...]:
    return tuple((axis,) if d == dim else () for d in range(ndim))


def _kind(name: str) -> str:
    """Classify a canonical name: column, row, vocab, expert, replicated."""
    if name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
        return "vocab"
    if _EXPERT.match(name):
        return "expert"
    parts = name.split(".")
    if len(parts) >= 2 and parts[-1] in ("weight", "bias"):
        mod = parts[-2]
        if mod in _COLUMN:
            return "column"
        if mod in _ROW and parts[-1] == "weight":
            return "row"
    return "replicated"


def _layer(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _stage_bounds(num_layers: int, pp: int) -> list[int]:
    base, extra = divmod(num_layers, pp)
    bounds = [0]
    for s in range(pp):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds


def trainer_layouts(tensors: tuple[TensorMeta, ...], config: dict[str, Any], spec: TrainerSpec) -> SideLayouts:
    """Grids of a trainer with ``spec`` over ranks ``0 .. spec.world - 1``."""
    with gc_paused():
        return _trainer_layouts(tensors, config, spec)


def _trainer_layouts(tensors: tuple[TensorMeta, ...], config: dict[str, Any], spec: TrainerSpec) -> SideLayouts:
    b = _Builder()
    if spec.fsdp:
        mesh = Mesh(shape=(spec.fsdp,))
        for m in tensors:
            b.add(m, (mesh, _spec(len(m.shape), 0 if m.shape else None, 0), (), None, (), (), ()))
        table, grids = b.build()
        return SideLayouts(table, grids, range(spec.fsdp), [(0, [m.name for m in tensors])])
    tp, pp, dp, ep, etp = spec.tp, spec.pp, spec.dp_size, spec.ep, spec.etp
    stage_size = tp * dp
    num_layers = int(config.get("num_hidden_layers", 0))
    bounds = _stage_bounds(num_layers, pp)
    vocab = int(config.get("vocab_size", 0))
    vocab_block = -(-vocab // (128 * tp)) * 128 if vocab else 0
    edp = stage_size // (ep * etp)
    n_experts = _num_experts(config)
    stages: list[list[str]] = [[] for _ in range(pp)]
    for m in tensors:
        layer = _layer(m.name)
        if layer is None:
            stage = pp - 1 if (m.name.startswith("lm_head") or m.name.endswith("model.norm.weight")) else 0
        else:
            stage = next(s for s in range(pp) if bounds[s] <= layer < bounds[s + 1]) if layer < num_layers else pp - 1
        stages[stage].append(m.name)
        base = stage * stage_size
        kind = _kind(m.name)
        nd = len(m.shape)
        if kind == "expert":
            match = _EXPERT.match(m.name)
            assert match is not None
            e = int(match.group("e"))
            per = -(-n_experts // ep) if n_experts else 1
            ep_rank = e // per
            mesh = Mesh(shape=(edp, etp), start=base + etp * ep_rank, strides=(etp * ep, 1))
            col = match.group("kind") in ("gate_proj", "up_proj", "w1", "w3")
            b.add(m, (mesh, _spec(nd, 0 if col else 1, 1), (), None, (), (), ()))
            continue
        mesh = Mesh(shape=(dp, tp), start=base)
        key: tuple
        qkv = _megatron_qkv_key(m, config, tp, dp, base) if kind == "column" else None
        if qkv is not None:
            key = qkv
        elif kind == "column":
            key = (mesh, _spec(nd, 0, 1), (), None, (), (), ())
        elif kind == "row":
            key = (mesh, _spec(nd, 1, 1), (), None, (), (), ())
        elif kind == "vocab":
            key = (mesh, _spec(nd, 0, 1), (vocab_block,) + (0,) * (nd - 1), None, (), (), ())
        else:
            key = (mesh, _spec(nd, None, 1), (), None, (), (), ())
        b.add(m, key)
    table, grids = b.build()
    return SideLayouts(table, grids, range(spec.world), [(s * stage_size, names) for s, names in enumerate(stages)])


def _megatron_qkv_key(m: TensorMeta, config: dict[str, Any], tp: int, dp: int, base: int) -> tuple | None:
    """Grid key of q/k/v under Megatron TP when KV heads do not split evenly
    (``None``: a plain dim-0 cut). Megatron's ``linear_qkv`` rows are, per
    query group, ``[its q heads, k head, v head]``; TP rank ``r`` holds rows
    ``[r, r + 1) * rows / tp`` of that."""
    parts = m.name.split(".")
    if len(parts) < 2 or parts[-2] not in ("q_proj", "k_proj", "v_proj"):
        return None
    heads = int(config.get("num_attention_heads") or 0)
    groups = int(config.get("num_key_value_heads") or heads)
    if not heads or not groups or groups % tp == 0:
        return None
    rows = m.shape[0]
    hd = rows // (heads if parts[-2] == "q_proj" else groups)
    qpg = heads // groups
    block = (qpg + 2) * hd
    first, size = {"q_proj": (0, qpg * hd), "k_proj": (qpg * hd, hd), "v_proj": ((qpg + 1) * hd, hd)}[parts[-2]]
    if (heads + 2 * groups) * hd % tp:
        raise ValueError(f"{m.name}: Megatron's linear_qkv rows do not split into tp={tp}")
    per = (heads + 2 * groups) * hd // tp
    held: list[tuple[int, int] | None] = []
    for r in range(tp):
        spans = []
        for g in range(groups):
            at = g * block + first
            lo, hi = max(r * per, at), min((r + 1) * per, at + size)
            if lo < hi:
                spans.append((g * size + lo - at, g * size + hi - at))
        if any(a[1] != b[0] for a, b in itertools.pairwise(spans)):
            raise ValueError(f"{m.name}: Megatron TP rank {r} holds {len(spans)} separate runs of rows; not a grid")
        held.append((spans[0][0], spans[-1][1]) if spans else None)
    holders = [r for r, h in enumerate(held) if h]
    step = holders[1] - holders[0] if len(holders) > 1 else 1
    lo0, hi0 = held[holders[0]]  # type: ignore[misc]
    blk = hi0 - lo0
    fits = holders == list(range(holders[0], holders[0] + step * len(holders), step)) and all(
        held[r] == chunk_range(rows, len(holders), i, blk) for i, r in enumerate(holders)
    )
    if not fits:
        raise ValueError(
            f"{m.name}: Megatron's linear_qkv at tp={tp} with {groups} query groups puts rows "
            f"{held} on the TP ranks, which no grid rule describes"
        )
    nd = len(m.shape)
    mesh = Mesh(shape=(dp, len(holders)), start=base + holders[0], strides=(tp, step))
    return (mesh, _spec(nd, 0, 1), (blk,) + (0,) * (nd - 1), None, (), (), ())


def _num_experts(config: dict[str, Any]) -> int:
    for k in ("n_routed_experts", "num_experts", "num_local_experts"):
        if config.get(k):
            return int(config[k])
    return 0


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def engine_layouts(
    tensors: tuple[TensorMeta, ...], config: dict[str, Any], spec: EngineSpec, *, base: int = 0
) -> SideLayouts:
    """Grids of ``spec.dp`` vLLM replicas of ``spec.tp`` ranks from rank ``base`` on.

    Local tensor names, shapes and offsets are vLLM's parameters (fused
    ``qkv_proj``, ``gate_up_proj``, ``w13_weight`` ...), so these layouts can
    be compared with the ones learned from a running engine.
    """
    with gc_paused():
        return _engine_layouts(tensors, config, spec, base)


def _engine_layouts(
    tensors: tuple[TensorMeta, ...], config: dict[str, Any], spec: EngineSpec, base: int
) -> SideLayouts:
    tp, dp = spec.tp, spec.dp
    mesh = Mesh(shape=(dp, tp), start=base)
    heads = int(config.get("num_attention_heads", 1))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    b = _Builder()
    by_name = {m.name: m for m in tensors}
    n_experts = _num_experts(config)
    world = tp * dp

    def plain(m: TensorMeta, dim: int | None, block: int = 0, local: LocalTensor | None = None) -> None:
        nd = len(m.shape)
        blk = tuple(block if d == dim else 0 for d in range(nd)) if block else ()
        b.add(m, (mesh, _spec(nd, dim, 1), blk, local, (0,) * nd if local else (), (), ()))

    def fused(m: TensorMeta, local: LocalTensor, row: int, dim: int | None = 0) -> None:
        nd = len(m.shape)
        b.add(m, (mesh, _spec(nd, dim, 1), (), local, (row,) + (0,) * (nd - 1), (), ()))

    for m in tensors:
        name = m.name
        kind = _kind(name)
        parts = name.split(".")
        mod, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
        prefix = ".".join(parts[:-2])
        nd = len(m.shape)
        if kind == "vocab":
            padded = _pad(m.shape[0], 64)
            if padded % tp:
                raise ValueError(f"{name}: padded vocabulary {padded} does not split into tp={tp}")
            blk = padded // tp
            plain(m, 0, blk, LocalTensor(name, (blk, *m.shape[1:])))
        elif mod in ("q_proj", "k_proj", "v_proj") and leaf in ("weight", "bias"):
            q = by_name[f"{prefix}.q_proj.{leaf}"]
            k = by_name[f"{prefix}.k_proj.{leaf}"]
            head_dim = k.shape[0] // kv_heads
            q_local = q.shape[0] // tp
            kv_local = max(1, kv_heads // tp) * head_dim
            local = LocalTensor(f"{prefix}.qkv_proj.{leaf}", (q_local + 2 * kv_local, *m.shape[1:]))
            if mod == "q_proj":
                fused(m, local, 0)
            else:
                row = q_local if mod == "k_proj" else q_local + kv_local
                if kv_heads >= tp:
                    fused(m, local, row)
                else:
                    rep = tp // kv_heads
                    kv_mesh = Mesh(shape=(dp, kv_heads, rep), start=base)
                    b.add(m, (kv_mesh, _spec(nd, 0, 1), (), local, (row,) + (0,) * (nd - 1), (), ()))
        elif kind == "expert":
            match = _EXPERT.match(name)
            assert match is not None
            e = int(match.group("e"))
            ek = match.group("kind")
            pre = match.group("prefix")
            col = ek in ("gate_proj", "up_proj", "w1", "w3")
            if spec.ep:
                per = n_experts // world
                r = base + e // per
                cut, e_mesh, pos = 1, Mesh(shape=(1,), start=r), e % per
            else:
                per, cut, e_mesh, pos = n_experts, tp, mesh, e
            rows, cols = m.shape
            if col:
                inter = rows // cut
                local = LocalTensor(f"{pre}.routed_experts.w13_weight", (per, 2 * inter, cols))
                row = 0 if ek in ("gate_proj", "w1") else inter
                off = (0, row, 0)
            else:
                inter = cols // cut
                local = LocalTensor(f"{pre}.routed_experts.w2_weight", (per, rows, inter))
                off = (0, 0, 0)
            axis = len(e_mesh.shape) - 1
            shard = ((), ()) if spec.ep else _spec(2, 0 if col else 1, axis)
            b.add(m, (e_mesh, shard, (), local, off, (1, 0, 0), (1, 2)), pos)
        elif mod in ("gate_proj", "up_proj") and leaf == "weight":
            gate = by_name[f"{prefix}.gate_proj.weight"]
            inter = gate.shape[0] // tp
            local = LocalTensor(f"{prefix}.gate_up_proj.weight", (2 * inter, m.shape[1]))
            fused(m, local, 0 if mod == "gate_proj" else inter)
        elif mod in ("q_a_proj", "kv_a_proj_with_mqa") and leaf == "weight":
            qa = by_name[f"{prefix}.q_a_proj.weight"]
            kva = by_name[f"{prefix}.kv_a_proj_with_mqa.weight"]
            local = LocalTensor(f"{prefix}.fused_qkv_a_proj.weight", (qa.shape[0] + kva.shape[0], m.shape[1]))
            fused(m, local, 0 if mod == "q_a_proj" else qa.shape[0], dim=None)
        elif kind == "column":
            plain(m, 0)
        elif kind == "row":
            plain(m, 1)
        else:
            plain(m, None)
    table, grids = b.build()
    return SideLayouts(table, grids, range(base, base + world))
