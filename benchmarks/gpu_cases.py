"""The GPU path's cases for ``benchmarks/gpu_check.py`` (one GPU; each runs in
a process of its own, see there). Each returns ``(ok, summary)``.

- ``nccl_self``: reshard's own one-rank NCCL refit group (``joining.nccl_pg``:
  its error handling, eager connect) and a coalesced send/recv to itself
  through ``posting.post_ops``, data checked.
- ``coalescing_exception``: a post raises inside an NCCL group (after a
  send/recv pair was queued in it); ``post_ops`` closes the group, and a
  collective on another communicator (an engine's TP all-reduce) then runs
  on the same thread. ``coalescing_left_open`` is its control: a group left
  open, as before, makes that collective hang (the runner expects the hang).
- ``watchdog``: an NCCL work that never completes, on a refit group built
  as reshard builds it with a 5 s timeout: NCCL's watchdog aborts the
  communicator and the process lives on. ``watchdog_default`` is its
  control: torch's default error handling tears the process down.
- ``executor_<variant>``: the real executor running a real plan (trainer
  FSDP2 over 2 ranks -> vLLM TP=2, rank 0's share) as sender and receiver
  at once over a one-rank NCCL group (NCCL sends to itself): ``dense``,
  ``checksums``, ``delta`` (a dense refit, ~1% of the elements changed,
  then a delta refit) and ``cpu_destination`` (one destination tensor in
  pinned host memory: staged through the arena). Bit-exact, timed against
  one device-to-device copy of the same bytes.
- ``ipc_same_process``: a trainer rank and an engine worker in one process
  on one GPU (TRL's colocate mode), ``shared_memory=True``: the worker reads
  the trainer's tensors in-process, bit-exact.
- ``ipc_expandable``: the colocated 4-process refit with the trainers'
  allocator on ``expandable_segments:True``: bit-exact, or refused with a
  clear error before any byte moved (never a hang or a half-written refit).

``cpu=True`` runs a case's logic where no GPU is (a dry run of this script):
the executor cases over a loopback stand-in for the one-rank group (gloo
refuses a rank's sends to itself), ``ipc_same_process`` over shared memory.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from typing import Any

CONFIG = {
    "model_type": "llama",
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}
SMALL = {**CONFIG, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256}


def _one_rank_store():
    from torch.distributed import HashStore, PrefixStore

    return PrefixStore("reshard/gpu-check", HashStore())


def nccl_self(cpu: bool = False) -> tuple[bool, str]:
    import torch

    from reshard.transport import joining
    from reshard.transport.posting import Op, post_ops

    dev = torch.device("cuda", torch.cuda.current_device())
    pg = joining.nccl_pg(_one_rank_store(), 0, 1, dev, datetime.timedelta(seconds=60))
    src = torch.arange(1 << 20, dtype=torch.int32, device=dev)
    dst = torch.zeros_like(src)
    ops = [Op(False, dst.view(torch.uint8), 0, 0), Op(True, src.view(torch.uint8), 0, 0)]
    (work,) = post_ops(pg, ops, device=dev, backend="nccl", coalesce=True)
    work.wait()
    torch.cuda.current_stream(dev).synchronize()
    ok = bool(torch.equal(src, dst))
    pg.abort()
    return ok, "coalesced send/recv to itself on reshard's NCCL group: " + ("data equal" if ok else "DATA DIFFERS")


class _Refusing:
    """A backend whose third post raises, as NCCL refuses a tensor."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg
        self.n = 0

    def _start_coalescing(self) -> None:
        self.pg._start_coalescing()

    def _end_coalescing(self):
        return self.pg._end_coalescing()

    def _post(self, kind: str, bufs, peer: int, tag: int):
        self.n += 1
        if self.n == 3:
            raise RuntimeError("refused (injected)")
        return getattr(self.pg, kind)(bufs, peer, tag)

    def send(self, bufs, peer, tag):
        return self._post("send", bufs, peer, tag)

    def recv(self, bufs, peer, tag):
        return self._post("recv", bufs, peer, tag)


def _tp_all_reduce(torch, dev) -> bool:
    """An engine's collective on a communicator of its own, on this thread."""
    from reshard.transport import joining

    tp = joining.nccl_pg(_one_rank_store(), 0, 1, dev, datetime.timedelta(seconds=60))
    x = torch.ones(1024, device=dev)
    tp.allreduce([x]).wait()
    torch.cuda.current_stream(dev).synchronize()
    tp.abort()
    return bool((x == 1).all())


def coalescing_exception(cpu: bool = False) -> tuple[bool, str]:
    import torch

    from reshard.transport import joining
    from reshard.transport.posting import Op, post_ops

    dev = torch.device("cuda", torch.cuda.current_device())
    pg = joining.nccl_pg(_one_rank_store(), 0, 1, dev, datetime.timedelta(seconds=60))
    src = torch.arange(1024, dtype=torch.int32, device=dev)
    dst = torch.zeros_like(src)
    ops = [Op(False, dst, 0, 0), Op(True, src, 0, 0), Op(True, src, 0, 1)]
    try:
        post_ops(_Refusing(pg), ops, device=dev, backend="nccl", coalesce=True)
        return False, "the injected refusal did not raise"
    except RuntimeError:
        pass
    ok = _tp_all_reduce(torch, dev)
    torch.cuda.current_stream(dev).synchronize()
    pair = bool(torch.equal(src, dst))
    pg.abort()
    return (
        ok and pair,
        f"after a post raised inside the group: the queued pair landed: {pair}; a TP all-reduce ran: {ok}",
    )


def coalescing_left_open(cpu: bool = False) -> tuple[bool, str]:
    """The control: as reshard did before, the group is left open; the
    collective that follows on this thread hangs (the runner expects it)."""
    import torch

    from reshard.transport import joining

    dev = torch.device("cuda", torch.cuda.current_device())
    pg = joining.nccl_pg(_one_rank_store(), 0, 1, dev, datetime.timedelta(seconds=60))
    pg._start_coalescing()
    ok = _tp_all_reduce(torch, dev)  # expected to hang
    return False, f"the collective after an open group returned ({ok}): no hang"


def watchdog(cpu: bool = False, *, default: bool = False) -> tuple[bool, str]:
    import torch

    from reshard.transport import joining
    from reshard.transport.posting import Op, post_ops

    dev = torch.device("cuda", torch.cuda.current_device())
    timeout = datetime.timedelta(seconds=5)
    if default:
        from torch.distributed import ProcessGroupNCCL

        os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = ProcessGroupNCCL(_one_rank_store(), 0, 1, opts)
        pg.eager_connect_single_device(dev)
    else:
        joining.NCCL_TIMEOUT_MARGIN_S = 0.0  # the watchdog at the group's own deadline, for the check
        pg = joining.nccl_pg(_one_rank_store(), 0, 1, dev, timeout)
    never = torch.zeros(1024, device=dev)
    (work,) = post_ops(pg, [Op(False, never, 0, 0)], device=dev, backend="nccl", coalesce=True)  # no send: never lands
    outcome: dict[str, str] = {}

    def wait() -> None:
        try:
            work.wait()
            outcome["wait"] = "returned"
        except Exception as e:
            outcome["wait"] = f"raised {type(e).__name__}"

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    t.join(timeout=40)
    time.sleep(5)  # the process must still be here after the watchdog acted
    state = outcome.get("wait", "still waiting")
    if default:
        return False, f"torch's default error handling left the process alive (wait: {state})"
    return state.startswith("raised"), f"the watchdog timed the work out and the process lives (wait: {state})"


def _self_plan(config: dict):
    """Rank 0's sends to rank 2 and rank 2's receives from rank 0 of a real
    plan (trainer fsdp=2 -> engine tp=2), as one rank's plan that sends to
    and receives from itself; with rank 0's and rank 2's local tensors."""
    from reshard.costmodel.rules import EngineSpec, TrainerSpec, engine_layouts, trainer_layouts
    from reshard.models import canonical_tensors
    from reshard.plan.items import RankPlan, Round
    from reshard.plan.planner import Planner

    metas = tuple(canonical_tensors(config, dtype="bfloat16"))
    t = trainer_layouts(metas, config, TrainerSpec(fsdp=2))
    e = engine_layouts(metas, config, EngineSpec(tp=2), base=2)
    planner = Planner(t.layout_set("source"), e.layout_set("destination"))
    send, recv = planner.plan_for(0), planner.plan_for(2)
    by_index = {r.index: r for r in recv.rounds}
    rounds = []
    for r in send.rounds:
        other = by_index.get(r.index)
        sends = r.sends.get(2, [])
        recvs = other.recvs.get(0, []) if other is not None else []
        if sends or recvs:
            rounds.append(Round(r.index, sends={0: sends} if sends else {}, recvs={0: recvs} if recvs else {}))
    return RankPlan(rank=0, rounds=rounds, num_rounds=send.num_rounds)


class _Loopback:
    """Stands in for a one-rank NCCL group on a CPU (dry runs of this script
    only): a send to itself is kept until the receive with its tag waits."""

    def __init__(self) -> None:
        self.sent: dict[int, Any] = {}

    def send(self, bufs, peer, tag):
        self.sent[tag] = bufs[0].clone()
        return _Done(lambda: None)

    def recv(self, bufs, peer, tag):
        return _Done(lambda: bufs[0].copy_(self.sent.pop(tag)))


class _Done:
    def __init__(self, fn) -> None:
        self.fn = fn

    def wait(self) -> bool:
        self.fn()
        return True


def _one_rank_group(torch, dev, *, cpu: bool, checksums: bool, delta: bool):
    from reshard.transport import joining, wire
    from reshard.transport.config import GroupConfig
    from reshard.transport.group import RefitGroup

    cfg = GroupConfig(
        address="127.0.0.1:1", num_sources=1, num_destinations=1, checksums=checksums, delta=delta, timeout_s=120
    )
    backend = "gloo" if cpu else "nccl"
    pg = _Loopback() if cpu else joining.nccl_pg(_one_rank_store(), 0, 1, dev, datetime.timedelta(seconds=120))
    hello = wire.Hello(rank=0, role="source", domain="d", host="h", pid=os.getpid(), device=str(dev), backend=backend)
    return RefitGroup(
        config=cfg,
        rank=0,
        role="source",
        store=_one_rank_store(),
        pg=pg,
        backend=backend,
        device=dev,
        coalesces=not cpu,
        hellos={0: hello},
    )


def executor(variant: str, cpu: bool = False) -> tuple[bool, str]:
    import torch

    from reshard.transport.delta import DeltaRun, Snapshots, snapshot_key
    from reshard.transport.execute import Executor
    from reshard.transport.messages import local_view

    dev = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    plan = _self_plan(SMALL if cpu else CONFIG)
    transfers = plan.transfers()
    sends = [t for r in plan.rounds for t in r.sends.get(0, [])]
    recvs = [t for r in plan.rounds for t in r.recvs.get(0, [])]
    g = torch.Generator().manual_seed(0)
    sources: dict[str, torch.Tensor] = {}
    for t in sends:
        if t.src.local not in sources:
            sources[t.src.local] = torch.randn(t.src.local_shape, generator=g).to(torch.bfloat16).to(dev)
    dests: dict[str, torch.Tensor] = {}
    for t in recvs:
        if t.dst.local not in dests:
            dests[t.dst.local] = torch.zeros(t.dst.local_shape, dtype=torch.bfloat16, device=dev)
    host = ""
    if variant == "cpu_destination":
        host = max(dests, key=lambda n: dests[n].numel())
        dests[host] = torch.zeros_like(dests[host], device="cpu").pin_memory() if not cpu else dests[host]
    group = _one_rank_group(torch, dev, cpu=cpu, checksums=variant == "checksums", delta=variant == "delta")
    nbytes = sum(t.nbytes for t in recvs)

    def run(delta=None) -> float:
        ex = Executor(
            group,
            plan,
            sources=sources,
            destinations=dests,
            device=dev,
            checksums=variant == "checksums",
            delta=delta,
            budget_bytes=1 << 30,
        )
        t0 = time.perf_counter()
        ex.run()
        if not cpu:
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    def exact() -> bool:
        return all(
            torch.equal(
                local_view(dests[t.dst.local], t.dst, t.box).cpu().view(torch.int16),
                local_view(sources[t.src.local], t.src, t.box).cpu().view(torch.int16),
            )
            for t in recvs
        )

    if variant == "delta":
        snaps = Snapshots()
        snaps.backend = group.backend
        snaps.admit({0: sends}, rank=0)
        run(DeltaRun(frozenset(), {0: "the first refit"}, snaps))  # dense: fills the snapshot
        ok = exact()

        def step() -> int:
            changed = 0
            for v in sources.values():
                flat = v.view(-1)
                idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 100)].to(dev)
                flat[idx] = flat[idx] + 1
                changed += idx.numel()
            return changed

        step()
        run(DeltaRun(frozenset({0}), {}, snaps))  # (the first delta compiles the encoders)
        ok = ok and exact()
        changed = step()
        seconds = run(DeltaRun(frozenset({0}), {}, snaps))
        ok = ok and exact() and all(snapshot_key(t) in snaps.entries for t in sends)
        what = f"dense, then delta refits of ~1% changed ({changed} elements)"
    else:
        run()  # warm-up (allocations, the communicator's first use)
        for v in dests.values():
            v.zero_()
        seconds = run()
        ok = exact()
        what = {"dense": "dense", "checksums": "with checksums", "cpu_destination": f"{host!r} in host memory"}[variant]
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    if not cpu:
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    b.copy_(a)
    if not cpu:
        torch.cuda.synchronize(dev)
    copy_s = time.perf_counter() - t0
    return ok, (
        f"{what}: {len(transfers) // 2} transfers, {nbytes / 1e6:.1f} MB, bit-exact: {ok}; "
        f"{seconds * 1e3:.2f} ms against a device copy of {copy_s * 1e3:.2f} ms ({seconds / copy_s:.1f}x)"
    )


def _same_process_rank(rank: int, address: str, device: str, out: dict) -> None:
    import torch

    from reshard.plan.box import Box
    from reshard.plan.layout import TensorMeta
    from reshard.plan.specs import PieceSpec
    from reshard.receiver import Receiver
    from reshard.sender import Sender
    from reshard.transport.group import GroupConfig

    meta = TensorMeta("w", (512, 256), "bfloat16")
    full = torch.randn(meta.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(device)
    cfg = GroupConfig(
        address=address, num_sources=1, num_destinations=1, timeout_s=60, host_store=False, shared_memory=True,
        export_sources=device == "cpu",
    )  # fmt: skip
    try:
        if rank == 0:
            s = Sender.from_pieces(
                [PieceSpec(meta, Box((0, 0), (512, 256)), "w", (512, 256))], {"w": full}, config=cfg, rank=0
            )
            for n in (1, 2):
                full.neg_()
                out["sent"] = dict(s.push(n).exec.send_by_link)
            s.close()
            return
        dst = torch.zeros(512, 128, dtype=torch.bfloat16, device=device)
        r = Receiver({"w": dst}, [PieceSpec(meta, Box((0, 128), (512, 128)), "w", (512, 128))], config=cfg, rank=1)
        for n in (1, 2):
            st = r.pull(n)
        out["links"] = dict(st.exec.recv_by_link)
        out["exact"] = bool(torch.equal(dst.cpu().view(torch.int16), full[:, 128:].cpu().view(torch.int16)))
        r.close()
    except Exception as e:  # reported by the case
        out[f"error{rank}"] = f"{type(e).__name__}: {e}"


def ipc_same_process(cpu: bool = False) -> tuple[bool, str]:
    from torch.distributed import TCPStore

    from reshard.testing.ports import free_port

    port = free_port()
    store = TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    address = f"127.0.0.1:{port}"
    device = "cpu" if cpu else "cuda"
    out: dict = {}
    ranks = [threading.Thread(target=_same_process_rank, args=(r, address, device, out)) for r in (0, 1)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(timeout=120)
    del store
    link = "shm" if cpu else "ipc"
    errors = [v for k, v in out.items() if k.startswith("error")]
    ok = not errors and out.get("exact") is True and set(out.get("links", {})) == {link}
    return ok, f"trainer rank and engine worker in one process: {errors or out}"


def ipc_expandable(colocated: Any, cpu: bool = False) -> tuple[bool, str]:
    """The colocated case (``colocated``: ``gpu_check.colocated``) with the
    trainers on expandable segments."""
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # the spawned ranks inherit it
    import torch

    report, ok = colocated(torch, refits=3, device="cpu" if cpu else "cuda", layers=2)
    if ok:
        return True, "bit-exact by CUDA IPC from expandable segments:\n" + report
    clear = "expandable_segments" in report and "cannot read" in report
    return clear, ("refused clearly before any byte moved:\n" if clear else "FAILED unclearly:\n") + report
