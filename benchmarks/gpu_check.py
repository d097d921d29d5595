"""GPU check (one GPU), run by ``benchmarks/gpu_check.sh``: every case in a
process of its own under a timeout, one ``PASS``/``FAIL`` line per case in
``<out>/gpu_check.txt`` (every report in ``gpu_check.log``). The cases of
the GPU path are in ``benchmarks/gpu_cases.py``; these are the older ones:

1. Plans: Llama-3-8B, trainer fsdp=8 -> engine tp=8 (vLLM layout), planned
   by the real planner for one trainer rank (sender) and one engine rank
   (receiver). Every transfer's slice is copied between the rank's real
   local tensors (bf16, on the GPU) and a staging buffer, as the executor
   does; timed against one contiguous device-to-device copy of the same
   bytes.
2. Colocated (CUDA IPC): four real processes on the one GPU, two trainer
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
import functools
import statistics
import sys
import time
from collections.abc import Callable
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


def _pack_unpack_case(cpu: bool = False) -> tuple[bool, str]:
    import torch

    lines = [f"{'side':<26}{'transfers':>10}{'GB':>8}{'pack/unpack ms':>16}{'d2d copy ms':>13}{'ratio':>8}"]
    for side, n, total, tp, tc, _contiguous in pack_unpack(torch):
        lines.append(f"{side:<26}{n:>10}{total / 1e9:>8.2f}{tp * 1e3:>16.2f}{tc * 1e3:>13.2f}{tp / tc:>8.2f}")
    return True, "\n".join(lines)


def _colocated_case(cpu: bool = False) -> tuple[bool, str]:
    import torch

    report, ok = colocated(torch, device="cpu" if cpu else "cuda", layers=1 if cpu else None)
    return ok, report


def _cases() -> dict[str, tuple[Callable[..., tuple[bool, str]], bool, int, str]]:
    """name -> (run, runs on a CPU too, timeout in seconds, what the runner expects: ``pass``, or a
    control's ``hang`` / ``killed``)."""
    import gpu_cases as c

    return {
        "pack_unpack": (_pack_unpack_case, False, 120, "pass"),
        "nccl_self": (c.nccl_self, False, 60, "pass"),
        "coalescing_exception": (c.coalescing_exception, False, 60, "pass"),
        "coalescing_left_open": (c.coalescing_left_open, False, 30, "hang"),
        "watchdog": (c.watchdog, False, 75, "pass"),
        "watchdog_default": (functools.partial(c.watchdog, default=True), False, 75, "killed"),
        "executor_dense": (functools.partial(c.executor, "dense"), True, 90, "pass"),
        "executor_checksums": (functools.partial(c.executor, "checksums"), True, 90, "pass"),
        "executor_delta": (functools.partial(c.executor, "delta"), True, 120, "pass"),
        "executor_cpu_destination": (functools.partial(c.executor, "cpu_destination"), True, 90, "pass"),
        "ipc_same_process": (c.ipc_same_process, True, 90, "pass"),
        "colocated": (_colocated_case, True, 180, "pass"),
        "ipc_expandable": (functools.partial(c.ipc_expandable, colocated), False, 180, "pass"),
    }


def _run_case(name: str, cpu: bool) -> int:
    """In the case's own process: run it, print its report and one ``RESULT`` line."""
    run = _cases()[name][0]
    try:
        ok, summary = run(cpu=cpu)
    except Exception:
        import traceback

        traceback.print_exc()
        ok, summary = False, "raised (see above)"
    print(summary, flush=True)
    print(f"RESULT {'PASS' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


def _verdict(expect: str, rc: int | None, timed_out: bool, stdout: str) -> tuple[str, str]:
    """``(PASS or FAIL, why)`` of a case that ended so; a control passes by
    hanging or being torn down, as it is expected to."""
    if timed_out:
        if expect == "hang":
            return "PASS", "hung as expected (the defect this guards against is real)"
        return "FAIL", "timed out"
    if rc is not None and rc < 0:
        if expect == "killed":
            return "PASS", f"torn down by signal {-rc} as expected under torch's default error handling"
        return "FAIL", f"killed by signal {-rc}"
    if expect != "pass":
        return "FAIL", f"expected the control to {expect}; it exited {rc}"
    lines = stdout.strip().splitlines()
    passed = rc == 0 and bool(lines) and lines[-1] == "RESULT PASS"
    # The summary: the report's first line (the log has all of it).
    report = lines[:-1] if lines and lines[-1].startswith("RESULT") else lines
    return ("PASS" if passed else "FAIL"), (report[0] if report else f"no report (exit {rc})")


def run_all(out_dir: str, cpu: bool, only: list[str]) -> int:
    """Each case in a process of its own under its timeout; one PASS/FAIL line
    per case to ``out_dir/gpu_check.txt`` (and every report to ``gpu_check.log``)."""
    import pathlib
    import subprocess

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results, log = out / "gpu_check.txt", out / "gpu_check.log"
    failed = 0
    with results.open("w") as res, log.open("w") as full:
        head = _header(cpu)
        for f in (res, full, sys.stdout):
            print(head, file=f, flush=True)
        for name, (_run, on_cpu, timeout, expect) in _cases().items():
            if only and name not in only:
                continue
            if cpu and not on_cpu:
                line = f"SKIP {name}: needs a GPU"
            else:
                t0 = time.perf_counter()
                cmd = [sys.executable, __file__, "--case", name] + (["--cpu"] if cpu else [])
                try:
                    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
                    stdout, output, rc, timed_out = p.stdout, p.stdout + p.stderr, p.returncode, False
                except subprocess.TimeoutExpired as e:
                    raw = e.stdout or b""
                    stdout = output = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
                    rc, timed_out = None, True
                verdict, why = _verdict(expect, rc, timed_out, stdout)
                failed += verdict == "FAIL"
                line = f"{verdict} {name} ({time.perf_counter() - t0:.0f} s): {why}"
                print(f"== {name} ==\n{output}", file=full, flush=True)
            for f in (res, sys.stdout):
                print(line, file=f, flush=True)
    return 1 if failed else 0


def _header(cpu: bool) -> str:
    import platform

    import torch

    if cpu:
        return f"gpu_check dry run on a CPU: torch {torch.__version__}, Python {platform.python_version()}"
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else "-"
    return f"gpu_check on {name}: torch {torch.__version__}, NCCL {nccl}, Python {platform.python_version()}"


def main() -> int:
    ap = argparse.ArgumentParser(description="One-GPU check of the transport (see the module docstring).")
    ap.add_argument("--out", default="gpu-check", help="folder for gpu_check.txt (PASS/FAIL lines) and the log")
    ap.add_argument("--dry-run", action="store_true", help="run the cases a CPU allows (checks this script)")
    ap.add_argument("--only", nargs="*", default=[], help="run only these cases")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--cpu-colocated", action="store_true", help="run only the colocated case over shared memory on a CPU"
    )
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed")
        return 2
    if args.case:
        return _run_case(args.case, args.cpu)
    if args.cpu_colocated:
        return run_all(args.out, True, ["colocated"])
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (--dry-run runs what a CPU allows)")
        return 2
    return run_all(args.out, args.dry_run, args.only)


if __name__ == "__main__":
    sys.exit(main())
