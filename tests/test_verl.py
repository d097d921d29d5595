"""verl's weight sync through reshard: ``ReshardCheckpointManager`` (verl's
``checkpoint_manager_class``), the ``reshard`` backend from verl's
``CheckpointEngineRegistry`` (``custom_backend_module``), and a real verl
vLLM rollout replica (``vLLMReplica``: ``CheckpointEngineWorker`` actors and
a ``vLLMHttpServer`` actor running vLLM at TP=2, with
``engine_kwargs.vllm.weight_transfer_config={backend: reshard}``), with Ray
on CPU. The actor side is 2 trainer workers in verl's worker group holding
an FSDP2 model; the fakes, each where verl needs a GPU, are named in
``tests/verl_support.py``.

Two updates (two checkpoints written into the actors' shards, each followed
by ``update_weights``); after each, the replica's server generates exactly
what a fresh engine on that checkpoint generates; every vLLM worker received
exactly the bytes it keeps (half the model each, not the model); the actors
never called ``full_tensor()``, never exported full tensors
(``get_per_tensor_param``) and verl's own ``update_weights`` path never ran.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from reshard.testing.tiny import build_tiny_model

from . import procs

pytest.importorskip("verl")
pytest.importorskip("vllm")
pytest.importorskip("ray")

pytestmark = [pytest.mark.engine, pytest.mark.slow]

TP = 2
ACTORS = 2
REPO = Path(__file__).resolve().parents[1]


# What a user adds to verl's config (verl_support.RESHARD, with a timeout),
# then what this CPU machine needs (no sleep mode, eager, small, float32).
TIMEOUT = [f"+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.reshard.timeout_s={procs.GROUP_TIMEOUT_S}"]
CPU = [
    "actor_rollout_ref.rollout.name=vllm",
    f"actor_rollout_ref.rollout.tensor_model_parallel_size={TP}",
    "actor_rollout_ref.rollout.enforce_eager=True",
    "actor_rollout_ref.rollout.free_cache_engine=False",
    "+actor_rollout_ref.rollout.enable_sleep_mode=False",
    "actor_rollout_ref.rollout.max_model_len=256",
    "actor_rollout_ref.rollout.max_num_seqs=4",
    "actor_rollout_ref.rollout.max_num_batched_tokens=512",
    "actor_rollout_ref.rollout.prompt_length=64",
    "actor_rollout_ref.rollout.response_length=64",
    "actor_rollout_ref.rollout.dtype=float32",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import load_class_from_fqn
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.replica import get_rollout_replica_class

    from .verl_support import RESHARD, FakeActorWorker, dump_worker_stats, fresh_greedy_tp, verl_config, vllm_dist_shim
    from .vllm_support import server_greedy

    root = tmp_path_factory.mktemp("verl")
    v1, v2, v3 = (str(build_tiny_model(root / f"v{i + 1}", "qwen2", seed=i)) for i in range(3))
    shim = str(vllm_dist_shim(root / "shim"))
    # For this process's own verl imports; taken off the path again below.
    sys.path.insert(0, shim)
    cfg = verl_config(v1, RESHARD + TIMEOUT + CPU)
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO), shim, os.environ.get("PYTHONPATH", "")]),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1)) for i in range(TP)),
        "OMP_NUM_THREADS": "1",
        # The test reads every worker's account with a collective_rpc callable.
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    }
    procs.ray_init(
        num_cpus=8,
        num_gpus=ACTORS + TP,  # fake: see tests/verl_support.py
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env, "worker_process_setup_hook": "reshard.integrations.verl.setup_worker_process"},
    )
    stats_dir = root / "stats"
    stats_dir.mkdir()
    out: dict = {"updates": []}
    try:
        ce = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine)
        pool = RayResourcePool(process_on_nodes=[ACTORS], use_gpu=True, max_colocate_count=1)
        actors = RayWorkerGroup(
            resource_pool=pool,
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(FakeActorWorker), config=ce),
            # A port outside the ephemeral range (verl's own pick is in it, where
            # any connection on a loaded machine may take it first).
            master_addr="127.0.0.1",
            master_port=str(procs.free_port()),
        )
        actors.init_model(v1)
        model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model, dataclass_type=HFModelConfig)
        rollout_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
        replica = get_rollout_replica_class("vllm")(
            replica_rank=0, config=rollout_config, model_config=model_config, gpus_per_node=TP
        )
        asyncio.run(replica.init_standalone())
        manager_cls = load_class_from_fqn(cfg.actor_rollout_ref.rollout.checkpoint_manager_class, "manager")
        manager = manager_cls(config=ce, actor_wg=actors, replicas=[replica])
        url = f"http://{replica.server_address}"
        for step, path in enumerate((v2, v3), 1):
            actors.load(path)
            metrics = manager.update_weights(global_steps=step)
            ray.get(replica.servers[0].collective_rpc.remote(dump_worker_stats, args=(str(stats_dir), step)))
            workers = [json.loads(p.read_text()) for p in sorted(stats_dir.glob(f"worker-*-refit-{step}.json"))]
            out["updates"].append(
                {"tokens": server_greedy(url), "metrics": metrics, "workers": workers, "actors": manager.last_stats}
            )
        out["counters"] = actors.counters()
        out["manager"] = type(manager).__mro__[1].__module__ + "." + type(manager).__mro__[1].__name__
    finally:
        ray.shutdown()
        sys.path.remove(shim)
    out["fresh"] = procs.check(procs.run(fresh_greedy_tp, 1, [v2, v3], TP, timeout=600, daemon=False))[0]
    return out


def test_two_updates_leave_the_rollout_on_the_actors_weights(run):
    (u1, u2), (fresh_v2, fresh_v3) = run["updates"], run["fresh"]
    assert fresh_v2 != fresh_v3, "the two checkpoints must generate differently"
    assert u1["tokens"] == fresh_v2
    assert u2["tokens"] == fresh_v3


def test_each_vllm_worker_received_only_what_it_keeps(run):
    for update in run["updates"]:
        workers = update["workers"]
        assert sorted(w["rank"] for w in workers) == [ACTORS + r for r in range(TP)]
        total = sum(w["kept_bytes"] for w in workers)
        for w in workers:
            assert w["bytes_received"] == w["kept_bytes"] > 0, w
            assert w["kept_bytes"] < 0.6 * total  # a TP=2 worker keeps about half, never the model
        # What the actors sent, each its own shard, is what the workers received.
        sent = [a["bytes_sent"] for a in update["actors"]]
        assert len(sent) == ACTORS and all(s > 0 for s in sent)
        assert sum(sent) == sum(w["bytes_received"] for w in workers) == update["metrics"]["reshard/bytes_sent"]


def test_the_actors_never_gathered(run):
    assert run["manager"] == "verl.checkpoint_engine.base.CheckpointEngineManager"
    assert run["counters"] == [{"full_tensor": 0, "get_per_tensor_param": 0, "update_weights": 0}] * ACTORS
