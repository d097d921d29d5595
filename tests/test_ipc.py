"""CUDA IPC links (``GroupConfig(shared_memory=True)`` with CUDA tensors).

On CPU: the handshake records round-trip as msgspec data, links are chosen
from the hellos alike on every rank, a group whose ranks share a GPU has no
process group and a plan that would need one is refused at the plan step
(naming the tensor and the ranks), and the plan of a colocated FSDP2 ->
vLLM TP=2 layout moves every byte directly once every source tensor is
exported. With a GPU: four real processes on one GPU refit by CUDA IPC,
bit-exact, every byte on the ``ipc`` link.
"""

from __future__ import annotations

import math

import pytest
import torch

from reshard.costmodel.rules import EngineSpec, TrainerSpec, engine_layouts, trainer_layouts
from reshard.errors import RefitError
from reshard.models import canonical_tensors
from reshard.plan.planner import Planner, RankPlan
from reshard.transport import joining, wire
from reshard.transport.execute import Executor, wire_transfers, without_direct
from reshard.transport.group import GroupConfig, RefitGroup
from reshard.transport.ipc import CudaExporter
from reshard.transport.links import no_wire_problems

from . import procs
from .support import group_config

CONFIG = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "tie_word_embeddings": False,
}


def _plans() -> dict[int, RankPlan]:
    """Trainer FSDP2 over ranks 0-1, a vLLM TP=2 engine on ranks 2-3."""
    metas = tuple(canonical_tensors(CONFIG, dtype="bfloat16"))
    t = trainer_layouts(metas, CONFIG, TrainerSpec(fsdp=2))
    e = engine_layouts(metas, CONFIG, EngineSpec(tp=2), base=2)
    planner = Planner(t.layout_set("source"), e.layout_set("destination"))
    return {r: planner.plan_for(r) for r in range(4)}


def _hello(
    rank: int, gpu: str, *, ipc_host: str = "h", gpus: tuple[str, ...] = ("GPU-a", "GPU-b"), process: str = ""
) -> wire.Hello:
    return wire.Hello(
        process=process or f"p{rank}",
        rank=rank,
        role="source" if rank < 2 else "destination",
        domain="d",
        host="h",
        pid=1000 + rank,
        device="cuda:0",
        gpu=gpu,
        gpus=gpus,
        ipc_host=ipc_host,
    )


def _group(rank: int, hellos: dict[int, wire.Hello]) -> RefitGroup:
    """The group a rank would have joined with these hellos (no store, no process group)."""
    cfg = GroupConfig(address="127.0.0.1:1", num_sources=2, num_destinations=2, shared_memory=True)
    g = RefitGroup(
        config=cfg,
        rank=rank,
        role=hellos[rank].role,
        store=None,
        pg=None,
        backend="nccl",
        hellos=hellos,
    )
    g.no_wire = joining.shared_gpus(g.hellos)
    return g


def _exports(plan: RankPlan, gpu: str, skip: str = "") -> dict[int, dict[str, wire.Export]]:
    """What source rank ``plan.rank`` publishes: every local tensor it sends (but ``skip``)."""
    out: dict[str, wire.Export] = {}
    for t in plan.transfers():
        if t.src.local in out or t.src.local == skip or t.kind == "fwd":
            continue
        shape = tuple(t.src.local_shape)
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        out[t.src.local] = wire.Export(
            local=t.src.local,
            fd=-1,
            inode=0,
            storage_bytes=1 << 20,
            dtype=t.dtype,
            shape=shape,
            stride=stride,
            offset=0,
            cuda=wire.CudaIpc(
                gpu=gpu,
                handle=b"\x01" * 64,
                storage_offset=0,
                refs=tuple(wire.IpcRef(reader=r, counter=b"/torch_1_2", counter_offset=r) for r in (2, 3)),
            ),
        )
    return {plan.rank: out}


def test_ipc_records_round_trip_as_msgspec_data():
    e = next(iter(_exports(_plans()[0], "GPU-a")[0].values()))
    msg = wire.Exports(rank=0, exports=(e,))
    back = wire.decode(wire.encode(msg), wire.Exports)
    assert back == msg and back.exports[0].cuda is not None
    assert back.exports[0].cuda.refs[1] == wire.IpcRef(reader=3, counter=b"/torch_1_2", counter_offset=3)
    h = _hello(2, "GPU-b")
    assert wire.decode(wire.encode(h), wire.Hello) == h
    # A hello from a rank without GPUs (or an older one) reads as "no IPC links".
    plain = wire.decode(wire.encode(wire.Hello(rank=0, role="source", domain="d", host="h", pid=1)), wire.Hello)
    assert (plain.gpu, plain.gpus, plain.ipc_host) == ("", (), "")


def test_links_are_chosen_from_the_hellos_alike_on_every_rank():
    hellos = {
        0: _hello(0, "GPU-a"),
        1: _hello(1, "GPU-b", ipc_host="other"),  # another host
        2: _hello(2, "GPU-a"),
        3: _hello(3, "GPU-c", gpus=("GPU-c",)),  # same host, cannot see GPU-a
    }
    for me in range(4):
        g = _group(me, hellos)
        assert g.direct_link(0, 2) == "ipc"  # one GPU
        assert g.direct_link(1, 2) == ""  # another host
        assert g.direct_link(0, 3) == ""  # a GPU it does not see
        assert g.direct_link(2, 9) == ""  # no such rank
        assert g.no_wire and "ranks 0, 2 on GPU GPU-a" in g.no_wire


def test_ranks_on_distinct_gpus_keep_the_process_group():
    # Each process sees its own GPU only (CUDA_VISIBLE_DEVICES per process).
    hellos = {r: _hello(r, g, gpus=(g,)) for r, g in enumerate(("GPU-a", "GPU-b", "GPU-b2", "GPU-a2"))}
    g = _group(0, hellos)
    assert g.no_wire == ""
    assert g.direct_link(0, 3) == ""  # rank 3 does not see GPU-a
    # A peer GPU it sees: NCCL carries the bytes (over the same NVLink), and
    # the receiver opens no CUDA context on the foreign GPU.
    hellos[3] = _hello(3, "GPU-a2", gpus=("GPU-a", "GPU-a2"))
    assert _group(0, hellos).direct_link(0, 3) == ""
    # Unless both ranks are one process (TRL's colocate mode): read in-process.
    hellos[0] = _hello(0, "GPU-a", process="one")
    hellos[3] = _hello(3, "GPU-a2", gpus=("GPU-a", "GPU-a2"), process="one")
    g = _group(3, hellos)
    assert g.direct_link(0, 3) == "ipc" and g.same_process(0) and not g.same_process(1)


def test_a_source_read_by_its_own_process_is_shared_without_an_ipc_handle():
    """CUDA refuses to open an IPC handle in the process that made it: a
    reader in the exporting process takes the storage itself (a key into
    this process's exports), and no handle is registered for it."""
    from reshard.transport import ipc

    shared = ipc._Shared(torch.zeros(8).untyped_storage())
    shared.share_locally()
    try:
        assert shared.local and ipc.local_storage(shared.local) is shared.storage
        assert shared.handle == b"" and shared.refs == {}
        # The receiver keys it by that, never by a handle.
        e = wire.Export(
            local="w",
            fd=-1,
            inode=0,
            storage_bytes=32,
            dtype="float32",
            shape=(8,),
            stride=(1,),
            offset=0,
            cuda=wire.CudaIpc(gpu="GPU-a", handle=b"", storage_offset=0, local=shared.local),
        )
        assert ipc.CudaImports.key(1, e, local=True) == ("local", shared.local, 32)
    finally:
        shared.drop()
    with pytest.raises(RuntimeError, match="exported in this process"):
        ipc.local_storage(shared.local or 1)


@pytest.mark.parametrize("gpus", [("GPU-a",) * 4, ("GPU-a", "GPU-b", "GPU-a", "GPU-b")], ids=["one-gpu", "two-gpus"])
def test_colocated_fsdp_to_tp2_moves_every_byte_directly_when_every_source_tensor_is_exported(gpus):
    """All four ranks on one GPU, or trainer rank i and engine worker i on
    GPU i of a host whose processes see both GPUs (as torchrun and vLLM's
    workers do): each worker also needs the other GPU's trainer shard, and
    reads it from that GPU directly (peer to peer), with no NCCL at all."""
    plans = _plans()
    hellos = {r: _hello(r, gpus[r]) for r in range(4)}
    exports = {**_exports(plans[0], gpus[0]), **_exports(plans[1], gpus[1])}
    total = sum(t.nbytes for r in (2, 3) for t in plans[r].transfers())
    moved = 0
    for r, plan in plans.items():
        g = _group(r, hellos)
        assert no_wire_problems(g, plan, tuple(exports.get(r, {}).values())) == ()
        direct_in: dict = {}
        left = without_direct(g, plan, exports, direct_in, {})
        assert wire_transfers(left) == [], r
        moved += sum(t.nbytes for ts in direct_in.values() for _, t in ts)
    assert moved == total > 0


def test_a_plan_that_needs_the_missing_process_group_is_refused_naming_tensor_and_ranks():
    plans = _plans()
    hellos = {r: _hello(r, "GPU-a") for r in range(4)}
    skipped = plans[0].transfers()[0].src.local
    mine = _exports(plans[0], "GPU-a", skip=skipped)
    g = _group(0, hellos)
    (problem,) = no_wire_problems(g, plans[0], tuple(mine[0].values()), f"tensor {skipped!r}: expandable segments")
    assert problem.kind == "link" and problem.ranks[0] == 0 and len(problem.ranks) > 1
    assert "not exported by its sender" in problem.message and "NCCL refuses two ranks" in problem.message
    assert problem.message.endswith(f"rank 0 did not export: tensor {skipped!r}: expandable segments")
    # The receiver's executor refuses too, before posting anything.
    with pytest.raises(RefitError, match="must cross the process group"):
        Executor(_group(2, hellos), plans[2], exports={**mine, **_exports(plans[1], "GPU-a")})
    # Ranks that cannot map the GPU at all (no shared_memory): the reason names them.
    blind = {r: _hello(r, "GPU-a", ipc_host="") for r in range(4)}
    (problem,) = no_wire_problems(_group(0, blind), plans[0], ())
    assert "cannot map rank 0's GPU" in problem.message


def test_the_cuda_exporter_describes_only_cuda_tensors_that_someone_reads():
    ex = CudaExporter()
    assert ex.exports({"w": torch.zeros(4)}, {"w": {2}}, epoch=0) == ()
    assert "not strided CUDA tensors" in ex.refused
    assert ex.exports({"w": torch.zeros(4)}, {}, epoch=0) == () and ex.refused == ""


# -- with a GPU ------------------------------------------------------------------


def _colocated_gpu(rank: int, address: str, refits: list[int]) -> list[dict]:
    """Ranks 0-1 hold row halves of ``w``, ranks 2-3 keep column halves; all
    four on ``cuda:0``. The trainers rewrite their halves in place between refits."""
    from reshard.plan.box import Box
    from reshard.plan.layout import TensorMeta
    from reshard.plan.specs import PieceSpec
    from reshard.receiver import Receiver
    from reshard.sender import Sender

    meta = TensorMeta("w", (256, 96), "bfloat16")

    def full(n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(n)
        return torch.randn(meta.shape, generator=g).to(torch.bfloat16).cuda()

    cfg = group_config(address, 2, 2, shared_memory=True)
    out = []
    if rank < 2:
        local = full(1)[rank * 128 : (rank + 1) * 128].clone()
        s = Sender.from_pieces(
            [PieceSpec(meta, Box((rank * 128, 0), (128, 96)), "w", (128, 96))], {"w": local}, config=cfg, rank=rank
        )
        for n in refits:
            local.copy_(full(n)[rank * 128 : (rank + 1) * 128])
            out.append(dict(s.push(n).exec.send_by_link))
        s.close()
        return out
    j = rank - 2
    dst = torch.zeros(256, 48, dtype=torch.bfloat16, device="cuda")
    r = Receiver({"w": dst}, [PieceSpec(meta, Box((0, j * 48), (256, 48)), "w", (256, 48))], config=cfg, rank=rank)
    for n in refits:
        st = r.pull(n)
        exact = torch.equal(dst.view(torch.int16), full(n)[:, j * 48 : (j + 1) * 48].view(torch.int16))
        out.append({"exact": exact, **st.exec.recv_by_link})
    r.close()
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_four_processes_on_one_gpu_refit_by_cuda_ipc_bit_exactly():
    server = procs.StoreServer()
    out = procs.check(procs.run(_colocated_gpu, 4, server.address, [1, 2, 3], timeout=300))
    for per_refit in out[2:]:
        assert per_refit == [{"exact": True, "ipc": 256 * 48 * 2}] * 3
