"""Exact sparse encodings of one transfer's new values against a base (delta refits).

The sender compares a part's new values, bit for bit, with the values it
sent last time (its snapshot) and writes the smallest of four exact
encodings; the receiver applies it onto its base, the same values. What the
encodings are, their sections, sizes and the choice between them is the
wire format, :mod:`reshard.plan.delta_format`; this module only computes
and applies them. Comparison is on bit patterns (``-0.0`` differs from
``0.0``, NaNs compare by payload), so a patched base is bit-identical to the
new values.

On CPU the work runs in numpy on integer views (comparison, ``flatnonzero``,
``packbits``), or compiled (:mod:`reshard.transport.encoding_jit`) where
numba is installed; elsewhere (CUDA) in torch, with the same bytes.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from reshard.plan.delta_format import (
    BITMASK,
    BLOCK,
    BLOCK_SHIFT,
    DENSE,
    NAMES,
    SAME,
    SPARSE,
    Sections,
    Speeds,
    blocks,
    choose,
    mask_bytes,
    part_size,
    sections,
)

if TYPE_CHECKING:
    import torch

__all__ = ["apply_part", "encode_part"]

_INT_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64", 16: "int64"}


# -- bit views -------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous, 1-D) as integers of its element size: ``(n,)``, or
    ``(n, 2)`` int64 for 16-byte elements."""
    import torch

    size = t.element_size()
    v = t.view(getattr(torch, _INT_OF_SIZE[size]))
    return v.view(-1, 2) if size == 16 else v


def _np(t: torch.Tensor) -> Any:
    return t.numpy()


# -- encode (sender) -------------------------------------------------------------------


def encode_part(
    new: torch.Tensor, snap: torch.Tensor, out: torch.Tensor, speeds: Speeds | None = None, *, dense: bool = False
) -> tuple[int, int, int]:
    """Encode ``new`` against ``snap`` into ``out`` and make ``snap`` equal ``new``.

    ``new`` and ``snap``: tensors of the wire dtype, ``n`` elements each,
    ``snap`` contiguous and 1-D, ``new`` too or 2-D with contiguous rows (the
    part in row-major order: rows of a larger tensor, read in place by the
    compiled path, gathered first by the others); ``out``: a uint8 tensor of at least
    ``delta_format.part_size(DENSE, n, 0, e)`` bytes. The encoding is
    ``delta_format.choose(n, k, e, speeds)``; a ``dense`` part is not
    written to ``out`` (its bytes are the snapshot's, afterwards).
    ``dense``: the part goes ``dense`` if anything changed, whatever the
    count (the sender predicted it would; changes are only counted).
    Returns ``(encoding, k, the part's bytes)``."""
    n = new.numel()
    if snap.numel() != n or snap.dtype != new.dtype:
        raise ValueError(f"snapshot of {snap.numel()} {snap.dtype} for {n} {new.dtype} values")
    e = new.element_size()
    if new.dim() != 1 and not _rows_in_place(new):
        new = new.contiguous().view(-1)
    if dense:
        return _count_copy(new, snap, out, n, e)
    if new.device.type == "cpu":
        return _encode_np(new, snap, out, n, e, speeds)
    return _encode_torch(new, snap, out, n, e, speeds)


def _rows_in_place(new: torch.Tensor) -> bool:
    """Whether the compiled path reads ``new`` (2-D, contiguous rows) as it is."""
    if new.device.type != "cpu" or new.dim() != 2 or new.stride(1) != 1 or new.element_size() == 16:
        return False
    if os.environ.get("RESHARD_NUMBA", "1") == "0":
        return False
    from reshard.transport import encoding_jit

    return encoding_jit.available()


def _count_copy(new: torch.Tensor, snap: torch.Tensor, out: torch.Tensor, n: int, e: int) -> tuple[int, int, int]:
    """A part sent ``dense`` whatever changed: count the changes, copy the values."""
    if new.device.type == "cpu":
        a, b = _np(_bits(new)), _np(_bits(snap))
        if os.environ.get("RESHARD_NUMBA", "1") != "0":
            from reshard.transport import encoding_jit

            done = encoding_jit.encode(a, b, _np(out), n, e, dense=True) if encoding_jit.available() else None
            if done is not None:
                return done
        new = new.contiguous().view(-1)
        k = _count_np(_np(_bits(new)), b)
    else:
        m = _bits(new) != _bits(snap)
        k = int((m.any(dim=1) if m.dim() == 2 else m).sum())
    snap.copy_(new)
    enc = DENSE if k else SAME
    return enc, k, part_size(enc, n, k, e)


def _encode_np(
    new: torch.Tensor,
    snap: torch.Tensor,
    out: torch.Tensor,
    n: int,
    e: int,
    speeds: Speeds | None = None,
    *,
    jit: bool = True,
) -> tuple[int, int, int]:
    import numpy as np

    a, b = _np(_bits(new)), _np(_bits(snap))
    if jit:
        from reshard.transport import encoding_jit

        done = encoding_jit.encode(a, b, _np(out), n, e, speeds) if encoding_jit.available() else None
        if done is not None:
            return done
    if new.dim() == 2 and e != 16:  # rows the compiled path did not take
        a = _np(_bits(new.contiguous().view(-1)))
    idx, vals, k = _changed_np(a, b, n, e, speeds)
    enc = DENSE if idx is None else choose(n, k, e, speeds)
    sec = sections(enc, n, k, e)
    if enc in (SAME, DENSE):
        return enc, k, sec.size
    o = _np(out[: sec.size])
    assert idx is not None and vals is not None
    o[: sec.values] = vals.reshape(-1).view(np.uint8)
    if enc == SPARSE:
        nb = blocks(n)
        counts = np.bincount(idx >> BLOCK_SHIFT, minlength=nb).astype(np.int32)
        o[sec.counts : sec.counts + 4 * nb] = counts.view(np.uint8)
        o[sec.positions : sec.positions + 2 * k] = idx.astype(np.uint16).view(np.uint8)
    else:
        _expect(enc, BITMASK)
        m = np.zeros(n, dtype=bool)
        m[idx] = True
        bits = np.packbits(m, bitorder="little")
        o[sec.positions : sec.positions + bits.size] = bits
    return enc, k, sec.size


_CHUNK = 1 << 16
"""Words compared per step: the chunk stays in cache while its few changed
words are looked at element by element, their values read and the snapshot
written."""


def _changed_np(a: Any, b: Any, n: int, e: int, speeds: Speeds | None = None) -> tuple[Any, Any, int]:
    """Compare new values ``a`` with the snapshot ``b`` (integer views) and make
    ``b`` equal ``a``. Returns ``(positions, values, k)`` of the ``k`` elements
    whose bits differed (sorted int64, and their new values); or ``(None,
    None, k)`` as soon as so many 8-byte words differ that ``dense`` is the
    choice whatever their count.

    Elements narrower than 8 bytes are compared a word (8 bytes) at a time,
    chunk by chunk, and only the words that differ are split into elements
    (an XOR, then the lanes that are not zero), while the chunk is still in
    cache: at the densities of a training step most words are equal, and
    what costs is finding the few that are not (``flatnonzero`` scans every
    flag) and touching them a second time after they left the cache."""
    import numpy as np

    if e == 16:
        idx = np.flatnonzero((a != b).any(axis=1))
        vals = a[idx]
        b[idx] = vals
        return idx, vals, int(idx.size)
    lanes = 8 // e
    full = n - n % lanes
    words_a = a[:full].view(np.int64) if lanes > 1 else a
    words_b = b[:full].view(np.int64) if lanes > 1 else b
    lane = np.dtype(f"u{e}")
    nw = words_a.shape[0]
    mask = np.empty(min(nw, _CHUNK), dtype=bool)
    found: list = []
    values: list = []
    k = changed_words = 0
    for s in range(0, nw, _CHUNK):
        xa, xb = words_a[s : s + _CHUNK], words_b[s : s + _CHUNK]
        m = mask[: xa.shape[0]]
        np.not_equal(xa, xb, out=m)
        w = np.flatnonzero(m)
        if not w.size:
            continue
        changed_words += w.size
        if lanes == 1:
            el = w
        else:
            f = np.flatnonzero((xa[w] ^ xb[w]).view(lane) != 0)
            el = w[f // lanes] * lanes + f % lanes
        ea, eb = a[s * lanes : (s + _CHUNK) * lanes], b[s * lanes : (s + _CHUNK) * lanes]
        v = ea[el]
        eb[el] = v
        found.append(el + s * lanes)
        values.append(v)
        k += el.size
        if choose(n, changed_words, e, speeds) == DENSE:
            # Dense whatever the rest holds: count it, copy it all.
            rest = min((s + _CHUNK) * lanes, full)
            k += _count_np(a[rest:], b[rest:])
            b[rest:] = a[rest:]
            return None, None, k
    if full < n:
        tail = np.flatnonzero(a[full:] != b[full:]) + full
        if tail.size:
            v = a[tail]
            b[tail] = v
            found.append(tail)
            values.append(v)
            k += tail.size
    if not found:
        return np.empty(0, dtype=np.int64), a[:0], 0
    return np.concatenate(found), np.concatenate(values), k


def _count_np(a: Any, b: Any) -> int:
    """How many elements differ (``a``, ``b``: integer views, ``(n,)`` or ``(n, 2)``)."""
    import numpy as np

    n = a.shape[0]
    total = 0
    mask = np.empty(min(n, _CHUNK), dtype=bool)
    for s in range(0, n, _CHUNK):
        x, y = a[s : s + _CHUNK], b[s : s + _CHUNK]
        if x.ndim == 2:
            total += int(np.count_nonzero((x != y).any(axis=1)))
            continue
        m = mask[: x.shape[0]]
        np.not_equal(x, y, out=m)
        total += int(np.count_nonzero(m))
    return total


def _encode_torch(
    new: torch.Tensor, snap: torch.Tensor, out: torch.Tensor, n: int, e: int, speeds: Speeds | None = None
) -> tuple[int, int, int]:
    import torch

    a, b = _bits(new), _bits(snap)
    m = a != b
    if m.dim() == 2:
        m = m.any(dim=1)
    k = int(m.sum())
    enc = choose(n, k, e, speeds)
    sec = sections(enc, n, k, e)
    if enc == SAME:
        return enc, k, 0
    if enc == DENSE:
        snap.copy_(new)
        return enc, k, sec.size
    idx = m.nonzero().flatten()
    vals = a[idx]
    out[: sec.values].copy_(vals.contiguous().view(-1).view(torch.uint8))
    b[idx] = vals
    if enc == SPARSE:
        nb = blocks(n)
        counts = torch.bincount(idx >> BLOCK_SHIFT, minlength=nb).to(torch.int32)
        out[sec.counts : sec.counts + 4 * nb].copy_(counts.view(torch.uint8))
        # The offset in its block (0..BLOCK - 1) as the int16 of the same bits.
        half = BLOCK >> 1
        low = (((idx & (BLOCK - 1)) ^ half) - half).to(torch.int16)
        out[sec.positions : sec.positions + 2 * k].copy_(low.view(torch.uint8))
    else:
        _expect(enc, BITMASK)
        bits = _packbits(m)
        out[sec.positions : sec.positions + bits.numel()].copy_(bits)
    return enc, k, sec.size


def _expect(enc: int, code: int) -> None:
    """The last branch of a dispatch on encodings handles ``code``: a code
    it does not know (one added to the format without its encoder) is
    refused, never written as ``code``."""
    if enc != code:
        name = NAMES[enc] if 0 <= enc < len(NAMES) else "unknown"
        raise ValueError(f"no encoder for delta encoding {enc} ({name})")


def _packbits(m: torch.Tensor) -> torch.Tensor:
    """``numpy.packbits(m, bitorder="little")`` in torch."""
    import torch

    n = m.numel()
    padded = torch.zeros(mask_bytes(n) * 8, dtype=torch.uint8, device=m.device)
    padded[:n] = m
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int32, device=m.device)
    return (padded.view(-1, 8).to(torch.int32) * weights).sum(dim=1).to(torch.uint8)


def _unpackbits(bits: torch.Tensor, n: int) -> torch.Tensor:
    import torch

    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((bits.unsqueeze(1) >> shifts) & 1).view(-1)[:n].bool()


# -- apply (receiver) ---------------------------------------------------------------------


def apply_part(enc: int, k: int, part: torch.Tensor, dst: torch.Tensor) -> None:
    """Apply a part (``part``: its bytes) onto ``dst``, the base values it was
    made against: a view of the wire dtype in the transfer's element order
    (the box's shape, possibly strided). Raises ``ValueError`` for a part
    that cannot be the sender's (positions outside the box, counts that do
    not add up), before writing anything."""
    import torch

    n = dst.numel()
    e = dst.element_size()
    # A dense part may say 0 changed: sent before its changes were counted.
    counted = (enc == SAME) == (k == 0) or enc == DENSE
    if not 0 <= k <= n or enc not in (SAME, DENSE, SPARSE, BITMASK) or not counted:
        raise ValueError(f"a part of {n} elements says encoding {enc} with {k} changed")
    size = part_size(enc, n, k, e)
    if part.numel() != size:
        raise ValueError(f"a {NAMES[enc]} part of {n} elements ({k} changed) is {part.numel()} bytes, not {size}")
    if enc == SAME:
        return
    if part.device != dst.device:  # a part received on the GPU for a base kept in host memory, say
        part = part.to(dst.device)
    if enc == DENSE:
        dst.copy_(part[: n * e].view(dst.dtype).view(dst.shape))
        return
    if dst.device.type == "cpu" and dst.is_contiguous() and e != 16 and os.environ.get("RESHARD_NUMBA", "1") != "0":
        from reshard.transport import encoding_jit

        if encoding_jit.available() and encoding_jit.apply(enc, k, _np(part), _np(_bits(dst.view(-1))), n, e):
            return
    sec = sections(enc, n, k, e)
    vals = part[: sec.values].view(dst.dtype)
    if dst.device.type == "cpu":
        idx = _positions_np(enc, n, k, part, sec)
        idx_t = torch.from_numpy(idx)  # host: the numpy path
    else:
        idx_t = _positions_torch(enc, n, k, part, sec)
    if e == 16:  # complex128: no integer of its size; its copies are bitwise anyway
        target, ivals = dst, vals
    else:
        target, ivals = dst.view(_bits(vals).dtype), _bits(vals)
    if dst.is_contiguous():
        flat = target.view(-1)
        if dst.device.type == "cpu":
            _np(flat)[idx_t.numpy()] = _np(ivals)
        else:
            flat[idx_t] = ivals
        return
    target[torch.unravel_index(idx_t, tuple(dst.shape))] = ivals


def _positions_np(enc: int, n: int, k: int, part: torch.Tensor, sec: Sections) -> Any:
    import numpy as np

    raw = _np(part)
    if enc == SPARSE:
        nb = blocks(n)
        counts = raw[sec.counts : sec.counts + 4 * nb].view(np.int32)
        low = raw[sec.positions : sec.positions + 2 * k].view(np.uint16)
        if counts.min(initial=0) < 0 or int(counts.sum(dtype=np.int64)) != k:
            raise ValueError(f"a sparse part of {n} elements has block counts that do not add up to {k}")
        idx = np.repeat(np.arange(nb, dtype=np.int64) << BLOCK_SHIFT, counts) + low
        if k and int(idx.max()) >= n:
            raise ValueError(f"a sparse part of {n} elements names position {int(idx.max())}")
        return idx
    _expect(enc, BITMASK)
    m = np.unpackbits(raw[sec.positions : sec.positions + mask_bytes(n)], count=n, bitorder="little").view(bool)
    idx = np.flatnonzero(m)
    if idx.size != k:
        raise ValueError(f"a bitmask part of {n} elements has {idx.size} bits set, its header says {k}")
    return idx


def _positions_torch(enc: int, n: int, k: int, part: torch.Tensor, sec: Sections) -> torch.Tensor:
    import torch

    dev = part.device
    if enc == SPARSE:
        nb = blocks(n)
        counts = part[sec.counts : sec.counts + 4 * nb].view(torch.int32).to(torch.int64)
        low = part[sec.positions : sec.positions + 2 * k].view(torch.int16).to(torch.int64) & (BLOCK - 1)
        if int(counts.min()) < 0 or int(counts.sum()) != k:
            raise ValueError(f"a sparse part of {n} elements has block counts that do not add up to {k}")
        base = torch.repeat_interleave(torch.arange(nb, dtype=torch.int64, device=dev) << BLOCK_SHIFT, counts)
        idx = base + low
        if k and int(idx.max()) >= n:
            raise ValueError(f"a sparse part of {n} elements names position {int(idx.max())}")
        return idx
    _expect(enc, BITMASK)
    m = _unpackbits(part[sec.positions : sec.positions + mask_bytes(n)], n)
    idx = m.nonzero().flatten()
    if idx.numel() != k:
        raise ValueError(f"a bitmask part of {n} elements has {idx.numel()} bits set, its header says {k}")
    return idx
