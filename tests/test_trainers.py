"""``Sender(model)`` on the trainers RL stacks run, in real processes over gloo:
DeepSpeed ZeRO-1/3 (``zero.Init``, persisted parameters, a parameter smaller
than the world, padded partitions, CPU offload, AutoEP experts in their own
group), FSDP1 with a device mesh and mixed precision, Accelerate-prepared
models (FSDP1 and ZeRO-3 configs) and DDP, each read without extra arguments.

Each runs two trainer ranks and one receiver rank that keeps every
checkpoint tensor whole: refit 1 before training must land the checkpoint
the trainer loaded, refit 2 after two optimizer steps (the sender built
before them, so the layout is re-read at the push) the weights the
framework itself gathers afterwards, bit for bit; refit 3, pushed inside
``GatheredParameters`` under ZeRO-3, the same, each rank still sending
only its own partition. Every byte moves once,
and no rank all-gathers or broadcasts anything while the sender reads and
sends. (The refits into a real vLLM engine are in
``tests/test_trainers_vllm.py``.) Also: a wrapper reshard does not know is
a clear error on every rank, and the private FSDP1 records it reads are
pinned.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from reshard import GroupConfig, Receiver, Sender
from reshard.plan.box import full_box
from reshard.plan.layout import TensorMeta
from reshard.plan.specs import PieceSpec
from reshard.testing.tiny import build_tiny_model

from . import procs
from .support import group_config
from .trainer_kinds import DENSE, Trainer, checkpoint_tensors, counting_gathers, pack, trainer_dtype, unpack

pytestmark = pytest.mark.slow

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed (scripts/trainers_setup.sh)"
)
needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="Accelerate is not installed (scripts/trainers_setup.sh)"
)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("trainers")
    return {
        "dense": str(build_tiny_model(root / "dense", "qwen3", seed=0, torch_dtype="bfloat16", **DENSE)),
        # Qwen2-MoE: routed experts, and a shared expert with its [1, H] gate.
        "moe": str(build_tiny_model(root / "moe", "qwen2_moe", seed=0, torch_dtype="bfloat16")),
        # DeepSeek-V3: sigmoid routing with e_score_correction_bias, which AutoEP
        # copies onto its router; a preset whose shared-expert gate name is empty.
        "deepseek": str(build_tiny_model(root / "deepseek", "deepseek_v3", seed=0, torch_dtype="bfloat16")),
    }


def _whole(names: dict[str, tuple[tuple[int, ...], str]], dtype: str, rank: int):
    pieces = []
    local = {}
    for name, (shape, _) in names.items():
        meta = TensorMeta(name, shape, dtype)
        pieces.append(PieceSpec(meta, full_box(shape), name, shape))
        local[name] = torch.empty(shape, dtype=getattr(torch, dtype))
    return pieces, local


def _run(rank: int, address: str, pg_port: int, kind: str, path: str) -> dict:
    cfg = group_config(address, 2, 1)
    if rank == 2:
        names = checkpoint_tensors(path)
        if kind.startswith(("zero3", "accelerate_zero3")) and "autoep" not in kind:
            names["temperature"] = ((1,), "")
        pieces, local = _whole(names, trainer_dtype(kind), rank)
        recv = Receiver(local, pieces, config=cfg, rank=rank)
        out: dict = {"received": [], "landed": []}
        for refit in (1, 2, 3):
            st = recv.pull(refit)
            out["received"].append(st.exec.bytes_received)
            out["landed"].append(st.exec.bytes_landed)
            out[f"refit{refit}"] = pack(local)
        out["kept"] = sum(t.nbytes for t in local.values())
        recv.close()
        return out
    tr = Trainer(rank, 2, pg_port, kind, path)
    with counting_gathers() as calls:
        sender = Sender(tr.model, config=cfg)  # no rank, no rename, no model type: read from the model
        sent = [sender.push(1).exec.bytes_sent]
    temperature = [
        (p.box.offsets, p.box.sizes)
        for p in sender.layout.pieces
        if sender.layout.tensors[p.tensor].name == "temperature"
    ]
    tr.step()
    tr.step()
    with counting_gathers() as more:
        sent.append(sender.push(2).exec.bytes_sent)
    left = tr.partitioned()
    layout = sender.layout
    # Refit 3 inside GatheredParameters (ZeRO-3): the whole parameters are
    # there, but the sender still reads and sends each rank's partition.
    with tr.gathering(), counting_gathers() as inside:
        sent.append(sender.push(3).exec.bytes_sent)
    same = sender.layout == layout
    sender.close()
    ref = tr.gathered()
    tr.close()
    return {
        "sent": sent,
        "gathers": calls + more + inside,
        "left": left,
        "same_layout": same,
        "temperature": temperature,
        "ref": pack(ref),
    }


def _refit(kind: str, path: str) -> tuple[list[dict], dict]:
    server = procs.StoreServer()
    out = procs.check(procs.run(_run, 3, server.address, procs.free_port(), kind, path, timeout=900))
    for t in out[:2]:
        t["ref"] = unpack(t["ref"])
    for refit in (1, 2, 3):
        out[2][f"refit{refit}"] = unpack(out[2][f"refit{refit}"])
    return out[:2], out[2]


def _check(kind: str, path: str) -> None:
    from safetensors.torch import load_file

    trainers, recv = _refit(kind, path)
    dtype = getattr(torch, trainer_dtype(kind))
    # Refit 1 (before training): the checkpoint the trainer loaded, bit for bit.
    ckpt = load_file(f"{path}/model.safetensors")
    for name, want in ckpt.items():
        assert torch.equal(recv["refit1"][name], want.to(dtype)), f"{kind} refit 1: {name}"
    # Refit 2 (after two steps): what the framework itself gathers.
    ref = {**trainers[1]["ref"], **trainers[0]["ref"]}
    changed = 0
    for name, got in recv["refit2"].items():
        assert torch.equal(got, ref[name]), f"{kind} refit 2: {name}"
        changed += name in ckpt and not torch.equal(ref[name], ckpt[name].to(dtype))
    assert changed > len(ckpt) // 2, f"{kind}: training changed only {changed} of {len(ckpt)} tensors"
    # Refit 3 (inside GatheredParameters for ZeRO-3): the same weights, sent by
    # the same ranks as refit 2, from the same layout.
    for name, got in recv["refit3"].items():
        assert torch.equal(got, ref[name]), f"{kind} refit 3: {name}"
    # Every byte once: each trainer rank sent only bytes it holds, nobody gathered.
    # (Received bytes count in the trainer's dtypes: DeepSeek-V3's
    # e_score_correction_bias travels in float32 and lands in bfloat16.)
    assert recv["landed"] == [recv["kept"]] * 3
    for i in range(3):
        assert sum(t["sent"][i] for t in trainers) == recv["received"][i] >= recv["kept"]
    for t in trainers:
        assert t["sent"][2] == t["sent"][1] and t["same_layout"]
        assert t["gathers"] == [], f"{kind}: collectives while reading and sending: {t['gathers']}"
        assert t["left"] == [], f"{kind}: ZeRO-3 parameters left gathered: {t['left'][:5]}"
    if "temperature" in recv["refit2"]:
        # One element, two ranks: rank 0 holds it, rank 1 only padding.
        assert trainers[0]["temperature"] == [((0,), (1,))]
        assert trainers[1]["temperature"] == []
        assert recv["refit1"]["temperature"].item() == 0.5 != recv["refit2"]["temperature"].item()


@needs_deepspeed
@pytest.mark.parametrize("kind", ["zero3", "zero3_offload", "zero1"])
def test_deepspeed_zero_ranks_send_what_they_hold(kind, models):
    _check(kind, models["dense"])


@needs_deepspeed
def test_deepspeed_autoep_experts_partitioned_over_their_own_group(models):
    """AutoEP at expert-parallel size 1 on Qwen2-MoE: the expert stacks are
    partitioned over the expert-data-parallel group (both ranks, a group of
    its own), the rest (the shared expert and its gate included) over the
    data-parallel group. (Qwen3-MoE at EP=2: tests/test_trainers_vllm.py.)"""
    _check("zero3_autoep1", models["moe"])


@needs_deepspeed
def test_deepspeed_autoep_deepseek_v3_router_bias_keeps_its_checkpoint_name(models):
    """AutoEP on DeepSeek-V3: the router's e_score_correction_bias (a buffer
    AutoEP copies onto its own router) goes out under the checkpoint's
    ``mlp.gate.e_score_correction_bias``, and the preset's empty
    shared-expert gate name is no pattern to refuse."""
    _check("zero3_autoep1", models["deepseek"])


def test_fsdp1_with_a_device_mesh_and_mixed_precision(models):
    _check("fsdp1_mesh", models["dense"])


def test_ddp_ranks_are_replicas(models):
    _check("ddp", models["dense"])


@needs_accelerate
@needs_deepspeed
@pytest.mark.parametrize("kind", ["accelerate_fsdp1", "accelerate_zero3"])
def test_accelerate_prepared_models_read_without_extra_arguments(kind, models):
    _check(kind, models["dense"])


# -- never silent ------------------------------------------------------------------------


class ShardedSomehow(torch.nn.Module):
    """A wrapper reshard does not know: it keeps each parameter's shard
    elsewhere and leaves the parameter empty, as ZeRO-3 does."""

    def __init__(self, model: torch.nn.Module, rank: int, world: int) -> None:
        super().__init__()
        self.inner = model
        self.shards = {}
        for n, p in model.named_parameters():
            self.shards[n] = p.detach().reshape(-1).chunk(world)[rank].clone()
            p.data = torch.empty(0, dtype=p.dtype)


@pytest.mark.parametrize("rank", [0, 1])
def test_an_unknown_wrapper_is_a_clear_error_on_every_rank(rank, models):
    from transformers import AutoModelForCausalLM

    model = ShardedSomehow(AutoModelForCausalLM.from_pretrained(models["dense"]), rank, 2)
    cfg = GroupConfig(address="127.0.0.1:1", num_sources=2, num_destinations=1)
    with pytest.raises(ValueError) as e:
        Sender(model, config=cfg, rank=rank)
    msg = str(e.value)
    assert f"rank {rank}: parameter 'inner.model.embed_tokens.weight' of ShardedSomehow is empty" in msg
    assert "not a partition reshard knows" in msg


def test_a_peft_model_publishes_its_base_models_checkpoint_names(models):
    """A PEFT policy is read as its merged weights (tests/test_peft.py checks
    the values under each trainer): the base model's names, no LoRA factor."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(models["dense"]), LoraConfig(target_modules=["q_proj"]))
    cfg = GroupConfig(address="127.0.0.1:1", num_sources=1, num_destinations=1)
    names = {t.name for t in Sender(model, config=cfg).layout.tensors}
    assert names == set(checkpoint_tensors(models["dense"]))


def test_deepspeed_moe_experts_are_refused():
    """DeepSpeed's own MoE experts (``allreduce=False``) hold other experts
    on each expert-parallel rank under one name: refused, not published as replicas."""
    w = torch.nn.Parameter(torch.zeros(4, 3))
    w.allreduce = False
    cfg = GroupConfig(address="127.0.0.1:1", num_sources=1, num_destinations=1)
    with pytest.raises(
        ValueError, match=r"rank 0: 'deepspeed_experts.0.w' of dict \(shape \[4, 3\]\) is a DeepSpeed MoE"
    ):
        Sender({"deepspeed_experts.0.w": w}, config=cfg)


def test_an_fsdp1_flat_parameter_outside_its_unit_is_refused():
    flat = torch.nn.Parameter(torch.zeros(10))
    flat._is_flat_param = True  # as FSDP1 marks its FlatParameter
    with pytest.raises(ValueError, match=r"rank 0: '_flat_param' of dict is an FSDP1 flat parameter"):
        Sender({"_flat_param": flat}, config=GroupConfig(address="127.0.0.1:1", num_sources=1, num_destinations=1))


def test_the_fsdp1_records_reshard_reads_are_there():
    """The private FSDP1 attributes ``reshard.sender.fsdp1`` relies on, in this
    torch (the FSDP1 refits use them for real; this names what broke)."""
    from torch.distributed.fsdp._flat_param import FlatParameter, _ShardParamInfo

    assert _ShardParamInfo._fields == (
        "in_shard",
        "offset_in_shard",
        "numel_in_shard",
        "intra_param_start_idx",
        "intra_param_end_idx",
    )
    for attr in (
        "_fqns",
        "_shapes",
        "_shard_param_infos",
        "_sharded_size",
        "_local_shard",
        "_params",
        "_shared_params",
    ):
        assert attr in FlatParameter.__annotations__, attr


def _zero3_like(**part_attrs) -> torch.nn.Parameter:
    """A parameter carrying ZeRO-3's records, its partition marked as given."""
    p = torch.nn.Parameter(torch.empty(0))
    p.ds_shape, p.ds_numel = torch.Size([4, 3]), 12
    p.ds_tensor = torch.zeros(12)
    p.ds_process_group = None
    for k, v in part_attrs.items():
        setattr(p.ds_tensor, k, v)
    return p


class _Status:
    name = "NOT_AVAILABLE"


@pytest.mark.parametrize(
    ("attrs", "why"),
    [
        ({"status": _Status()}, r"its partition is NOT_AVAILABLE \(swapped out to NVMe\)"),
        ({"ds_quant_scale": torch.ones(1)}, r"its partition is quantized \(zero_quantized_weights\)"),
    ],
)
def test_zero3_partitions_reshard_cannot_read_are_refused(attrs, why):
    cfg = GroupConfig(address="127.0.0.1:1", num_sources=1, num_destinations=1)
    with pytest.raises(ValueError, match=r"rank 0: ZeRO-3 parameter 'w' of dict \(shape \[4, 3\]\): " + why):
        Sender({"w": _zero3_like(**attrs)}, config=cfg)
