"""Megatron-Core trainers (megatron-core 0.19, CPU, gloo, local spec) as senders.

One world of 4 trainer ranks and 2 receiver ranks runs every scenario in
turn (Megatron's imports dominate the cost, so they are paid once). Each
trainer builds a tiny GPTModel, fills it from a checkpoint by the reference
conversion in ``tests/megatron_support.py`` and pushes with
:func:`reshard.adapters.megatron.megatron_sender`; receivers hold the
checkpoint tensors in another layout and compare what arrives bit for bit.
"""

from __future__ import annotations

import importlib.util
import os
import traceback
from types import SimpleNamespace

import pytest
import torch

from reshard.plan.box import Box, chunk_range, merge_boxes
from reshard.plan.layout import Slot, TensorMeta
from reshard.sender.megatron import MegatronRanks, checkpoint_recipe, megatron_pieces

from . import procs
from .megatron_support import hf_config
from .support import group_config

# The test process never imports Megatron itself (its ranks do): a spec lookup is enough.
needs_megatron = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed",
)

TRAINERS, RECEIVERS = 4, 2

SCENARIOS = {
    # One KV head, TP 2: each rank holds part of the only query group; tied embeddings; 2 DP replicas.
    "llama-tp2-dp2": dict(kind="llama", tp=2, pp=1, ep=1, etp=1, receivers="rows3"),
    # qkv bias, vocabulary padding (500 -> 512), one layer per pipeline stage.
    "qwen2-tp2-pp2": dict(kind="qwen2", tp=2, pp=2, ep=1, etp=1, receivers="full_cols"),
    # qk-norm, experts over EP 2 with whole experts (ETP 1) and 2 expert-DP replicas.
    "qwen3moe-tp2-ep2": dict(kind="qwen3_moe", tp=2, pp=1, ep=2, etp=1, receivers="rows3"),
    # Pipeline stages and experts together.
    "qwen3moe-tp2-pp2-ep2": dict(kind="qwen3_moe", tp=2, pp=2, ep=2, etp=1, receivers="full_cols"),
    # MLA, dense first layer, shared expert, router expert bias, experts cut over ETP 2.
    "deepseek-tp2-ep2-etp2": dict(kind="deepseek_v3", tp=2, pp=1, ep=2, etp=2, receivers="rows3"),
}


def _group(address: str, job: str):

    return group_config(address, TRAINERS, RECEIVERS, job=job)


def _trainer(rank: int, address: str, pg_port: int, paths: dict[str, str]) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from reshard.adapters.megatron import megatron_sender

    from .megatron_support import build_gpt, cpu_workarounds, init_parallel, load_reference

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank, world_size=TRAINERS)
    cpu_workarounds()
    out: dict[str, dict] = {}
    for name, sc in SCENARIOS.items():
        try:
            hf = hf_config(sc["kind"])
            init_parallel(sc["tp"], sc["pp"], sc["ep"], sc["etp"])
            model = build_gpt(hf, tp=sc["tp"], pp=sc["pp"], ep=sc["ep"], etp=sc["etp"])
            load_reference(model, load_file(paths[sc["kind"]]), hf, sc["tp"])
            sender = megatron_sender(model, config=_group(address, name), hf_config=hf)
            layout = sender.layout
            pieces = [(layout.tensors[p.tensor].name, p.box.offsets, p.box.sizes) for p in layout.pieces]
            held = sum(t.numel() * t.element_size() for t in model.state_dict().values() if torch.is_tensor(t))
            try:
                st = sender.push(1)
            finally:
                sender.close()
            out[name] = {
                "pieces": pieces,
                "held": held,
                "sent": st.exec.bytes_sent,
                "received": st.exec.bytes_received,
                "sent_by_peer": dict(st.exec.send_by_peer),
            }
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        finally:
            ps.destroy_model_parallel()
    dist.destroy_process_group()
    return out


def _receiver_boxes(kind: str, shape: tuple[int, ...], index: int) -> list[Box]:
    """Boxes receiver ``index`` needs: ``rows3`` cuts dim 0 in 3 (parts 0, 2
    to receiver 0, part 1 to receiver 1); ``full_cols``: receiver 0 takes the
    whole tensor, receiver 1 the second half of the last dim."""
    nd = len(shape)
    boxes = []
    if kind == "rows3":
        for part in range(3):
            if part % 2 != index:
                continue
            lo, hi = chunk_range(shape[0], 3, part)
            if hi > lo:
                boxes.append(Box((lo,) + (0,) * (nd - 1), (hi - lo, *shape[1:])))
    elif index == 0:
        boxes.append(Box((0,) * nd, shape))
    else:
        lo, hi = chunk_range(shape[-1], 2, 1)
        if hi > lo:
            boxes.append(Box((0,) * (nd - 1) + (lo,), (*shape[:-1], hi - lo)))
    return boxes


def _receiver(rank: int, address: str, paths: dict[str, str]) -> dict:
    from safetensors.torch import load_file

    from reshard.plan.specs import PieceSpec
    from reshard.receiver import Receiver

    index = rank - TRAINERS
    out: dict[str, dict] = {}
    for name, sc in SCENARIOS.items():
        try:
            ckpt = load_file(paths[sc["kind"]])
            pieces, locals_, want = [], {}, {}
            for tname, t in ckpt.items():
                meta = TensorMeta(tname, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                for i, box in enumerate(_receiver_boxes(sc["receivers"], meta.shape, index)):
                    local = f"{tname}#{i}"
                    # NaN-filled: a region no byte reached cannot pass for a match.
                    locals_[local] = torch.full(box.sizes, float("nan"), dtype=t.dtype)
                    want[local] = t[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
                    pieces.append(PieceSpec(meta, box, local, box.sizes))
            rcv = Receiver(locals_, pieces, config=_group(address, name), rank=rank)
            try:
                st = rcv.pull(1)
            finally:
                rcv.close()
            bad = [k for k, t in locals_.items() if not torch.equal(t.view(torch.int32), want[k].view(torch.int32))]
            kept = sum(t.numel() * t.element_size() for t in locals_.values())
            out[name] = {"bad": bad, "received": st.exec.bytes_received, "kept": kept, "checked": len(locals_)}
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


def _rank_main(rank: int, address: str, pg_port: int, paths: dict[str, str]) -> dict:
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    if rank < TRAINERS:
        return _trainer(rank, address, pg_port, paths)
    return _receiver(rank, address, paths)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from safetensors.torch import save_file

    from reshard.models import canonical_tensors

    from .megatron_support import random_checkpoint

    root = tmp_path_factory.mktemp("megatron")
    paths: dict[str, str] = {}
    tables: dict[str, tuple[TensorMeta, ...]] = {}
    for seed, kind in enumerate(sorted({sc["kind"] for sc in SCENARIOS.values()})):
        tables[kind] = tuple(canonical_tensors(hf_config(kind), dtype="float32"))
        paths[kind] = str(root / f"{kind}.safetensors")
        save_file(random_checkpoint(tables[kind], seed), paths[kind])
    server = procs.StoreServer()
    outs = procs.check(
        procs.run(_rank_main, TRAINERS + RECEIVERS, server.address, procs.free_port(), paths, timeout=600)
    )
    return SimpleNamespace(trainers=outs[:TRAINERS], receivers=outs[TRAINERS:], tables=tables)


def _ok(out: dict, name: str) -> dict:
    r = out[name]
    assert "error" not in r, r.get("error")
    return r


@needs_megatron
@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_checkpoint_tensors_arrive_bit_exactly(world, name):
    for t in world.trainers:
        _ok(t, name)
    for r in world.receivers:
        res = _ok(r, name)
        assert res["checked"] > 0
        assert not res["bad"], res["bad"]
        assert res["received"] == res["kept"]


@needs_megatron
@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_trainer_ranks_send_only_their_own_slices(world, name):
    table = world.tables[SCENARIOS[name]["kind"]]
    full_bytes = sum(m.nbytes for m in table)
    outs = [_ok(t, name) for t in world.trainers]
    for o in outs:
        # Nothing is gathered on the trainer: no rank receives a byte, and
        # none sends any receiver more than it holds itself.
        assert o["received"] == 0
        assert o["held"] < full_bytes
        assert all(n <= o["held"] for n in o["sent_by_peer"].values())
    # Every byte a receiver keeps was sent once, by some trainer.
    assert sum(o["sent"] for o in outs) == sum(_ok(r, name)["received"] for r in world.receivers)
    # Together the trainers publish exactly the checkpoint's tensors.
    assert {p[0] for o in outs for p in o["pieces"]} == {m.name for m in table}


def _merged(pairs) -> dict[str, list[Box]]:
    by: dict[str, list[Box]] = {}
    for tname, box in pairs:
        by.setdefault(tname, []).append(box)
    return {k: merge_boxes(v) for k, v in by.items()}


@needs_megatron
@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_plan_rules_give_the_adapters_layouts(world, name):
    from reshard.costmodel.rules import TrainerSpec, trainer_layouts

    from .support import expand

    sc = SCENARIOS[name]
    table = world.tables[sc["kind"]]
    dp = TRAINERS // (sc["tp"] * sc["pp"])
    spec = TrainerSpec(tp=sc["tp"], pp=sc["pp"], ep=sc["ep"], etp=sc["etp"], dp=dp)
    side = trainer_layouts(table, hf_config(sc["kind"]), spec)
    # With the local spec Megatron cuts MLA's down-projections over TP; the
    # rules follow the Transformer Engine spec, which replicates them.
    local_spec_only = ("q_a_proj", "kv_a_proj_with_mqa")
    for rank, t in enumerate(world.trainers):
        ours = _merged((n, Box(tuple(o), tuple(s))) for n, o, s in _ok(t, name)["pieces"])
        rules = _merged((m.name, slot.box) for m, slot in expand(side.layout_of(rank)))
        for k in set(ours) | set(rules):
            if any(x in k for x in local_spec_only):
                continue
            assert ours.get(k) == rules.get(k), (rank, k, ours.get(k), rules.get(k))


# -- without processes ---------------------------------------------------------


def test_checkpoint_names():
    cases = {
        "embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",)),
        "decoder.layers.7.self_attention.linear_qkv.bias": (
            "qkv",
            tuple(f"model.layers.7.self_attn.{x}_proj.bias" for x in "qkv"),
        ),
        "decoder.layers.7.self_attention.linear_qkv.layer_norm_weight": (
            "copy",
            ("model.layers.7.input_layernorm.weight",),
        ),
        "decoder.layers.3.mlp.experts.17.linear_fc1.weight": (
            "gated",
            ("model.layers.3.mlp.experts.17.gate_proj.weight", "model.layers.3.mlp.experts.17.up_proj.weight"),
        ),
        "decoder.layers.3.mlp.router.weight": ("copy", ("model.layers.3.mlp.gate.weight",)),
        "decoder.layers.3.self_attention.q_layernorm.weight": ("copy", ("model.layers.3.self_attn.q_norm.weight",)),
    }
    for name, want in cases.items():
        assert checkpoint_recipe(name, model_type="qwen3_moe") == want, name
    assert checkpoint_recipe("decoder.layers.1.self_attention.q_layernorm.weight", mla=True) == (
        "copy",
        ("model.layers.1.self_attn.q_a_layernorm.weight",),
    )
    assert checkpoint_recipe("decoder.layers.1.mlp.shared_experts.linear_fc2.weight", model_type="qwen2_moe") == (
        "copy",
        ("model.layers.1.mlp.shared_expert.down_proj.weight",),
    )
    assert checkpoint_recipe("decoder.layers.1.mlp.shared_experts.linear_fc2.weight", model_type="deepseek_v3") == (
        "copy",
        ("model.layers.1.mlp.shared_experts.down_proj.weight",),
    )
    assert checkpoint_recipe("decoder.layers.1.self_attention.core_attention.foo") is None


@needs_megatron
def test_mtp_layers_are_published_under_the_checkpoint_names():
    """Megatron's ``mtp.layers.0.*`` (its norms, projection and transformer
    layer) as a DeepSeek-V3 checkpoint names the MTP layer,
    ``model.layers.{num_layers}.*``: the decoder layer's tensors as the last
    layer's (MoE), and ``enorm``, ``hnorm``, ``eh_proj``,
    ``shared_head.norm``. (The MTP layer's embedding and head are the
    policy's in Megatron, and vLLM's drafter shares them by reference.)"""
    from .megatron_support import mtp_names

    (names,) = procs.check(procs.run(mtp_names, 1, procs.free_port(), timeout=300))
    hidden = hf_config("deepseek_v3")["hidden_size"]
    mtp = {k.removeprefix("model.layers.2."): v for k, v in names.items() if k.startswith("model.layers.2.")}
    last = {k.removeprefix("model.layers.1."): v for k, v in names.items() if k.startswith("model.layers.1.")}
    own = {
        "enorm.weight": [hidden],
        "hnorm.weight": [hidden],
        "eh_proj.weight": [hidden, 2 * hidden],
        "shared_head.norm.weight": [hidden],
    }
    assert mtp == {**last, **own}


def _legacy_grouped_chunk(etp_rank: int, etp: int, ref: dict[str, torch.Tensor], hidden: int, ffn: int):
    """A module shaped like mcore <= 0.16's legacy GroupedMLP on layer 3 with
    local experts 2 and 3: ``weight1`` viewed as ``(E, H, 2F/etp)``,
    ``weight2`` as ``(E, F/etp, H)``."""
    from torch import nn

    fc1, fc2 = [], []
    for e in (2, 3):
        p = f"model.layers.3.mlp.experts.{e}."
        gate = ref[p + "gate_proj.weight"].chunk(etp)[etp_rank]
        up = ref[p + "up_proj.weight"].chunk(etp)[etp_rank]
        fc1.append(torch.cat([gate, up]).T)  # [H, 2F/etp]
        fc2.append(ref[p + "down_proj.weight"].chunk(etp, dim=1)[etp_rank].T)  # [F/etp, H]
    experts = nn.Module()
    experts.weight1 = nn.Parameter(torch.stack(fc1).reshape(hidden, -1))
    experts.weight2 = nn.Parameter(torch.stack(fc2).reshape(-1, hidden))
    mlp = nn.Module()
    mlp.experts = experts
    mlp.local_expert_indices = [2, 3]
    layer = nn.Module()
    layer.mlp = mlp
    layer.layer_number = 4
    decoder = nn.Module()
    decoder.layers = nn.ModuleList([layer])
    chunk = nn.Module()
    chunk.decoder = decoder
    chunk.config = SimpleNamespace(hidden_size=hidden, gated_linear_unit=True)
    return chunk


@pytest.mark.parametrize("etp", [1, 2])
def test_legacy_grouped_gemm_weights(etp):
    hidden, ffn = 8, 6
    g = torch.Generator().manual_seed(0)
    ref = {}
    for e in (2, 3):
        p = f"model.layers.3.mlp.experts.{e}."
        ref[p + "gate_proj.weight"] = torch.randn(ffn, hidden, generator=g)
        ref[p + "up_proj.weight"] = torch.randn(ffn, hidden, generator=g)
        ref[p + "down_proj.weight"] = torch.randn(hidden, ffn, generator=g)
    from .support import local_view

    covered: dict[str, int] = {}
    for r in range(etp):
        chunk = _legacy_grouped_chunk(r, etp, ref, hidden, ffn)
        pieces, tensors = megatron_pieces(
            chunk, hf_config={"model_type": "qwen3_moe"}, ranks=MegatronRanks(etp_rank=r, etp_size=etp)
        )
        assert set(tensors) == {"decoder.layers.0.mlp.experts.weight1", "decoder.layers.0.mlp.experts.weight2"}
        for p in pieces:
            slot = Slot(0, p.box, p.local, p.local_shape, p.offset, p.dims)
            got = local_view(tensors[p.local], slot, p.box)
            want = ref[p.tensor.name][tuple(slice(o, o + s) for o, s in zip(p.box.offsets, p.box.sizes))]
            assert torch.equal(got, want), (p.tensor.name, p.box)
            covered[p.tensor.name] = covered.get(p.tensor.name, 0) + p.box.numel
    assert covered == {k: v.numel() for k, v in ref.items()}


def _qkv_chunk(heads: int, groups: int, hd: int, hidden: int, tp: int, rank: int):
    """A module with only layer 0's ``linear_qkv`` as Megatron shards it."""
    from torch import nn

    rows = (heads + 2 * groups) * hd
    w = nn.Parameter(torch.arange(rows * hidden, dtype=torch.float32).reshape(rows, hidden).chunk(tp)[rank].clone())
    w.tensor_model_parallel = True  # type: ignore[attr-defined]
    w.partition_dim = 0  # type: ignore[attr-defined]
    attn = nn.Module()
    attn.linear_qkv = nn.Module()
    attn.linear_qkv.weight = w
    layer = nn.Module()
    layer.self_attention = attn
    layer.layer_number = 1
    chunk = nn.Module()
    chunk.decoder = nn.Module()
    chunk.decoder.layers = nn.ModuleList([layer])
    chunk.config = SimpleNamespace(num_attention_heads=heads, num_query_groups=groups, kv_channels=hd)
    return chunk


@pytest.mark.parametrize(
    ("heads", "groups", "tp"), [(4, 2, 2), (4, 1, 2), (4, 1, 4), (8, 2, 4), (6, 2, 4), (8, 8, 2), (8, 2, 8)]
)
def test_plan_rules_for_qkv_match_the_adapter(heads, groups, tp):
    """Fewer KV heads than TP ranks: a rank holds a contiguous 1/tp of the
    fused rows. The rules give the same boxes, or refuse when no grid can."""
    from reshard.costmodel.rules import TrainerSpec, trainer_layouts

    from .support import expand

    hd, hidden = 4, 8
    table = (
        TensorMeta("model.layers.0.self_attn.q_proj.weight", (heads * hd, hidden), "float32"),
        TensorMeta("model.layers.0.self_attn.k_proj.weight", (groups * hd, hidden), "float32"),
        TensorMeta("model.layers.0.self_attn.v_proj.weight", (groups * hd, hidden), "float32"),
    )
    ours = []
    for r in range(tp):
        pieces, _ = megatron_pieces(
            _qkv_chunk(heads, groups, hd, hidden, tp, r),
            hf_config={"model_type": "llama"},
            ranks=MegatronRanks(tp_rank=r, tp_size=tp),
        )
        ours.append(_merged((p.tensor.name, p.box) for p in pieces))
    # Every row of q, k and v is published exactly once.
    for m in table:
        assert sum(b.numel for o in ours for b in o.get(m.name, [])) == m.shape[0] * hidden
    config = {"num_attention_heads": heads, "num_key_value_heads": groups, "num_hidden_layers": 1}
    try:
        side = trainer_layouts(table, config, TrainerSpec(tp=tp))
    except ValueError as e:
        assert "no grid rule" in str(e)
        assert (heads, groups, tp) in {(8, 2, 4), (6, 2, 4), (8, 2, 8)}
        return
    for r in range(tp):
        assert ours[r] == _merged((m.name, s.box) for m, s in expand(side.layout_of(r))), r


# -- a real vLLM engine ----------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen2"])
def engine_run(request, tmp_path_factory):
    """Qwen2 (GQA, QKV biases through Megatron's fused QKV); Megatron Llama
    into vLLM runs in ``examples/megatron_to_vllm.py``."""
    from reshard.testing.tiny import build_tiny_model

    from .megatron_support import engine_scenario

    root = tmp_path_factory.mktemp(f"megatron-vllm-{request.param}")
    v1 = build_tiny_model(root / "v1", request.param, seed=0)
    v2 = build_tiny_model(root / "v2", request.param, seed=7)
    server = procs.StoreServer()
    out = procs.check(procs.run(engine_scenario, 1, str(v1), str(v2), server.address, 2, timeout=900, daemon=False))
    return out[0]


@needs_megatron
@pytest.mark.engine
@pytest.mark.slow
def test_vllm_engine_refit_from_megatron_tp2(engine_run):
    r = engine_run
    assert r["error"] is None, r["error"]
    assert all("error" not in t for t in r["trainers"]), r["trainers"]
    # The engine now generates what a fresh engine on the checkpoint does.
    assert r["before"] != r["fresh_v2"], "the two checkpoints must generate differently"
    assert r["after"] == r["fresh_v2"]
    # Every parameter equals what vLLM's own loader makes of the checkpoint.
    (ours,), (ref,) = r["digests"], r["reference_digests"]
    extra = ours.keys() - ref.keys()
    assert extra <= {"lm_head.weight"}  # a tied head is the embedding's own tensor
    for k in extra:
        assert ours[k] == ours["model.embed_tokens.weight"]
    assert not [k for k in ref if ours[k] != ref[k]]
    # The trainers gathered nothing and each sent at most what it holds.
    (stats,) = r["stats"]
    for t in r["trainers"]:
        assert t["received"] == 0
        assert 0 < t["sent"] <= t["held"]
    assert sum(t["sent"] for t in r["trainers"]) == stats["bytes_received"] == stats["kept_bytes"]
