"""The GPU path's properties that a CPU can show (docs/gpu.md lists what
only a GPU shows, and ``benchmarks/gpu_check.sh`` runs it there).

- Nothing that may raise runs inside an NCCL group, and a group is closed
  whatever a post raises: on NCCL a group left open poisons every later
  collective of that thread. Shown with an NCCL-like coalescing backend
  (per-thread depth, operations queued until the group ends) over a real
  gloo group, and the call shape checked against torch's own ``Backend``.
- Ranks that would build different process groups are refused at join.
- Every tensor reshard allocates where it can meet a GPU names its device.
- A PEFT policy's factors are merged on the device of the weights.
- Offloaded trainers' and pinned host staging buffers' messages are staged
  through the arena, never posted in place.
"""

from __future__ import annotations

import ast
import pathlib
import threading

import pytest
import torch

from reshard.errors import RefitError
from reshard.plan.box import Box
from reshard.plan.items import Round, Transfer, TransferKind
from reshard.plan.layout import Slot, TensorMeta
from reshard.plan.specs import PieceSpec
from reshard.transport import joining
from reshard.transport.config import GroupConfig
from reshard.transport.locals import Tensors
from reshard.transport.messages import Unpacked, round_staging, staging_need
from reshard.transport.posting import Op, off_device_locals, post_ops

from . import procs
from .support import group_config

# -- coalescing blocks -------------------------------------------------------------


class NcclLike:
    """A backend with NCCL's coalescing contract over a real one: the group
    depth is per thread, operations posted inside a group are queued and
    launched when it ends, and ``_start_coalescing``/``_end_coalescing``
    take no device (as on torch's ``Backend``, which ``ProcessGroupNCCL``
    is). ``refuse``: a tag whose posting raises, as NCCL refuses a tensor."""

    def __init__(self, inner=None, refuse: int | None = None) -> None:
        self.inner = inner
        self.refuse = refuse
        self.local = threading.local()
        self.started = 0
        self.posted: list[tuple[str, int, int]] = []

    @property
    def depth(self) -> int:
        return getattr(self.local, "depth", 0)

    def _start_coalescing(self) -> None:
        self.local.depth = self.depth + 1
        self.local.queue = []
        self.started += 1

    def _end_coalescing(self):
        self.local.depth = self.depth - 1
        queue, self.local.queue = self.local.queue, []
        if self.inner is None:
            return _All([])
        return _All([getattr(self.inner, kind)(bufs, peer, tag) for kind, bufs, peer, tag in queue])

    def _post(self, kind: str, bufs, peer: int, tag: int):
        if tag == self.refuse:
            raise RuntimeError("Tensors must be CUDA and dense")
        self.posted.append((kind, peer, tag))
        if self.depth:
            self.local.queue.append((kind, bufs, peer, tag))
            return None
        return getattr(self.inner, kind)(bufs, peer, tag)

    def send(self, bufs, peer: int, tag: int):
        return self._post("send", bufs, peer, tag)

    def recv(self, bufs, peer: int, tag: int):
        return self._post("recv", bufs, peer, tag)


class _All:
    def __init__(self, works) -> None:
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


def test_the_backend_coalescing_calls_take_no_device():
    """The refit group's process group is a c10d ``Backend`` built directly
    (``ProcessGroupNCCL`` is one, like ``ProcessGroupGloo``): its coalescing
    calls take no device, unlike ``ProcessGroup._start_coalescing(device)``.
    gloo implements no coalescing, so the right call shape raises that."""
    import datetime

    from torch.distributed import HashStore, ProcessGroupGloo

    opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = datetime.timedelta(seconds=5)
    opts._devices = [ProcessGroupGloo.create_default_device()]
    pg = ProcessGroupGloo(HashStore(), 0, 1, opts)
    assert isinstance(pg, torch._C._distributed_c10d.Backend)
    with pytest.raises(RuntimeError, match="does not implement"):
        pg._start_coalescing()
    with pytest.raises(TypeError):
        pg._start_coalescing(torch.device("cpu"))  # what reshard called before: a TypeError on every NCCL refit


def test_a_post_that_raises_inside_the_group_still_closes_it():
    pg = NcclLike(refuse=7)
    ops = [Op(False, torch.zeros(4), 1, 5), Op(True, torch.zeros(4), 1, 7), Op(True, torch.zeros(4), 1, 8)]
    with pytest.raises(RuntimeError, match="CUDA and dense"):
        post_ops(pg, ops, device=torch.device("cpu"), backend="gloo", coalesce=True)
    assert pg.started == 1 and pg.depth == 0
    # The thread's next group works.
    post_ops(pg, [], device=torch.device("cpu"), backend="gloo", coalesce=True)
    assert pg.depth == 0


def test_a_buffer_off_the_groups_device_is_refused_before_the_group_opens():
    pg = NcclLike()
    meta = torch.empty(4, device="meta")
    with pytest.raises(ValueError, match=r"cannot send to rank 3 \(message 2\): a buffer on meta"):
        post_ops(pg, [Op(True, meta, 3, 2)], device=torch.device("cpu"), backend="gloo", coalesce=True)
    with pytest.raises(ValueError, match="NCCL communicator is on cuda:1"):
        post_ops(pg, [Op(False, torch.zeros(4), 3, 2)], device=torch.device("cuda", 1), backend="nccl", coalesce=True)
    assert pg.started == 0 and pg.posted == []


class _LazyOne(Tensors):
    """A source's tensors, checked one by one as a refit touches them."""

    lazy = True


def _packing_fails(rank: int, address: str) -> dict:
    """Rank 0 sends ``a`` and ``b`` packed in one message; its lazily
    checked ``b`` has the wrong shape, found while packing. Both ranks run
    their group as NCCL would (coalesced); afterwards the source's thread
    must be outside any group, and nothing was posted in that round."""
    from reshard.receiver import Receiver
    from reshard.sender import Sender

    cfg = group_config(address, 1, 1, timeout_s=30)
    metas = [TensorMeta(n, (4, 4), "float32") for n in ("a", "b")]
    pieces = [PieceSpec(m, Box((0, 0), (4, 4)), m.name, (4, 4)) for m in metas]
    if rank == 0:
        end = Sender.from_pieces(pieces, _LazyOne({"a": torch.ones(4, 4), "b": torch.ones(3, 4)}), config=cfg, rank=0)
    else:
        end = Receiver({"a": torch.zeros(4, 4), "b": torch.zeros(4, 4)}, pieces, config=cfg, rank=1)
    end.connect() if rank == 0 else end.session.connect()
    group = end.session.group
    pg = group.pg = NcclLike(group.pg)
    group.coalesces = True
    try:
        end.push(1) if rank == 0 else end.pull(1)
        error = ""
    except RefitError as e:
        error = str(e)
    out = {"error": error, "depth": pg.depth, "posted": pg.posted}
    end.close()
    return out


def test_an_exception_while_packing_leaves_no_group_open_and_posts_nothing():
    server = procs.StoreServer()
    src, dst = procs.check(procs.run(_packing_fails, 2, server.address, timeout=120))
    assert "local tensor 'b' for 'b' is [3, 4] float32, its layout says [4, 4] float32" in src["error"]
    assert src["error"] and dst["error"]  # every rank fails, and says why
    assert src["depth"] == 0 and dst["depth"] == 0
    assert src["posted"] == []  # packed before the group opened: nothing of the round went out


# -- joining ---------------------------------------------------------------------------


def test_ranks_that_would_build_different_process_groups_are_refused_at_join():
    """A rank whose tensors sit in host memory (an offloaded trainer, a
    worker that joins with a host tensor) among NCCL ranks would build gloo
    while the others wait in NCCL's init for ever: refused by name first."""
    cfg = GroupConfig(address="127.0.0.1:1", num_sources=2, num_destinations=2)
    cpu, gpu = torch.device("cpu"), torch.device("meta")  # (the device only travels as text)
    hellos = {}
    for r, (backend, dev) in enumerate((("nccl", gpu), ("gloo", cpu), ("nccl", gpu), ("nccl", gpu))):
        role = "source" if r < 2 else "destination"
        hellos[r], _ = joining.hello_for(cfg, r, role, dev, backend, budget_bytes=1, round_bytes=1, big_bytes=1)
    with pytest.raises(RefitError) as e:
        joining.check_hellos(hellos, cfg, 0)
    text = str(e.value)
    assert e.value.step == "join" and e.value.agreed
    assert "ranks disagree on the refit group's backend" in text
    assert "nccl (meta tensors) on rank(s) 0, 2-3; gloo (cpu tensors) on rank(s) 1" in text
    assert "Sender(device=...)" in text


def test_the_refit_groups_nccl_communicator_leaves_failures_to_reshard(monkeypatch):
    """CleanUpOnly while the communicator is built (torch reads it in the
    constructor), put back afterwards; NCCL's watchdog fires after reshard's
    own deadline."""
    import datetime

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    import os

    with joining.nccl_error_handling():
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == joining.NCCL_ERROR_HANDLING == "2"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    with joining.nccl_error_handling():
        pass
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    assert joining.nccl_timeout(datetime.timedelta(seconds=30)) > datetime.timedelta(seconds=30)


# -- devices -----------------------------------------------------------------------------

_ALLOCATORS = {
    "zeros",
    "empty",
    "ones",
    "full",
    "tensor",
    "arange",
    "randn",
    "rand",
    "randint",
    "frombuffer",
    "as_tensor",
    "eye",
    "linspace",
    "from_numpy",
}


def test_every_allocation_where_a_tensor_can_meet_a_gpu_names_its_device():
    """In transport/, receiver/, sender/ and adapters/, a tensor reshard
    allocates lands on the host unless its device is named (vLLM's GPU
    worker sets no default device), where NCCL refuses it. Each call names
    its device, or says on its line why it is on the host (``# host: ...``);
    ``*_like`` allocations take their model's device."""
    root = pathlib.Path(__file__).resolve().parent.parent / "reshard"
    bare = []
    for sub in ("transport", "receiver", "sender", "adapters"):
        for path in sorted((root / sub).rglob("*.py")):
            lines = path.read_text().splitlines()
            for node in ast.walk(ast.parse("\n".join(lines))):
                if not (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in _ALLOCATORS
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "torch"
                ):
                    continue
                if any(k.arg == "device" for k in node.keywords):
                    continue
                span = lines[node.lineno - 1 : (node.end_lineno or node.lineno)]
                if not any("# host:" in line for line in span):
                    bare.append(f"{path.relative_to(root)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert bare == []


def test_a_peft_policys_factors_are_merged_on_the_device_of_its_weights():
    from reshard.sender.gather import gather_whole
    from reshard.sender.peft import LoraLayerInfo, merged_box

    a, b = torch.randn(2, 6), torch.randn(4, 2)
    whole, received = gather_whole({"A": [(Box((0, 0), (2, 6)), a)]}, {"A": ((2, 6), "float32")}, device="meta")
    assert whole["A"].device.type == "meta" and received == 0
    info = LoraLayerInfo(name="w", kind="linear", fan_in_fan_out=False, adapters=[("x", 0.5)])
    info.factors = {"A:x": a, "B:x": b}  # gathered on the host, as before
    base = torch.zeros(4, 6, device="meta")
    merged_box(info, Box((0, 0), (4, 6)), base)  # would raise "Expected all tensors to be on the same device"
    assert base.device.type == "meta"
    host = torch.zeros(4, 6)
    merged_box(info, Box((0, 0), (4, 6)), host)
    assert torch.equal(host, (b @ a) * 0.5)


def _transfer(local: str, nbytes: int, *, recv: bool) -> Transfer:
    n = nbytes // 4
    box = Box((0, 0), (n // 8, 8))
    slot = Slot(0 if not recv else 1, box, local, (n // 8, 8), (0, 0))
    return Transfer(local, box, slot, slot, TransferKind.PULL, 0, nbytes, 0, "float32")


def test_messages_of_tensors_off_the_groups_device_are_staged_never_posted_in_place():
    """A big contiguous slice is sent and received in place, unless its
    local tensor is not on the group's device (an offloaded trainer's
    shard, a GPU worker's pinned host staging buffer): then it is staged
    through the arena, which is on the device. Messages are cut alike."""
    big = 2 << 20
    send = Round(0, sends={1: [_transfer("w", big, recv=False)]})
    recv = Round(0, recvs={0: [_transfer("w", big, recv=True)]})
    assert round_staging(send, 1 << 20)[0] == 0 and round_staging(recv, 1 << 20)[0] == 0
    off = frozenset({"w"})
    size, offsets = round_staging(send, 1 << 20, off_device=off)
    assert size == big and len(offsets) == 1
    size, offsets = round_staging(recv, 1 << 20, off_device=off)
    assert size == big and Unpacked(0, 0) in offsets
    from reshard.plan.items import RankPlan

    plan = RankPlan(rank=1, rounds=[recv], num_rounds=1)
    assert staging_need(plan, 1 << 20, off_device=off) == big > staging_need(plan, 1 << 20)


def test_which_local_tensors_are_off_the_device_is_read_from_them_unless_materialized_on_demand():
    tensors = {"a": torch.zeros(2), "b": torch.zeros(2, device="meta")}
    assert off_device_locals(Tensors(tensors), torch.device("cpu")) == {"b"}
    assert off_device_locals(_LazyOne(tensors), torch.device("cpu")) == frozenset()


def test_an_nccl_rank_whose_tensors_are_in_host_memory_posts_on_its_cuda_device():
    from reshard.transport.group import group_device

    assert group_device("auto", torch.device("cpu"), 0) == ("gloo", torch.device("cpu"))
    assert group_device("gloo", torch.device("cpu"), 0) == ("gloo", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device"):
            group_device("nccl", torch.device("cpu"), 4)
