"""GPU check (one GPU): pack/unpack cost of real plans vs a device copy, and the
NCCL calls the transport makes. Run by ``benchmarks/gpu_check.sh``.

1. Plans: Llama-3-8B, trainer fsdp=8 -> engine tp=8 (vLLM layout), planned
   by the real planner for one trainer rank (sender) and one engine rank
   (receiver). Every transfer's slice is copied between the rank's real
   local tensors (bf16, on the GPU) and a staging buffer, as the executor
   does; timed against one contiguous device-to-device copy of the same
   bytes.
2. NCCL: a one-rank ProcessGroupNCCL built on a TCPStore as the refit group
   builds it (eager connect, coalesced send/recv to itself, abort), with
   data checked. Two ranks on one GPU are not allowed by NCCL, so this is as
   much of the path as one GPU runs.
"""

from __future__ import annotations

import datetime
import socket
import sys
import time


def _sync(torch):
    torch.cuda.synchronize()


def _time(torch, fn, reps=5):
    fn()
    _sync(torch)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(torch)
        best = min(best, time.perf_counter() - t0)
    return best


def pack_unpack(torch) -> list[tuple]:
    from reshard.costmodel.rules import EngineSpec, TrainerSpec, engine_layouts, trainer_layouts
    from reshard.models import load_model
    from reshard.plan.planner import Planner
    from reshard.transport.execute import local_view

    spec = load_model("llama3-8b")
    t = trainer_layouts(spec.tensors, spec.config, TrainerSpec(fsdp=8))
    e = engine_layouts(spec.tensors, spec.config, EngineSpec(tp=8), base=8)
    planner = Planner(t.layout_set("source"), e.layout_set("destination"))
    rows = []
    for rank, side in ((0, "sender (trainer rank 0)"), (8, "receiver (engine rank 0)")):
        plan = planner.plan_for(rank)
        transfers = plan.transfers()
        # The rank's local tensors, as the plan names them.
        local = {}
        for tr in transfers:
            slot = tr.src if rank < 8 else tr.dst
            if slot.local not in local:
                local[slot.local] = torch.randn(slot.local_shape, device="cuda", dtype=torch.bfloat16)
        total = sum(tr.nbytes for tr in transfers)
        staging = torch.empty(total, dtype=torch.uint8, device="cuda")
        offs = []
        pos = 0
        for tr in transfers:
            offs.append(pos)
            pos += tr.nbytes

        def run(transfers=transfers, offs=offs, rank=rank, local=local, staging=staging) -> None:
            for tr, off in zip(transfers, offs, strict=True):
                slot = tr.src if rank < 8 else tr.dst
                view = local_view(local[slot.local], slot, tr.box)
                buf = staging.narrow(0, off, tr.nbytes).view(torch.bfloat16).view(tr.box.sizes)
                if rank < 8:
                    buf.copy_(view)
                else:
                    view.copy_(buf)

        a = torch.empty(total, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        t_plan = _time(torch, run)
        t_copy = _time(torch, lambda a=a, b=b: b.copy_(a))
        contiguous = sum(tr.nbytes for tr in transfers if (tr.src if rank < 8 else tr.dst).is_plain())
        rows.append((side, len(transfers), total, t_plan, t_copy, contiguous))
    return rows


def nccl_path(torch) -> str:
    from torch.distributed import PrefixStore, ProcessGroupNCCL, TCPStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = PrefixStore("reshard/gpu-check/g0", TCPStore("127.0.0.1", port, None, True, wait_for_workers=False))
    opts = ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=60)
    pg = ProcessGroupNCCL(PrefixStore("pg", store), 0, 1, opts)
    dev = torch.device("cuda", torch.cuda.current_device())
    pg.eager_connect_single_device(dev)
    src = torch.arange(1 << 20, dtype=torch.int32, device=dev)
    dst = torch.zeros_like(src)
    pg._start_coalescing(dev)
    pg.recv([dst.view(torch.uint8)], 0, 0)
    pg.send([src.view(torch.uint8)], 0, 0)
    work = pg._end_coalescing(dev)
    work.wait()
    torch.cuda.current_stream(dev).synchronize()
    ok = bool(torch.equal(src, dst))
    pg.abort()
    return "ok" if ok else "DATA MISMATCH"


def main() -> int:
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed")
        return 2
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device")
        return 2
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  nccl {torch.cuda.nccl.version()}")
    print(f"{'side':<26}{'transfers':>10}{'GB':>8}{'pack/unpack ms':>16}{'d2d copy ms':>13}{'ratio':>8}")
    for side, n, total, tp, tc in pack_unpack(torch):
        print(f"{side:<26}{n:>10}{total / 1e9:>8.2f}{tp * 1e3:>16.2f}{tc * 1e3:>13.2f}{tp / tc:>8.2f}")
    try:
        print(f"NCCL (1 rank: store, eager connect, coalesced send/recv to self, abort): {nccl_path(torch)}")
    except Exception as e:  # reported, not hidden
        print(f"NCCL path FAILED: {type(e).__name__}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
