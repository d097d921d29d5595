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
   much of the NCCL path as one GPU runs.
3. Colocated (CUDA IPC): four real processes on the one GPU, two trainer
   ranks (FSDP2-style ``Shard(0)``) and two engine workers (vLLM TP=2
   layout) of ``reshard bench --case colocated``'s model, joined with
   ``GroupConfig(shared_memory=True)``: no process group (the GPU is
   shared), every byte read by CUDA IPC from the trainers' tensors. Several
   refits, the trainers flipping the sign of their tensors in place between
   them; every kept slice compared bit for bit; time per refit (the copies,
   and the whole refit with its agreements) against one device-to-device
   copy of the bytes the engine keeps.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import statistics
import sys
import time
from dataclasses import replace


def _sync(torch):
    if torch.cuda.is_available():
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


def _colocated_run(rank: int, address: str, refits: int, device: str, layers: int | None) -> dict:
    import torch

    from reshard.costmodel.rules import EngineSpec, engine_layouts
    from reshard.plan.box import chunk_range
    from reshard.plan.layout import Mesh
    from reshard.plan.specs import GridSpec
    from reshard.receiver import Receiver
    from reshard.sender import Sender
    from reshard.tools.bench import CASES, _global, _tensors, destination_slots
    from reshard.transport.execute import local_view
    from reshard.transport.group import GroupConfig

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    case = CASES["colocated"]
    if layers is not None:
        case = replace(case, layers=layers)
    metas = _tensors(case)
    cfg = GroupConfig(
        address=address,
        num_sources=2,
        num_destinations=2,
        timeout_s=120,
        host_store=False,
        backend="nccl" if cuda else "gloo",
        shared_memory=True,
        export_sources=not cuda and rank < 2,
    )
    runs = []
    if rank < 2:
        grids = [GridSpec(m, Mesh(shape=(2,)), ((0,),) + ((),) * (len(m.shape) - 1)) for m in metas]
        tensors = {}
        for m in metas:
            lo, hi = chunk_range(m.shape[0], 2, rank)
            tensors[m.name] = _global(m)[lo:hi].to(device)
        sender = Sender.from_pieces([], tensors, config=cfg, rank=rank, grids=grids)
        for n in range(1, refits + 1):
            for v in tensors.values():
                v.neg_()  # refit n holds (-1)**n times the model
            st = sender.push(n)
            runs.append({"total": st.total_seconds, "exec": st.exec.seconds, "links": dict(st.exec.send_by_link)})
        sender.close()
        return {"runs": runs}
    layout = engine_layouts(metas, case.config, EngineSpec(tp=2), base=2).layout_of(rank)
    slots = destination_slots(layout, rank)
    local: dict = {}
    for _, s in slots:
        local.setdefault(s.local, torch.zeros(s.local_shape, dtype=torch.bfloat16, device=device))
    receiver = Receiver(local, config=cfg, rank=rank, layout=layout)
    full = {m.name: _global(m) for m in metas}
    exact = True
    for n in range(1, refits + 1):
        for v in local.values():
            v.zero_()
        st = receiver.pull(n)
        for meta, s in slots:
            want = full[meta.name][tuple(slice(o, o + k) for o, k in zip(s.box.offsets, s.box.sizes, strict=True))]
            if n % 2:
                want = want.neg()
            got = local_view(local[s.local], s, s.box).cpu()
            exact = exact and torch.equal(got.view(torch.int16), want.view(torch.int16))
        runs.append({"total": st.total_seconds, "exec": st.exec.seconds, "links": dict(st.exec.recv_by_link)})
    group = receiver.session.group
    no_wire = group.no_wire if group is not None else "(the group was dropped)"
    receiver.close()
    kept = sum(s.box.numel * 2 for _, s in slots)
    return {"runs": runs, "exact": exact, "kept": kept, "no_wire": no_wire}


def colocated(torch, refits: int = 6, device: str = "cuda", layers: int | None = None) -> tuple[str, bool]:
    """Run the colocated case; the printed report and whether it passed.
    ``device="cpu"`` runs the same script over shared memory (the trainers'
    tensors exported), to check the script itself where no GPU is."""
    from reshard.tools.bench import run_ranks

    try:
        results = run_ranks(_colocated_run, 4, refits, device, layers, timeout=300, what="colocated")
    except RuntimeError as e:
        return str(e), False
    engines = [results[2], results[3]]
    kept = sum(e["kept"] for e in engines)
    exact = all(e["exact"] for e in engines)
    links: dict[str, int] = {}
    for e in engines:
        for k, v in e["runs"][-1]["links"].items():
            links[k] = links.get(k, 0) + v
    # Per refit after the first (which opens the handles): the slowest engine rank.
    copy_s = statistics.median(max(e["runs"][i]["exec"] for e in engines) for i in range(1, refits))
    total_s = statistics.median(max(e["runs"][i]["total"] for e in engines) for i in range(1, refits))
    first_s = max(e["runs"][0]["total"] for e in engines)
    a = torch.empty(kept, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    d2d = _time(torch, lambda: b.copy_(a))
    link = "ipc" if device == "cuda" else "shm"
    baseline = "device-to-device" if device == "cuda" else "in-process"
    where = "4 processes on one GPU, CUDA IPC, no NCCL" if device == "cuda" else "4 CPU processes, shared memory"
    lines = [
        f"colocated ({where}): trainer fsdp=2 -> engine tp=2, {kept / 1e9:.3f} GB kept, {refits} refits",
        f"  bit-exact: {exact}   bytes by link (last refit): {links}",
        f"  process group: {'none (' + engines[0]['no_wire'][:60] + '...)' if engines[0]['no_wire'] else 'built'}",
        f"  copies {copy_s * 1e3:.2f} ms ({kept / copy_s / 1e9:.1f} GB/s), whole refit {total_s * 1e3:.2f} ms "
        f"({kept / total_s / 1e9:.1f} GB/s), first refit (opens handles) {first_s * 1e3:.1f} ms",
        f"  {baseline} copy of the same bytes: {d2d * 1e3:.2f} ms ({kept / d2d / 1e9:.1f} GB/s); "
        f"the copies take {copy_s / d2d:.2f}x its time",
    ]
    ok = exact and set(links) == {link} and sum(links.values()) == kept
    return "\n".join(lines), ok


def main() -> int:
    ap = argparse.ArgumentParser(description="One-GPU check of the transport (see the module docstring).")
    ap.add_argument(
        "--cpu-colocated",
        action="store_true",
        help="run only the colocated case, over shared memory on CPU (checks this script where no GPU is)",
    )
    ap.add_argument("--layers", type=int, default=None, help="the colocated case's model layers (default 12)")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed")
        return 2
    if args.cpu_colocated:
        report, ok = colocated(torch, device="cpu", layers=args.layers)
        print(report)
        return 0 if ok else 1
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device")
        return 2
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  nccl {torch.cuda.nccl.version()}")
    print(f"{'side':<26}{'transfers':>10}{'GB':>8}{'pack/unpack ms':>16}{'d2d copy ms':>13}{'ratio':>8}")
    for side, n, total, tp, tc, _contiguous in pack_unpack(torch):
        print(f"{side:<26}{n:>10}{total / 1e9:>8.2f}{tp * 1e3:>16.2f}{tc * 1e3:>13.2f}{tp / tc:>8.2f}")
    failed = False
    try:
        print(f"NCCL (1 rank: store, eager connect, coalesced send/recv to self, abort): {nccl_path(torch)}")
    except Exception as e:  # reported, not hidden
        print(f"NCCL path FAILED: {type(e).__name__}: {e}")
        failed = True
    report, ok = colocated(torch, layers=args.layers)
    print(report)
    return 1 if failed or not ok else 0


if __name__ == "__main__":
    sys.exit(main())
