"""``Sender(peft_model)``: a PEFT LoRA policy refits as its merged weights,
under the trainers RL stacks wrap it with, without a gather of the base.

Each run: two trainer ranks holding a LoRA policy (r=8 on every linear
layer, rank-stabilized or not, with ``modules_to_save``) under FSDP2, FSDP1,
DeepSpeed ZeRO-3 or DDP, and one receiver rank that keeps every checkpoint
tensor whole. Refit 1 (before training) and refit 2 (after two optimizer
steps of the adapter) must land, bit for bit, what PEFT's own
``merge_and_unload`` makes of the whole tensors the trainer holds; no LoRA
factor is published, the base is never all-gathered (only the factors,
counted), and the trainer's weights are untouched by the merge. Adapter
kinds reshard cannot merge exactly are refused naming the adapter and the
module."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from reshard import GroupConfig, Receiver, Sender
from reshard.testing.tiny import build_tiny_model

from . import procs
from .support import group_config
from .test_trainers import _whole
from .trainer_kinds import DENSE, Trainer, checkpoint_tensors, counting_gathers, pack, trainer_dtype, unpack

pytestmark = pytest.mark.slow

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed (scripts/trainers_setup.sh)"
)

LORA = dict(r=8, lora_alpha=16, target_modules="all-linear", modules_to_save=["lm_head"], lora_dropout=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("peft")
    return str(build_tiny_model(root / "dense", "qwen3", seed=0, torch_dtype="bfloat16", **DENSE))


def _run(rank: int, address: str, pg_port: int, kind: str, path: str, lora: dict) -> dict:
    cfg = group_config(address, 2, 1)
    if rank == 2:
        pieces, local = _whole(checkpoint_tensors(path), trainer_dtype(kind), rank)
        recv = Receiver(local, pieces, config=cfg, rank=rank)
        out: dict = {}
        for refit in (1, 2):
            st = recv.pull(refit)
            out[f"refit{refit}"] = pack(local)
            out[f"received{refit}"] = st.exec.bytes_received
        out["kept"] = sum(t.nbytes for t in local.values())
        recv.close()
        return out
    tr = Trainer(rank, 2, pg_port, kind, path, lora=lora)
    before = {n: _own(p).clone() for n, p in tr.model.named_parameters()}
    with counting_gathers() as calls:
        sender = Sender(tr.model, config=cfg)
        sender.push(1)
    untouched = all(torch.equal(_own(p), before[n]) for n, p in tr.model.named_parameters())
    ref1 = tr.gathered()
    tr.step()
    tr.step()
    with counting_gathers() as more:
        sent = sender.push(2).exec.bytes_sent
    published = [t.name for t in sender.layout.tensors]
    gathered = sender.session.tensors.gathered_bytes
    sender.close()
    ref2 = tr.gathered()
    tr.close()
    return {
        "ref1": pack(ref1),
        "ref2": pack(ref2),
        "gathers": calls + more,
        "untouched": untouched,
        "published": published,
        "gathered": gathered,
        "sent": sent,
    }


def merged(path: str, lora: dict, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's own merge (``merge_and_unload``) of a policy whose whole tensors,
    as the trainer holds them (dtypes included), are ``full``, in checkpoint names."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    policy = get_peft_model(base, LoraConfig(**lora))
    # (The ZeRO-3 trainers' extra learned scalar is no weight of the model.)
    policy.load_state_dict({k: v for k, v in full.items() if k != "temperature"}, strict=True, assign=True)
    return {k: v.detach().clone() for k, v in policy.merge_and_unload().state_dict().items()}


def _own(p: torch.Tensor) -> torch.Tensor:
    """What this rank keeps of a parameter: its DTensor shard, its ZeRO-3 partition, or itself."""
    t = getattr(p, "ds_tensor", None)
    if t is None:
        t = p.to_local() if hasattr(p, "to_local") else p
    return t.detach()


def _refit(kind: str, path: str, lora: dict) -> tuple[list[dict], dict]:
    server = procs.StoreServer()
    out = procs.check(procs.run(_run, 3, server.address, procs.free_port(), kind, path, lora, timeout=900))
    return out[:2], out[2]


@pytest.mark.parametrize(
    ("kind", "rslora"),
    [
        ("fsdp2", False),
        ("ddp", True),
        pytest.param("zero3", False, marks=needs_deepspeed),
        ("fsdp1_orig", True),
    ],
)
def test_a_lora_policy_refits_as_peft_merges_it(kind, rslora, model):
    lora = {**LORA, "use_rslora": rslora}
    trainers, recv = _refit(kind, model, lora)
    names = set(checkpoint_tensors(model))
    for refit in (1, 2):
        got = unpack(recv[f"refit{refit}"])
        ref = merged(model, lora, unpack(trainers[0][f"ref{refit}"]))
        assert set(got) == names
        for name in names:
            assert torch.equal(got[name], ref[name]), f"{kind} refit {refit}: {name}"
    # The adapter trained: refit 2 differs from refit 1 in every LoRA target.
    r1, r2 = unpack(recv["refit1"]), unpack(recv["refit2"])
    assert not torch.equal(r1["model.layers.0.self_attn.q_proj.weight"], r2["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(r1["lm_head.weight"], r2["lm_head.weight"])  # modules_to_save trained too
    for t in trainers:
        assert t["untouched"], f"{kind}: the merge wrote into the trainer's weights"
        assert not any("lora" in n for n in t["published"]), t["published"]
    # (Under FSDP1 and ZeRO-3 a rank publishes only the tensors it holds part of.)
    assert {n for t in trainers for n in t["published"]} - {"temperature"} == names
    # Each byte once; the only collective is the factors' gather (where a rank
    # does not hold them whole), and it is counted.
    assert sum(t["sent"] for t in trainers) == recv["received2"] >= recv["kept"]
    for t in trainers:
        # Three reads (the sender's construction and each push), one gather
        # each: sizes, headers, bytes.
        expected = [] if kind == "ddp" else ["all_gather"] * 3
        assert t["gathers"] == expected * 3, (kind, t["gathers"])
        assert (t["gathered"] > 0) == (kind != "ddp")


def _refused(rank: int, path: str, lora: dict) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(**lora))
    cfg = GroupConfig(address="127.0.0.1:1", num_sources=1, num_destinations=1)
    with pytest.raises(TypeError) as e:
        Sender(model, config=cfg, rank=0)
    return str(e.value)


@pytest.mark.parametrize(
    ("lora", "needle"),
    [
        (dict(r=4, target_modules=["q_proj"], use_dora=True), "self_attn.q_proj' runs adapter 'default' as Dora"),
        (dict(r=4, target_parameters=["mlp.gate_proj.weight"], target_modules=[]), "puts LoRA on parameters"),
    ],
)
def test_adapters_reshard_cannot_merge_exactly_are_refused_by_name(lora, needle, model):
    assert needle in _refused(0, model, lora)


def _gather_rank(rank: int, port: int) -> dict:
    import os

    import torch.distributed as dist

    from reshard.plan.box import Box
    from reshard.sender.gather import gather_whole

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.arange(12.0).view(3, 4)
    y = torch.arange(6, dtype=torch.bfloat16)
    # Rank 0 holds all of x and the first half of y; rank 1 only the rest of y.
    if rank == 0:
        parts = {"x": [(Box((0, 0), (3, 4)), x)], "y": [(Box((0,), (3,)), y[:3])]}
        shapes = {"x": ((3, 4), "float32"), "y": ((6,), "bfloat16")}
    else:
        parts = {"y": [(Box((3,), (3,)), y[3:])]}
        shapes = {"y": ((6,), "bfloat16")}
    whole, received = gather_whole(parts, shapes)
    dist.destroy_process_group()
    return {"x": whole["x"].tolist(), "y": whole["y"].float().tolist(), "received": received}


def test_factors_are_made_whole_even_where_a_rank_knows_only_some_of_them():
    """Under FSDP1 or ZeRO-3 a rank may hold nothing of a factor (and so not
    know its name): every rank still rebuilds every factor, from the names
    and boxes that travel with the bytes."""
    out = procs.check(procs.run(_gather_rank, 2, procs.free_port(), timeout=300))
    for o in out:
        assert o["x"] == torch.arange(12.0).view(3, 4).tolist()
        assert o["y"] == list(range(6))
    assert out[0]["received"] == 3 * 2  # y's second half, bf16
    assert out[1]["received"] == 12 * 4 + 3 * 2
