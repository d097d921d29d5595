"""Explicit layouts, no engine: say which box of which tensor each rank holds
or needs, and reshard moves exactly those bytes.

Two trainer ranks hold the rows of a [1024, 768] tensor, split in half; three
engine ranks each keep a third of its columns, stored transposed (as some
engines lay weights out). Every byte goes from the trainer rank that holds it
to the engine rank that keeps it, over a gloo refit group on this machine.

    python examples/explicit_layouts.py
"""

from __future__ import annotations

import multiprocessing as mp
import sys

import torch

from reshard import GroupConfig, Receiver, Sender
from reshard.plan import Box, PieceSpec, TensorMeta

SOURCES, DESTINATIONS = 2, 3
META = TensorMeta("model.layers.0.mlp.down_proj.weight", (1024, 768), "float32")


def full() -> torch.Tensor:
    return torch.arange(1024 * 768, dtype=torch.float32).reshape(1024, 768)


def rank_main(rank: int, address: str, q) -> None:
    cfg = GroupConfig(address=address, num_sources=SOURCES, num_destinations=DESTINATIONS, timeout_s=60)
    if rank < SOURCES:
        rows = slice(rank * 512, (rank + 1) * 512)
        local = full()[rows].clone()
        # Trainer rank `rank` holds rows [512 r, 512 r + 512) in a local tensor of its own.
        piece = PieceSpec(META, Box((rank * 512, 0), (512, 768)), "w", (512, 768))
        sender = Sender.from_pieces([piece], {"w": local}, config=cfg, rank=rank)
        stats = sender.push(1)
        sender.close()
        q.put((rank, stats.exec.bytes_sent))
        return
    j = rank - SOURCES
    cols = slice(j * 256, (j + 1) * 256)
    # Engine rank j keeps columns [256 j, 256 j + 256), transposed: global dim 0
    # runs along local dim 1, global dim 1 along local dim 0.
    local = torch.zeros(256, 1024)
    piece = PieceSpec(META, Box((0, j * 256), (1024, 256)), "wt", (256, 1024), dims=(1, 0))
    receiver = Receiver({"wt": local}, [piece], config=cfg, rank=rank)
    stats = receiver.pull(1)
    receiver.close()
    ok = torch.equal(local, full()[:, cols].t())
    q.put((rank, (stats.exec.bytes_received, ok)))


def main() -> int:
    from _common import free_port

    address = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, address, q)) for r in range(SOURCES + DESTINATIONS)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join()
    sent = sum(results[r] for r in range(SOURCES))
    received = [results[r][0] for r in range(SOURCES, SOURCES + DESTINATIONS)]
    exact = all(results[r][1] for r in range(SOURCES, SOURCES + DESTINATIONS))
    print(f"trainer ranks sent {sent} bytes; engine ranks received {received} bytes (a third each)")
    ok = exact and sent == sum(received) == META.nbytes
    print("OK: every engine rank holds its columns, bit for bit" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
