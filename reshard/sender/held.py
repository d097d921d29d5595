"""What a rank holds of a parameter when it holds no DTensor: boxes, each
with the local tensor that is it.

The readers of trainers that shard by flattened elements (DeepSpeed ZeRO-3,
FSDP1's flat parameters) turn a rank's flat range of a parameter into
boxes (:func:`reshard.plan.flat.flat_range_boxes`), each a contiguous slice
of the rank's 1-dim storage, viewed in the box's shape: no copy and no
gather. :func:`held_pieces` names them in checkpoint names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reshard.models.names import CheckpointNames
from reshard.plan.box import Box
from reshard.plan.flat import flat_range_boxes
from reshard.plan.specs import PieceSpec
from reshard.sender.pieces import checkpoint_pieces

if TYPE_CHECKING:
    import torch

__all__ = ["Held", "flat_held", "held_pieces"]


@dataclass(frozen=True, slots=True)
class Held:
    """Box ``box`` of model parameter ``name`` (global shape ``shape``) is
    ``tensor``, a view of the trainer's own storage of shape ``box.sizes``."""

    name: str
    shape: tuple[int, ...]
    box: Box
    tensor: torch.Tensor


def flat_held(
    name: str, shape: tuple[int, ...], flat: torch.Tensor, start: int, stop: int, *, slab: Box | None = None
) -> list[Held]:
    """The boxes of parameter ``name`` (of ``shape``) that a rank holding the
    row-major flat range ``[start, stop)`` holds, as views of ``flat`` (its
    1-dim storage of that range). With ``slab``, the range is one of the
    tensor ``slab.sizes`` that is box ``slab`` of the parameter (the experts
    of one expert-parallel rank), and the boxes are moved into place."""
    if flat.dim() != 1 or flat.numel() != stop - start:
        raise ValueError(
            f"{name!r}: flat range [{start}, {stop}) needs a 1-dim tensor of {stop - start} elements, "
            f"got shape {list(flat.shape)}"
        )
    out = []
    for box, at in flat_range_boxes(shape if slab is None else slab.sizes, start, stop):
        view = flat.narrow(0, at, box.numel).view(box.sizes)
        if slab is not None:
            box = Box(tuple(o + b for o, b in zip(slab.offsets, box.offsets, strict=True)), box.sizes)
        out.append(Held(name, shape, box, view))
    return out


def held_pieces(
    held: Iterable[Held],
    *,
    names: CheckpointNames,
    rename: Callable[[str], str | None] | None,
    rank: int,
) -> tuple[list[PieceSpec], dict[str, torch.Tensor]]:
    """(pieces, local tensors) of held boxes, in checkpoint names. Each box is
    a local tensor of its own, named ``<checkpoint name><box>``."""
    pieces: list[PieceSpec] = []
    local: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    for h in held:
        cname = rename(h.name) if rename is not None else h.name
        if cname is None:
            continue
        if tuple(h.tensor.shape) != h.box.sizes:
            raise ValueError(f"rank {rank}: {h.name!r}: a local tensor of shape {list(h.tensor.shape)} for box {h.box}")
        first = source.setdefault(cname, h.name)
        lname = f"{cname}{h.box}"
        if first != h.name or lname in local:
            raise ValueError(
                f"rank {rank}: {first!r} and {h.name!r} both map to the checkpoint name {cname!r}"
                + (f" (box {h.box})" if first == h.name else "")
                + "; pass a rename function that keeps one"
            )
        dtype = str(h.tensor.dtype).removeprefix("torch.")
        local[lname] = h.tensor
        pieces += checkpoint_pieces(names.split(cname, h.shape), dtype, h.box, lname)
    return pieces, local
