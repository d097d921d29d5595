"""Local tensors checked against the layout a rank published for them.

Run by each rank at every refit, before the plan is agreed, so a problem
reaches every rank of the refit before any byte moves (see
:meth:`reshard.transport.session.RefitSession`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from reshard.errors import Problem
from reshard.plan.layout import GridInfo, Layout, TensorMeta, cast_ok, grid_box

__all__ = ["check_locals", "dtype_name"]


def dtype_name(t: Any) -> str:
    """``torch.bfloat16`` -> ``bfloat16`` (the dtype names layouts use)."""
    return str(t.dtype).removeprefix("torch.")


def check_locals(layout: Layout, tensors: Mapping[str, Any], *, role: str) -> list[Problem]:
    """What is wrong with the local tensors a rank gives for its ``layout``.

    Every local tensor the layout names must exist with its shape, be
    contiguous in memory (bytes are read and written in place) and have the
    dtype its pieces say: a source local the canonical dtype of every tensor
    stored in it, a destination local one that dtype casts to
    (:func:`reshard.plan.layout.cast_ok`). ``role``: ``source`` or
    ``destination``. Empty when all is well; the session reports these at the
    ``plan`` step, so every rank raises before any byte moves.
    """
    rank = layout.rank
    problems: list[Problem] = []

    def bad(name: str, tensor: str, text: str) -> None:
        problems.append(
            Problem(
                kind="local", tensor=tensor, ranks=(rank,), message=f"{role} rank {rank}: local tensor {name!r} {text}"
            )
        )

    def check(name: str, shape: tuple[int, ...], dtype: str, metas: Iterable[TensorMeta]) -> None:
        metas = list(metas)
        first = metas[0].name if metas else ""
        t = tensors.get(name)
        if t is None:
            bad(name, first, f"(for {first!r}) is named by the layout but not given")
            return
        if tuple(t.shape) != tuple(shape):
            bad(name, first, f"has shape {list(t.shape)}, its layout says {list(shape)} (for {first!r})")
            return
        have = dtype_name(t)
        if dtype and have != dtype:
            bad(name, first, f"is {have}, its layout says {dtype} (for {first!r})")
            return
        for meta in metas:
            ok = have == meta.dtype if role == "source" else cast_ok(meta.dtype, have)
            if not ok:
                need = "must have its dtype" if role == "source" else "cannot receive it by a cast"
                bad(name, meta.name, f"is {have} but holds {meta.name!r} of dtype {meta.dtype} ({need})")
                return
        if t.numel() and not t.is_contiguous():
            bad(
                name,
                first,
                f"of shape {list(t.shape)} (for {first!r}) is not contiguous in memory; reshard reads "
                "and writes local tensors in place",
            )

    by_local: dict[int, list[TensorMeta]] = {}
    for p in layout.pieces:
        if 0 <= p.local < len(layout.locals) and 0 <= p.tensor < len(layout.tensors):
            by_local.setdefault(p.local, []).append(layout.tensors[p.tensor])
    for i, loc in enumerate(layout.locals):
        held = _unique(by_local.get(i, ()))
        kinds = sorted({m.dtype for m in held})
        if not loc.dtype and len(kinds) > 1:
            # Its dtype would be "its tensors' dtype": ambiguous. The planner
            # needs it to decide what lands in place and what is cast.
            names = ", ".join(repr(m.name) for m in held[:3]) + (" ..." if len(held) > 3 else "")
            bad(
                loc.name,
                held[0].name,
                f"holds tensors of dtypes {' and '.join(kinds)} ({names}) without naming its own dtype "
                "(LocalTensor.dtype); a local holds one dtype",
            )
            continue
        check(loc.name, loc.shape, loc.dtype, held)
    for g in layout.grids:
        info = GridInfo(g)
        coords = info.coord_of.get(rank, ())
        metas = layout.tensors[slice(*g.tensors)]
        if g.local is not None:
            if coords:
                check(g.local.name, g.local.shape, g.local.dtype, _unique(metas))
            continue
        for meta in metas:
            for c in coords:
                box = grid_box(g, meta.shape, c)
                if box.numel:
                    check(meta.name, box.sizes, meta.dtype, (meta,))
    return problems


def _unique(metas: Iterable[TensorMeta]) -> list[TensorMeta]:
    seen: dict[str, TensorMeta] = {}
    for m in metas:
        seen.setdefault(m.dtype, m)
    return list(seen.values())
