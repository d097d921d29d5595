"""Building a rank's :class:`Layout` from pieces and grid rules.

The explicit layout API that senders and receivers share: describe what a
rank holds (or needs) as :class:`PieceSpec` records (and, for regular
layouts, :class:`GridSpec` rules), then :func:`build_layout` turns them into
the compact wire layout (one tensor table, locals, pieces, grids).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from reshard.plan.box import Box
from reshard.plan.layout import Grid, Layout, LocalTensor, Mesh, Piece, TensorMeta

__all__ = ["GridSpec", "PieceSpec", "build_layout"]


@dataclass(frozen=True, slots=True)
class PieceSpec:
    """Box ``box`` of canonical tensor ``tensor`` lives in local tensor
    ``local`` (of shape ``local_shape``) at ``offset``; global dim ``i`` runs
    along local dim ``dims[i]`` (``()``: the same dims). ``local_dtype``: the
    local tensor's dtype (``""``: the tensor's; a destination may keep
    another floating-point dtype and cast on arrival)."""

    tensor: TensorMeta
    box: Box
    local: str
    local_shape: tuple[int, ...]
    offset: tuple[int, ...] = ()
    dims: tuple[int, ...] = ()
    local_dtype: str = ""


@dataclass(frozen=True, slots=True)
class GridSpec:
    """Tensor ``tensor`` cut on ``mesh`` (see :class:`reshard.plan.Grid`); each
    rank's chunk is its own local tensor named like the tensor."""

    tensor: TensorMeta
    mesh: Mesh
    shard: tuple[tuple[int, ...], ...]
    block: tuple[int, ...] = ()


def build_layout(rank: int, pieces: Iterable[PieceSpec] = (), grids: Sequence[GridSpec] = ()) -> Layout:
    """One rank's layout. Tensors keep the order they are first named in;
    consecutive grid rules with the same mesh and cuts share one grid."""
    table: list[TensorMeta] = []
    index: dict[str, int] = {}

    def tensor_index(meta: TensorMeta) -> int:
        i = index.get(meta.name)
        if i is None:
            i = index[meta.name] = len(table)
            table.append(meta)
        elif table[i] != meta:
            raise ValueError(
                f"rank {rank}: tensor {meta.name!r} described twice, as {list(table[i].shape)} "
                f"{table[i].dtype} and {list(meta.shape)} {meta.dtype}"
            )
        return i

    # Grid tensors first, in a run each, so one grid covers a range of the table.
    runs: list[tuple[tuple, int, int]] = []
    for g in grids:
        if g.tensor.name in index:
            raise ValueError(f"rank {rank}: tensor {g.tensor.name!r} has two grid rules")
        i = tensor_index(g.tensor)
        key = (g.mesh, g.shard, g.block)
        if runs and runs[-1][0] == key and runs[-1][2] == i:
            runs[-1] = (key, runs[-1][1], i + 1)
        else:
            runs.append((key, i, i + 1))
    out_grids = tuple(
        Grid(tensors=(start, stop, 1), mesh=key[0], shard=key[1], block=key[2]) for key, start, stop in runs
    )
    locals_: list[LocalTensor] = []
    local_index: dict[str, int] = {}
    out_pieces: list[Piece] = []
    for p in pieces:
        ti = tensor_index(p.tensor)
        li = local_index.get(p.local)
        dtype = p.local_dtype or p.tensor.dtype
        if li is None:
            li = local_index[p.local] = len(locals_)
            locals_.append(LocalTensor(p.local, tuple(p.local_shape), dtype))
        elif locals_[li].shape != tuple(p.local_shape) or locals_[li].dtype != dtype:
            old = locals_[li]
            raise ValueError(
                f"rank {rank}: local tensor {p.local!r} described as {list(old.shape)} {old.dtype} "
                f"and as {list(p.local_shape)} {dtype} (for {p.tensor.name!r})"
            )
        out_pieces.append(Piece(ti, p.box, li, tuple(p.offset) or (0,) * len(p.local_shape), tuple(p.dims)))
    return Layout(rank=rank, tensors=tuple(table), locals=tuple(locals_), pieces=tuple(out_pieces), grids=out_grids)
