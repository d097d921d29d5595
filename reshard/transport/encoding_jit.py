"""A compiled CPU path for :func:`reshard.transport.encoding.encode_part`
and ``apply_part``,
used where numba is installed (vLLM's CPU build brings it; ``RESHARD_NUMBA=0``
turns it off). It writes exactly the bytes of the numpy path (the tests
compare them), in one pass over the data instead of a dozen vectorized
ones: on CPU a delta is bound by reading the new values and the snapshot,
and numpy spends as long again finding the few elements that changed.

One pass compares 4 words of 8 bytes at a time (elements one by one at
the tail and inside the words that differ), brings the snapshot up to date,
and records each changed element as the encoding its count will end in
needs: value and 16-bit offset while ``sparse`` is the choice, value and
flag bit once it is ``bitmask``, nothing once it is ``dense`` (from then on
the words are only counted, a word at a time, and copied). The points
where the choice changes come from
:func:`reshard.plan.delta_format.dense_from`, with the sender's measured
speeds, so a part that will go dense costs a counting copy, not the
gathering of values nobody will read.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from reshard.plan.delta_format import (
    BITMASK,
    BLOCK,
    BLOCK_SHIFT,
    DENSE,
    SAME,
    SPARSE,
    Speeds,
    blocks,
    choose,
    dense_from,
    mask_bytes,
    sections,
)

__all__ = ["available", "encode"]


class _State:
    """The process's compiled kernels and buffers (built on first use)."""

    lock = threading.Lock()
    kernels: Any = None
    failed = False
    scratch: Any = None
    popcount: Any = None
    warm: set = set()
    """Element dtypes every kernel is compiled for."""


_S = _State()


def available() -> bool:
    """Whether the compiled path is on (numba importable, not switched off)."""
    return os.environ.get("RESHARD_NUMBA", "1") != "0" and _compiled() is not None


def _compiled() -> Any:
    if _S.kernels is not None or _S.failed:
        return _S.kernels
    with _S.lock:
        if _S.kernels is None and not _S.failed:
            try:
                _S.kernels = _build()
            except Exception:  # numba missing or broken: the numpy path stays
                _S.failed = True
    return _S.kernels


def _build() -> Any:
    import numba

    jit = numba.njit(cache=True, nogil=True)

    @jit
    def _to_bits(low, counts, bits, k):
        # From offsets to bits: the k offsets recorded so far (sorted, block
        # by block) set their bits in a cleared mask.
        bits[:] = 0
        p = 0
        for blk in range(counts.shape[0]):
            for _ in range(counts[blk]):
                if p >= k:
                    return 1
                i = (blk << BLOCK_SHIFT) + numba.int64(low[p])
                bits[i >> 3] |= numba.uint8(1) << numba.uint8(i & 7)
                p += 1
        return 1

    @jit
    def lanes_set(d, lane_bits, low_bits):
        # How many lanes (elements) of word d are not zero, without a branch:
        # the high bit of each lane is set when the lane is not zero (adding
        # the low bits' all-ones carries into it), those bits are moved to
        # each lane's lowest bit and summed by one multiplication.
        high = low_bits << numba.uint64(lane_bits - 1)
        rest = ~high
        y = (((d & rest) + rest) | d) & high
        return numba.int64(((y >> numba.uint64(lane_bits - 1)) * low_bits) >> numba.uint64(64 - lane_bits))

    @jit
    def record(i, k, mode, a_i, vals, low, counts, bits, to_bits, to_dense):
        # Element i (value a_i) changed: record it as the mode says, count it,
        # and switch modes as the count passes the points where the choice changes.
        if mode == 0:
            vals[k] = a_i
            low[k] = numba.uint16(i & (BLOCK - 1))
            counts[i >> BLOCK_SHIFT] += 1
        elif mode == 1:
            vals[k] = a_i
            bits[i >> 3] |= numba.uint8(1) << numba.uint8(i & 7)
        k += 1
        if k == to_dense:
            mode = 2
        elif mode == 0 and k == to_bits:
            mode = _to_bits(low, counts, bits, k)
        return k, mode

    @jit
    def row(aw, bw, a, b, at, k, mode, lanes, lane_bits, vals, low, counts, bits, to_bits, to_dense):
        # One contiguous run of the part (its elements at..at+len(a)), as
        # words aw/bw and as elements a/b (the words cover a's front).
        nw = aw.shape[0]
        mask = (numba.uint64(1) << numba.uint64(lane_bits)) - numba.uint64(1) if lane_bits < 64 else ~numba.uint64(0)
        low_bits = numba.uint64(0)
        for j in range(lanes):
            low_bits |= numba.uint64(1) << numba.uint64(j * lane_bits)
        w = 0
        while w < nw and mode != 2:
            end = min(w + 4, nw)
            acc = numba.uint64(0)
            for v in range(w, end):
                acc |= numba.uint64(aw[v] ^ bw[v])
            if acc == 0:
                w = end
                continue
            for v in range(w, end):
                d = numba.uint64(aw[v] ^ bw[v])
                if d == 0:
                    continue
                if mode == 2:
                    k += lanes_set(d, lane_bits, low_bits)
                else:
                    for j in range(lanes):
                        if (d >> numba.uint64(j * lane_bits)) & mask:
                            i = v * lanes + j
                            k, mode = record(at + i, k, mode, a[i], vals, low, counts, bits, to_bits, to_dense)
                bw[v] = aw[v]
            w = end
        for v in range(w, nw):  # mode 2: counted and copied only, without a branch
            k += lanes_set(numba.uint64(aw[v] ^ bw[v]), lane_bits, low_bits)
            bw[v] = aw[v]
        for i in range(nw * lanes, a.shape[0]):
            if a[i] != b[i]:
                k, mode = record(at + i, k, mode, a[i], vals, low, counts, bits, to_bits, to_dense)
                b[i] = a[i]
        return k, mode

    # Explicit signatures (compiled once, when the kernels are built, not
    # halfway through a refit) on C-contiguous arrays: the compiler then knows
    # that the words of a row are adjacent (on arrays of any layout the same
    # code took half again as long per pass, twice as long on rows of a
    # larger tensor). A part that is rows of a larger tensor comes as the
    # flat span from its first to its last element, with the step between
    # its rows; the snapshot is contiguous, its rows one after another.
    sigs = [
        numba.int64(
            numba.int64[::1],
            numba.int64[::1],
            t[::1],
            t[::1],
            numba.int64,
            numba.int64,
            numba.int64,
            numba.int64,
            numba.int64,
            numba.int64,
            t[:],
            numba.uint16[:],
            numba.int32[:],
            numba.uint8[:],
            numba.int64,
            numba.int64,
            numba.int64,
        )
        for t in (numba.int8, numba.int16, numba.int32, numba.int64)
    ]

    @numba.njit(sigs, cache=True, nogil=True)
    def diff(
        aw, bw, a, b, rows, width, step, lanes, lane_bits, mode, vals, low, counts, bits, to_bits, to_dense, words
    ):
        # One pass over the data, row by row (a part whose new values are rows
        # of a larger tensor is read in place: row r of the new values starts
        # at r * step of the span ``a``, its words at r * step / lanes of
        # ``aw``, the first ``words`` words of each row; the snapshot's rows
        # are contiguous): 4 words (8 bytes each) compared at once, the rare
        # words that differ split into their elements by their XOR, the
        # snapshot word written back. Each changed element is recorded as the
        # encoding it will end in needs, as the count grows past the points
        # where the choice changes (sparse, then bitmask, then dense: the
        # choice only moves that way as changes add up): mode 0 its value, its
        # 16-bit offset and its block's count; mode 1 its value and its bit
        # (the bits of the offsets recorded so far set at the switch); mode 2
        # nothing (a dense part is sent from the snapshot), the rest of the
        # data only counted and copied, a word at a time. Returns the number
        # of changed elements.
        k = 0
        wstep = step // lanes
        for r in range(rows):
            at = r * width
            k, mode = row(
                aw[r * wstep : r * wstep + words],
                bw[r * words : (r + 1) * words],
                a[r * step : r * step + width],
                b[at : at + width],
                at,
                k,
                mode,
                lanes,
                lane_bits,
                vals,
                low,
                counts,
                bits,
                to_bits,
                to_dense,
            )
        return k

    @jit
    def apply_sparse(dst, vals, counts, low, n):
        # Checked first (a part that cannot be its sender's writes nothing):
        # -1, block counts that do not add up; -2 - p, a position p past n.
        total = 0
        for blk in range(counts.shape[0]):
            if counts[blk] < 0:
                return -1
            total += counts[blk]
        if total != low.shape[0]:
            return -1
        k = 0
        for blk in range(counts.shape[0]):
            for _ in range(counts[blk]):
                i = (blk << BLOCK_SHIFT) + low[k]
                if i >= n:
                    return -2 - i
                k += 1
        k = 0
        for blk in range(counts.shape[0]):
            for _ in range(counts[blk]):
                dst[(blk << BLOCK_SHIFT) + low[k]] = vals[k]
                k += 1
        return k

    @jit
    def apply_bitmask(dst, vals, bits, n, popcount):
        # Checked first: -1 - c, c bits set where the header says otherwise
        # (or bits past n).
        k = 0
        for byte in range(bits.shape[0]):
            k += popcount[bits[byte]]
        last = n - (bits.shape[0] - 1) * 8
        if k != vals.shape[0] or (bits.shape[0] and bits[bits.shape[0] - 1] >> last):
            return -1 - k
        k = 0
        for byte in range(bits.shape[0]):
            x = bits[byte]
            if x == 0:
                continue
            base = byte * 8
            for j in range(min(8, n - base)):
                # Branch-free: every element of the byte is written, the
                # changed ones with the next value.
                d = (x >> j) & 1
                v = vals[k] if d else dst[base + j]
                dst[base + j] = v
                k += d
        return k

    return diff, apply_sparse, apply_bitmask


def _warm(dtype: Any) -> bool:
    """Compile every kernel for elements of ``dtype`` on small arrays, so that
    no kernel compiles halfway through a part (numba compiles on first call):
    a failure here leaves the numpy path in charge, before any byte changed."""
    import numpy as np

    if dtype in _S.warm:
        return True
    kernels = _compiled()
    if kernels is None:
        return False
    diff, apply_sparse, apply_bitmask = kernels
    try:
        a = np.zeros(64 // dtype.itemsize, dtype=dtype)
        b, vals = a.copy(), a.copy()
        bits = np.zeros(8, dtype=np.uint8)
        low, counts = np.zeros(a.size, dtype=np.uint16), np.zeros(1, dtype=np.int32)
        lanes = 8 // dtype.itemsize
        words = a.size // lanes
        for mode in (0, 1, 2):
            diff(
                a.view(np.int64), b.view(np.int64), a, b, 1, a.size, a.size, lanes, 8 * dtype.itemsize, mode,
                vals, low, counts, bits, 1, 2, words,
            )  # fmt: skip
        apply_sparse(a, vals[:0], np.zeros(1, dtype=np.int32), np.zeros(0, dtype=np.uint16), a.size)
        popcount = np.zeros(256, dtype=np.int64)
        apply_bitmask(a, vals[:0], bits, a.size, popcount)
    except Exception:  # a numba that cannot compile these: numpy it is
        _S.failed = True
        _S.kernels = None
        return False
    _S.warm.add(dtype)
    return True


def _no_words() -> Any:
    import numpy as np

    return np.zeros(0, dtype=np.int64)


def _scratch(n: int) -> tuple[Any, Any, Any]:
    """Scratch for a part of ``n`` elements: 16-bit offsets (as many as a
    ``sparse`` part may hold), block counts (zeroed) and flag bits (cleared
    by the kernel when it needs them); kept and grown across calls."""
    import numpy as np

    need = (n // 16 + 8) * 2 + 4 * (blocks(n) + 2) + mask_bytes(n) + 64
    if _S.scratch is None or _S.scratch.size < need:
        _S.scratch = np.zeros(max(need, 1 << 16), dtype=np.uint8)
    buf = _S.scratch
    at = 0
    low = buf[at : at + (n // 16 + 8) * 2].view(np.uint16)
    at += -(-low.nbytes // 8) * 8
    counts = buf[at : at + 4 * max(blocks(n), 1)].view(np.int32)
    counts[:] = 0
    at += -(-counts.nbytes // 8) * 8
    bits = buf[at : at + max(mask_bytes(n), 1)]
    return low, counts, bits


def encode(
    a: Any, b: Any, o: Any, n: int, e: int, speeds: Speeds | None = None, *, dense: bool = False
) -> tuple[int, int, int] | None:
    """The compiled ``encode_part`` on CPU:
    ``a``, ``b`` integer views (new values, 1-D or 2-D with contiguous rows;
    snapshot, contiguous), ``o`` the payload's
    bytes (at least a dense part's). A ``dense`` part is not written (the
    snapshot holds its values). ``dense``: the part goes dense if anything
    changed (changes counted and copied only). ``None`` when this path does
    not apply (16-byte elements); the caller takes the numpy path then."""
    import numpy as np

    kernels = _compiled()
    if kernels is None or e == 16 or a.ndim not in (1, 2) or not _warm(a.dtype):
        return None
    diff = kernels[0]
    vals = o[: n * e].view(a.dtype)
    # Rows (one for a contiguous part): the new values may be rows of a larger
    # tensor, read in place as the flat span that holds them; the snapshot is
    # contiguous.
    if a.strides[-1] != e:  # elements not adjacent: read as a copy (only the snapshot is written)
        a = np.ascontiguousarray(a)
    rows, width = (1, a.shape[0]) if a.ndim == 1 else a.shape
    step = a.strides[0] // e if a.ndim == 2 and rows > 1 else width
    span = (rows - 1) * step + width if rows else 0
    a = np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(e,))
    b = b.reshape(-1)
    with _S.lock:  # one scratch per process
        low, counts, bits = _scratch(n)
        lanes = 8 // e
        # Rows that start at whole words go a word at a time (a row's last
        # elements short of a word, and data that does not start at a whole
        # word, element by element: the kernel's tail loop). The rows of the
        # new values and of the snapshot start at whole words when the
        # step and the width are whole words.
        aligned = a.ctypes.data % 8 == 0 and b.ctypes.data % 8 == 0
        if rows > 1 and (step % lanes or width % lanes):
            aligned = False
        words = width // lanes if aligned else 0
        words_a = a[: span - span % lanes].view(np.int64) if aligned else _no_words()
        words_b = b[: n - n % lanes].view(np.int64) if aligned else _no_words()
        to_bits = dense_from(n, e, speeds, (BITMASK, DENSE))
        to_dense = dense_from(n, e, speeds)
        mode = 2 if dense else 0
        k = diff(
            words_a, words_b, a, b, rows, width, step, lanes, 8 * e, mode,
            vals, low, counts, bits, to_bits, to_dense, words,
        )  # fmt: skip
        enc = (DENSE if k else SAME) if dense else choose(n, k, e, speeds)
        sec = sections(enc, n, k, e)
        if enc in (SAME, DENSE):
            return enc, k, sec.size
        if enc == SPARSE:
            nb = blocks(n)
            o[sec.counts : sec.counts + 4 * nb] = counts[:nb].view(np.uint8)
            o[sec.positions : sec.positions + 2 * k] = low[:k].view(np.uint8)
        elif enc == BITMASK:
            o[sec.positions : sec.positions + mask_bytes(n)] = bits[: mask_bytes(n)]
        else:
            raise ValueError(f"no compiled encoder for delta encoding {enc}")
        return enc, k, sec.size


def apply(enc: int, k: int, part: Any, dst: Any, n: int, e: int) -> bool:
    """Apply a ``sparse`` or ``bitmask`` part (``part``: its bytes) onto
    ``dst`` (a contiguous 1-D integer view of the base); ``False`` when this
    path does not apply (the caller takes the numpy path). ``ValueError`` for
    a part that cannot be its sender's, before anything is written."""
    import numpy as np

    kernels = _compiled()
    if kernels is None or e == 16 or enc not in (SPARSE, BITMASK) or dst.ndim != 1 or not _warm(dst.dtype):
        return False
    if _S.popcount is None:
        _S.popcount = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)
    apply_sparse, apply_bitmask = kernels[1], kernels[2]
    sec = sections(enc, n, k, e)
    vals = part[: sec.values].view(dst.dtype)
    if enc == SPARSE:
        nb = blocks(n)
        counts = part[sec.counts : sec.counts + 4 * nb].view(np.int32)
        low = part[sec.positions : sec.positions + 2 * k].view(np.uint16)
        r = apply_sparse(dst, vals, counts, low, n)
        if r == -1:
            raise ValueError(f"a sparse part of {n} elements has block counts that do not add up to {k}")
        if r < -1:
            raise ValueError(f"a sparse part of {n} elements names position {-2 - r}")
    elif enc == BITMASK:
        r = apply_bitmask(dst, vals, part[sec.positions : sec.positions + mask_bytes(n)], n, _S.popcount)
        if r < 0:
            raise ValueError(f"a bitmask part of {n} elements has {-1 - r} bits set, its header says {k}")
    return True
