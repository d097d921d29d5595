"""Small tensors made whole on every trainer rank (a PEFT policy's LoRA
factors, :mod:`reshard.sender.peft`): each rank contributes the boxes it
holds, over the trainer's default process group.

One call is collective: every trainer rank calls it at the same point (a
read of the policy), whatever it holds. Ranks need not know the same
tensors: under FSDP1 or ZeRO-3 a rank may hold nothing of some factor, so
each rank's boxes travel with their names, shapes and dtypes (msgspec, no
pickle), and every rank rebuilds the union. Where every rank holds every
tensor whole (DDP, replicas), nothing moves beyond one all-reduce that says
so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec

from reshard.plan.box import Box

if TYPE_CHECKING:
    import torch

__all__ = ["gather_whole"]


class _Part(msgspec.Struct, array_like=True, frozen=True):
    name: str
    shape: tuple[int, ...]
    dtype: str
    box: Box
    at: int
    """Offset of the box's bytes in its rank's payload."""
    nbytes: int


def gather_whole(
    parts: Mapping[str, list[tuple[Box, torch.Tensor]]],
    shapes: Mapping[str, tuple[tuple[int, ...], str]],
    *,
    device: torch.device | str = "cpu",
) -> tuple[dict[str, torch.Tensor], int]:
    """Every tensor any rank holds a box of, whole on this rank (zero where
    no rank holds it), on ``device`` (where they are used: beside the
    trainer's weights they are merged into), and the bytes this rank
    received for them. ``parts``: per tensor name, the boxes this rank
    holds and their values; ``shapes``: the global shape and dtype of every
    tensor named there."""
    out, received = _gather_whole(parts, shapes)
    return {n: t.to(device) for n, t in out.items()}, received


def _gather_whole(
    parts: Mapping[str, list[tuple[Box, torch.Tensor]]], shapes: Mapping[str, tuple[tuple[int, ...], str]]
) -> tuple[dict[str, torch.Tensor], int]:
    """:func:`gather_whole`, assembled in host memory."""
    import torch
    import torch.distributed as dist

    held_whole = all(
        any(box.sizes == shapes[n][0] for box, _ in parts.get(n, ())) or _numel(shapes[n][0]) == 0 for n in shapes
    )
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return _assemble(parts, shapes), 0
    device = _device()
    # Whole everywhere only if every rank holds whole every tensor any rank knows.
    flags = torch.tensor([1 if held_whole else 0, len(shapes), -len(shapes)], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if int(flags[0]) == 1 and int(flags[1]) == -int(flags[2]):
        return _assemble(parts, shapes), 0
    rows: list[_Part] = []
    chunks: list[torch.Tensor] = []
    at = 0
    for n in sorted(parts):
        shape, dtype = shapes[n]
        for box, t in parts[n]:
            data = t.detach().contiguous().view(-1).view(torch.uint8).cpu()
            rows.append(_Part(n, tuple(shape), dtype, box, at, data.numel()))
            chunks.append(data)
            at += data.numel()
    header = torch.frombuffer(bytearray(msgspec.msgpack.encode(rows)), dtype=torch.uint8)  # host: moved to send
    payload = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)  # host: moved to send
    world = dist.get_world_size()
    sizes = torch.tensor([header.numel(), payload.numel()], dtype=torch.int64, device=device)
    all_sizes = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(all_sizes, sizes)
    width = [max(int(s[i]) for s in all_sizes) for i in (0, 1)]
    headers = _all_gather_padded(header, width[0], world, device)
    payloads = _all_gather_padded(payload, width[1], world, device)
    me = dist.get_rank()
    out: dict[str, torch.Tensor] = {}
    received = 0
    for r, (h, p, s) in enumerate(zip(headers, payloads, all_sizes, strict=True)):
        for part in msgspec.msgpack.decode(h[: int(s[0])].cpu().numpy().tobytes(), type=list[_Part]):
            full = out.get(part.name)
            if full is None:
                full = out[part.name] = torch.zeros(part.shape, dtype=getattr(torch, part.dtype))  # host: assembled
            vals = p[part.at : part.at + part.nbytes].cpu().view(full.dtype).view(part.box.sizes)
            full[tuple(slice(o, o + z) for o, z in zip(part.box.offsets, part.box.sizes, strict=True))] = vals
            if r != me:
                received += part.nbytes
    return out, received


def _assemble(
    parts: Mapping[str, list[tuple[Box, torch.Tensor]]], shapes: Mapping[str, tuple[tuple[int, ...], str]]
) -> dict[str, torch.Tensor]:
    import torch

    out = {}
    for n, (shape, dtype) in shapes.items():
        full = torch.zeros(shape, dtype=getattr(torch, dtype))  # host: assembled, moved by gather_whole
        for box, t in parts.get(n, ()):
            full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))] = t.detach().cpu()
        out[n] = full
    return out


def _all_gather_padded(t: torch.Tensor, width: int, world: int, device: torch.device) -> list[torch.Tensor]:
    import torch
    import torch.distributed as dist

    padded = torch.zeros(max(width, 1), dtype=torch.uint8, device=device)
    padded[: t.numel()] = t.to(device)
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _device() -> torch.device:
    """Where the default group's collectives take tensors."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
