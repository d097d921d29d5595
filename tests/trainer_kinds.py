"""Trainer ranks as the RL stacks run them, on CPU over gloo, for the sender
tests: DeepSpeed ZeRO-1/2/3 (``zero.Init``, AutoEP expert groups), FSDP1
(``use_orig_params`` True and False, with a device mesh, mixed precision),
Accelerate-prepared models (FSDP1 and ZeRO-3 configs) and DDP.

Every kind loads the same checkpoint, takes optimizer steps on its own
batch per rank, and can return its weights gathered the framework's own
way (``GatheredParameters``, FSDP1's full state dict), in checkpoint names:
the reference a refit must reproduce. The ZeRO-3 kinds add a learned
one-element ``temperature`` (smaller than the world: one rank holds it, the
other only padding), which no engine needs.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from typing import Any

DENSE = dict(hidden_size=127, vocab_size=501)
"""An odd hidden size and vocabulary: most tensors have an odd number of
elements, so ZeRO-3 pads their last partition at 2 ranks, and FSDP1 chunks
cut through rows."""

DEEPSPEED = ("zero1", "zero2", "zero3", "zero3_offload", "zero3_autoep1", "zero3_autoep2", "accelerate_zero3")
FSDP1 = ("fsdp1_orig", "fsdp1_flat", "fsdp1_mesh", "accelerate_fsdp1")
KINDS = (*DEEPSPEED, *FSDP1, "ddp", "fsdp2")
LR = 1e-2


def trainer_dtype(kind: str) -> str:
    """The dtype the trainer keeps its weights in (what it publishes)."""
    return "float32" if kind in ("fsdp1_orig", "fsdp1_mesh", "accelerate_fsdp1", "ddp", "fsdp2") else "bfloat16"


_AUTOEP_PRESETS = {"qwen2_moe": "qwen3_moe"}
"""DeepSpeed's AutoEP preset per model type (by default, the model type)."""


def _model_type(path: str) -> str:
    import json

    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["model_type"]


def _ds_config(kind: str, model_type: str = "qwen2_moe") -> dict[str, Any]:
    stage = 1 if kind == "zero1" else 2 if kind == "zero2" else 3
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        # Tensors under 200 elements (norms, the temperature) are persisted:
        # whole on every rank between steps, their partition still in ds_tensor.
        zero["stage3_param_persistence_threshold"] = 200
    if kind == "zero3_offload":
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # A torch optimizer (DeepSpeed's own would compile its CPU Adam first).
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
    }
    if kind.startswith("zero3_autoep"):
        cfg["expert_parallel"] = {
            "enabled": True,
            "autoep_size": int(kind[-1]),
            "preset_model": _AUTOEP_PRESETS.get(model_type, model_type),
            "use_grouped_mm": False,
        }
    return cfg


def _env(rank: int, world: int, pg_port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(pg_port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        DS_ACCELERATOR="cpu",
    )


def _add_temperature(model) -> None:
    """A learned scalar on the root module, used in the loss (added by a
    forward hook, while ZeRO-3 has the root's own parameters fetched)."""
    import torch

    model.temperature = torch.nn.Parameter(torch.full((1,), 0.5, dtype=model.dtype))

    def hook(mod, args, kwargs, out):
        out.loss = out.loss + (mod.temperature.float() - 1).square().sum()
        return out

    model.register_forward_hook(hook, with_kwargs=True)


class Trainer:
    """One rank of a trainer of ``kind`` on the checkpoint at ``path``:
    ``model`` is what the user hands ``Sender`` (the engine or wrapper).
    ``lora``: the model is a PEFT LoRA policy of this ``LoraConfig``
    (keywords), wrapped before the trainer wraps it, as TRL and Accelerate
    do; its B factors start from seeded noise, not zero, so the merged
    weights differ from the base from the first refit on."""

    def __init__(self, rank: int, world: int, pg_port: int, kind: str, path: str, *, lora: dict | None = None) -> None:
        import torch

        if kind not in KINDS:
            raise ValueError(f"unknown trainer kind {kind!r}")
        _env(rank, world, pg_port)
        self.rank, self.world, self.kind, self.path = rank, world, kind, path
        self.lora = lora
        dtype = getattr(torch, trainer_dtype(kind))
        g = torch.Generator().manual_seed(100 + rank)
        self.batch = torch.randint(4, 500, (2, 12), generator=g)
        self._keep: list[Any] = []
        if kind in DEEPSPEED:
            self._deepspeed(dtype)
        elif kind == "accelerate_fsdp1":
            self._accelerate_fsdp1(dtype)
        else:
            self._torch(dtype)

    # -- building ------------------------------------------------------------------

    def _load(self, dtype) -> Any:
        """The checkpoint, as a PEFT policy when ``lora`` says so."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype)
        if self.lora is None:
            return model
        import torch
        from peft import LoraConfig, get_peft_model

        # DeepSpeed keeps one dtype for every trainable parameter: adapters in
        # the model's dtype there (PEFT's default upcasts them to float32).
        model = get_peft_model(model, LoraConfig(**self.lora), autocast_adapter_dtype=self.kind not in DEEPSPEED)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".lora_B." in n or ".lora_embedding_B." in n:
                    p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.05)
        return model

    def _deepspeed(self, dtype) -> None:
        import deepspeed
        import torch

        ds_cfg = _ds_config(self.kind, _model_type(self.path))
        if self.kind == "accelerate_zero3":
            from accelerate import Accelerator
            from accelerate.utils import DeepSpeedPlugin

            os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
            self.acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_cfg, zero3_init_flag=True))
            # from_pretrained under accelerate's ZeRO-3 plugin builds the model in zero.Init.
            model = self._load(dtype)
            _add_temperature(model)
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            self.model, self.opt = self.acc.prepare(model, opt)
            return
        deepspeed.init_distributed(dist_backend="gloo")
        if self.kind in ("zero3", "zero3_offload"):
            from transformers.integrations import HfDeepSpeedConfig

            # transformers builds the model in zero.Init while this object lives.
            self._keep.append(HfDeepSpeedConfig(ds_cfg))
        model = self._load(dtype)
        if self.kind in ("zero3", "zero3_offload"):
            assert hasattr(model.get_input_embeddings().weight, "ds_id"), "zero.Init did not partition the model"
        if self.kind.startswith("zero3") and "autoep" not in self.kind:
            _add_temperature(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        self.model, self.opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)

    def _accelerate_fsdp1(self, dtype) -> None:
        import torch
        import torch.distributed as dist
        from accelerate import Accelerator
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        dist.init_process_group("gloo", rank=self.rank, world_size=self.world)
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=1,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["Qwen3DecoderLayer"],
            use_orig_params=True,
        )
        self.acc = Accelerator(fsdp_plugin=plugin)
        # Accelerate turns FSDP on only on accelerators; on this CPU the test
        # sets the state it would have on GPUs (its prepare then wraps in FSDP1
        # with device_id=cpu, as on a GPU with device_id=cuda:i).
        self.acc.state.distributed_type = DistributedType.FSDP
        self.acc.state.fsdp_plugin = plugin
        model = self._load(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        self.model, self.opt = self.acc.prepare(model, opt)
        assert type(self.model).__name__ == "FullyShardedDataParallel", type(self.model)

    def _torch(self, dtype) -> None:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=self.rank, world_size=self.world)
        model = self._load(dtype)
        if self.kind == "ddp":
            self.model = torch.nn.parallel.DistributedDataParallel(model)
        elif self.kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            from tests.trainers import decoder_layers

            mesh = init_device_mesh("cpu", (self.world,))
            for layer in decoder_layers(model):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.model = model
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
            from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

            from tests.trainers import decoder_layers

            layer_cls = type(decoder_layers(model)[0])
            policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer_cls})
            if self.lora is not None:
                from peft.utils.other import fsdp_auto_wrap_policy

                # As Accelerate wraps a PEFT model: the LoRA modules in units of their own.
                policy = fsdp_auto_wrap_policy(model)
            kwargs: dict[str, Any] = dict(
                auto_wrap_policy=policy,
                use_orig_params=self.kind == "fsdp1_orig",
                device_id=torch.device("cpu"),
            )
            if self.kind in ("fsdp1_orig", "fsdp1_mesh") and self.lora is None:
                # Computes in bf16, keeps (and publishes) float32 (a LoRA
                # policy computes in float32: its adapters keep float32).
                kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16)
            if self.kind == "fsdp1_mesh":
                from torch.distributed.device_mesh import init_device_mesh

                kwargs["device_mesh"] = init_device_mesh("cpu", (self.world,))
            self.model = FullyShardedDataParallel(model, **kwargs)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)

    # -- training ------------------------------------------------------------------

    def step(self) -> None:
        loss = self.model(input_ids=self.batch, labels=self.batch).loss
        if self.kind in DEEPSPEED and not self.kind.startswith("accelerate"):
            self.model.backward(loss)
            self.model.step()
            return
        if self.kind.startswith("accelerate"):
            self.acc.backward(loss)
        else:
            loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    # -- the reference ---------------------------------------------------------------

    def gathered(self) -> dict[str, Any]:
        """The weights gathered the framework's own way, in checkpoint names
        (collective): all of them on rank 0; with AutoEP, each rank's own
        experts on every rank."""
        if self.kind in FSDP1:
            from torch.distributed.fsdp import FullStateDictConfig, StateDictType
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            cfg = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)  # (offload on CPU crashes)
            with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT, cfg):
                sd = self.model.state_dict()
            return {k: v.detach().clone() for k, v in sd.items()} if self.rank == 0 else {}
        module = self.model.module if hasattr(self.model, "module") else self.model
        params = list(module.named_parameters())
        if self.kind.startswith(("zero3", "accelerate_zero3")):
            import deepspeed

            with deepspeed.zero.GatheredParameters([p for _, p in params]):
                full = {n: p.detach().clone() for n, p in params}
        elif self.kind == "fsdp2":
            full = {n: p.full_tensor().detach().clone() for n, p in params}
        else:
            full = {n: p.detach().clone() for n, p in params}
        for mname, mod in module.named_modules():  # persistent buffers: whole on every rank
            for bname, b in mod.named_buffers(recurse=False):
                if b is not None and bname not in mod._non_persistent_buffers_set:
                    full.setdefault(f"{mname}.{bname}" if mname else bname, b.detach().clone())
        if "autoep" in self.kind:
            return self._autoep_names(module, full)
        return full if self.rank == 0 else {}

    def _autoep_names(self, module, full: dict[str, Any]) -> dict[str, Any]:
        """AutoEP's tensors back in checkpoint names, written out here by hand
        (independently of the sender): ``experts.w1[i]`` is expert
        ``ep_rank * local + i``'s gate_proj, ``w3`` its up_proj, ``w2`` its
        down_proj, ``router.gate`` the router ``gate``, ``shared_experts``
        Qwen2-MoE's ``shared_expert``."""
        out = {}
        layers = {n for n, m in module.named_modules() if type(m).__name__ == "AutoEPMoELayer"}
        for name, t in full.items():
            layer = next((lay for lay in layers if name.startswith(lay + ".")), None)
            if layer is None:
                if self.rank == 0:
                    out[name] = t
                continue
            lm = module.get_submodule(layer)
            rest = name[len(layer) + 1 :]
            if rest.startswith(("router.", "shared_experts")):
                # The router is the checkpoint's gate (DeepSeek-V3's score
                # correction bias included); the shared expert and its gate
                # keep their modules, under Qwen2-MoE's names there.
                if self.rank == 0:
                    shared = rest.replace("router.gate.", "gate.").replace("router.", "gate.")
                    if _model_type(self.path) == "qwen2_moe":
                        shared = shared.replace("shared_experts_gate.", "shared_expert_gate.")
                        shared = shared.replace("shared_experts.", "shared_expert.")
                    out[f"{layer}.{shared}"] = t
                continue
            proj = {"experts.w1": "gate_proj", "experts.w3": "up_proj", "experts.w2": "down_proj"}[rest]
            for i in range(t.shape[0]):
                out[f"{layer}.experts.{lm.ep_rank * lm.num_local_experts + i}.{proj}.weight"] = t[i].clone()
        return out

    def gathering(self):
        """For ZeRO-3: every parameter gathered whole on every rank, as inside
        ``GatheredParameters`` (a push there must still send partitions)."""
        import contextlib

        if not self.kind.startswith(("zero3", "accelerate_zero3")):
            return contextlib.nullcontext()
        import deepspeed

        module = self.model.module if hasattr(self.model, "module") else self.model
        return deepspeed.zero.GatheredParameters(list(module.parameters()))

    def partitioned(self) -> list[str]:
        """ZeRO-3 parameters (not persisted) whose data is not empty: after a
        push, none (reshard gathered nothing)."""
        module = self.model.module if hasattr(self.model, "module") else self.model
        return [
            n
            for n, p in module.named_parameters()
            if hasattr(p, "ds_tensor") and not getattr(p, "ds_persist", False) and p.data.numel() != 0
        ]

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


@contextmanager
def counting_gathers():
    """Counts every all-gather and broadcast issued through torch.distributed
    or deepspeed.comm inside the block (the refit group uses neither: its
    transfers are point-to-point on a group of its own)."""
    import sys

    import torch.distributed as dist

    names = (
        "all_gather",
        "all_gather_into_tensor",
        "_all_gather_base",
        "all_gather_object",
        "allgather_fn",
        "all_gather_coalesced",
        "broadcast",
        "broadcast_object_list",
    )
    mods = [dist]
    for m in ("deepspeed.comm", "deepspeed.comm.comm"):
        if m in sys.modules:
            mods.append(sys.modules[m])
    calls: list[str] = []
    saved = []
    for mod in mods:
        for n in names:
            f = getattr(mod, n, None)
            if f is None:
                continue
            saved.append((mod, n, f))

            def counted(*a, _f=f, _n=n, **k):
                calls.append(_n)
                return _f(*a, **k)

            setattr(mod, n, counted)
    try:
        yield calls
    finally:
        for mod, n, f in saved:
            setattr(mod, n, f)


def checkpoint_tensors(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names, shapes and dtypes in the checkpoint at ``path``."""
    from safetensors import safe_open

    out = {}
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            s = f.get_slice(k)
            out[k] = (tuple(s.get_shape()), s.get_dtype())
    return out


def write_checkpoint(like: str, path: str, tensors: dict[str, Any]) -> str:
    """A checkpoint at ``path``: ``tensors`` (those the checkpoint at ``like``
    has) and ``like``'s config and tokenizer."""
    import shutil

    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    for f in os.listdir(like):
        if f != "model.safetensors":
            shutil.copy(os.path.join(like, f), path)
    known = checkpoint_tensors(like)
    missing = sorted(set(known) - set(tensors))
    if missing:
        raise ValueError(f"the gathered weights miss {missing[:5]}")
    save_file({k: tensors[k].contiguous() for k in known}, os.path.join(path, "model.safetensors"))
    return path


def pack(tensors: dict[str, Any]) -> bytes:
    """Tensors as bytes, to return them from a test process (a tensor put on
    a multiprocessing queue travels as a shared-memory handle, which dies
    with the process that sent it)."""
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()})


def unpack(data: bytes) -> dict[str, Any]:
    from safetensors.torch import load

    return load(data)
