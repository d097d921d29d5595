"""Each delta encoding measured on one transfer: the bytes it puts on the wire
and how long encoding (compare against the snapshot, gather, update it) and
applying take, by the share of elements that changed, on this machine.

    python benchmarks/delta_encodings.py [--mb 128] [--dtype bfloat16]

Output in docs/results/delta_encodings.txt. Every row forces one encoding's
layout on the same data (sizes as :func:`reshard.plan.delta_format.part_size`
gives them) and times the chosen one on the compiled (numba) and the numpy
CPU path; results are checked bit for bit.
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    import torch

    from reshard.plan import delta_format as F
    from reshard.transport import encoding as E

    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    e = dtype.itemsize
    n = int(args.mb * 1e6 / e)
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(n, generator=g) * 0.02).to(dtype)
    out = torch.empty(F.pad(n * e), dtype=torch.uint8)
    warm = torch.zeros(64, dtype=dtype)
    E.encode_part(warm, warm.clone(), out)  # compile once
    print(f"one transfer of {n * e / 1e6:.0f} MB ({n} {args.dtype} elements), {os.cpu_count()} CPUs")
    print(
        f"{'changed':>8}  {'same':>7}{'dense':>7}{'sparse':>8}{'bitmask':>8}   {'chosen':<8}"
        f"{'encode ms':>10}{'numpy ms':>10}{'apply ms':>10}{'numpy ms':>10}"
    )
    for density in (0.0, 0.001, 0.005, 0.02, 0.05, 0.1, 0.3, 1.0):
        new = base.clone()
        k = int(n * density)
        if k:
            idx = torch.randperm(n, generator=g)[:k]
            new.view(torch.int16 if e == 2 else torch.int32)[idx] ^= 1
        sizes = [F.part_size(enc, n, k, e) / (n * e) for enc in (F.SAME, F.DENSE, F.SPARSE, F.BITMASK)]
        times = {}
        for path in ("1", "0"):
            os.environ["RESHARD_NUMBA"] = path
            snap = base.clone()
            t0 = time.perf_counter()
            enc, got, size = E.encode_part(new, snap, out)
            t1 = time.perf_counter()
            dst = base.clone()
            t2 = time.perf_counter()
            E.apply_part(enc, got, out[:size], dst)
            t3 = time.perf_counter()
            assert got == k and torch.equal(dst.view(torch.uint8), new.view(torch.uint8))
            times[path] = (t1 - t0, t3 - t2)
        os.environ.pop("RESHARD_NUMBA")
        same = "-" if k else "0"
        print(
            f"{100 * density:>7.1f}%  {same:>7}{sizes[1]:>7.3f}{sizes[2]:>8.3f}{sizes[3]:>8.3f}   "
            f"{F.NAMES[enc]:<8}{1e3 * times['1'][0]:>10.1f}{1e3 * times['0'][0]:>10.1f}"
            f"{1e3 * times['1'][1]:>10.1f}{1e3 * times['0'][1]:>10.1f}"
        )
    t0 = time.perf_counter()
    b2 = base.clone()
    b2.copy_(new)
    print(f"a memory copy of the same bytes: {1e3 * (time.perf_counter() - t0):.1f} ms")


if __name__ == "__main__":
    main()
