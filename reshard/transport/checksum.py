"""Checksums of messages (``GroupConfig.checksums``): taken by the sender from
the bytes it posts, checked by the receiver before it unpacks anything."""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["checksum"]

_FLETCHER_CHUNK = 1 << 24


def checksum(buf: torch.Tensor, backend: str) -> torch.Tensor:
    """Checksum of a message (a 1-D uint8 tensor): two int64.

    gloo (host memory): ``[CRC-32, length]``. NCCL (device memory): a
    Fletcher-style pair ``[sum w_i, sum i * w_i]`` over 32-bit words ``w_i``
    (then the tail bytes) with 64-bit wraparound, which is independent of
    the order of the reduction, so both sides agree; it catches any change
    of one word and any swap of two different words.
    """
    import torch

    n = buf.numel()
    if backend != "nccl":
        host = buf.detach().cpu() if buf.device.type != "cpu" else buf.detach()
        return torch.tensor([zlib.crc32(host.numpy().data), n], dtype=torch.int64)  # host: gloo's checksum
    b = buf.detach()
    head = n - n % 4
    if b.data_ptr() % 4:
        b = b.clone()
    a = torch.zeros((), dtype=torch.int64, device=b.device)
    w = torch.zeros((), dtype=torch.int64, device=b.device)
    words = b[:head].view(torch.int32)
    for start in range(0, words.numel(), _FLETCHER_CHUNK):
        x = words[start : start + _FLETCHER_CHUNK].to(torch.int64)
        idx = torch.arange(start + 1, start + 1 + x.numel(), dtype=torch.int64, device=b.device)
        a += x.sum()
        w += (x * idx).sum()
    if head < n:
        x = b[head:].to(torch.int64)
        idx = torch.arange(head + 1, n + 1, dtype=torch.int64, device=b.device)
        a += x.sum()
        w += (x * idx).sum()
    return torch.stack([a, w])
