"""OpenRLHF's weight sync through reshard (``reshard.integrations.openrlhf``).

OpenRLHF's trainer side needs CUDA (flash-attn at import, DeepSpeed on GPUs,
NCCL), so what runs here is everything else, real:

- the names the integration patches exist, with the call sites it relies
  on, in the pinned OpenRLHF (read from its source, without importing it);
- Ray's setup hook patches ``ActorPPOTrainer`` when a process imports it;
- OpenRLHF's own ``create_vllm_engines`` builds a real vLLM engine actor
  (OpenRLHF's ``RolloutRayActor``, with its ``WorkerWrap`` and reshard's
  extension), and OpenRLHF's ``ActorPPOTrainer.broadcast_to_vllm``, patched,
  refits it twice from a trainer holding the policy; after each refit the
  engine generates what a fresh engine on those weights generates.

The one fake (a ``flash_attn`` stub, where OpenRLHF needs a GPU) is
described in ``tests/openrlhf_support.py``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from reshard.testing.tiny import build_tiny_model

from . import procs
from .openrlhf_support import flash_attn_stub, fresh_greedy_bf16
from .vllm_support import MAX_TOKENS, PROMPTS

pytest.importorskip("openrlhf")

pytestmark = [pytest.mark.engine, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


def _source(module: str) -> ast.Module:
    spec = importlib.util.find_spec("openrlhf")
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent.joinpath(*module.split(".")[1:]).with_suffix(".py")
    return ast.parse(path.read_text())


def _find(tree: ast.AST, qualname: str) -> ast.AST:
    node: ast.AST = tree
    for part in qualname.split("."):
        found = [
            n
            for n in ast.iter_child_nodes(node)
            if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.name == part
        ]
        assert found, f"{qualname}: no {part!r}"
        node = found[0]
    return node


def _calls(node: ast.AST) -> set[str]:
    """Dotted names of everything ``node`` calls (``self.trainer.broadcast_to_vllm``)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            out.add(ast.unparse(n.func))
    return out


def test_the_patched_names_exist_in_the_pinned_version():
    from reshard.integrations.openrlhf import OPENRLHF_VERSION, PATCHED, check_openrlhf_version

    assert check_openrlhf_version() == OPENRLHF_VERSION
    for module, qualname in PATCHED:
        _find(_source(module), qualname)
    engines = _source("openrlhf.trainer.ray.vllm_engine")
    # create_vllm_engines looks the actor class up by its module-level name and
    # passes OpenRLHF's worker extension in the keyword arguments reshard rewrites.
    create = _find(engines, "create_vllm_engines")
    assert any(c.startswith("RolloutRayActor.options(") for c in _calls(create))
    assert "'worker_extension_cls': 'openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap'" in ast.unparse(create)
    # ReshardRolloutRayActor's pass-through uses the actor's engine, self.llm.
    assert "self.llm.collective_rpc" in _calls(_find(engines, "RolloutRayActor.init_process_group"))
    _find(engines, "RolloutRayActor.reset_prefix_cache")
    actor = _source("openrlhf.trainer.ray.ppo_actor")
    # The NCCL group is built in the constructor, the sync runs per rank.
    assert "self._init_vllm_sync_group" in _calls(_find(actor, "ActorPPOTrainer.__init__"))
    assert "self.trainer.broadcast_to_vllm" in _calls(_find(actor, "PolicyModelActor.broadcast_to_vllm"))
    trainer = _source("openrlhf.trainer.ppo_trainer")
    assert "self.actor_model_group.async_run_method" in _calls(_find(trainer, "BasePPOTrainer.broadcast_to_vllm"))


def test_the_setup_hook_patches_the_trainer_when_a_process_imports_it(tmp_path):
    stub = flash_attn_stub(tmp_path / "stub")
    code = (
        "from reshard.integrations.openrlhf import setup_worker_process\n"
        "setup_worker_process()\n"
        "from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer as T\n"
        "print(getattr(T.broadcast_to_vllm, '_reshard', False), T._init_vllm_sync_group.__module__)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub), str(REPO)]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True reshard.integrations.openrlhf"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("vllm")
    ray = pytest.importorskip("ray")
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from reshard.integrations import openrlhf as integration

    root = tmp_path_factory.mktemp("openrlhf")
    v1, v2, v3 = (str(build_tiny_model(root / f"v{i + 1}", "qwen2", seed=i)) for i in range(3))
    stub = str(flash_attn_stub(root / "stub"))
    sys.path.insert(0, stub)
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO), stub, os.environ.get("PYTHONPATH", "")]),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "1",
    }
    # One GPU id for the engine actor's placement group (fake: vLLM's CPU build ignores it).
    procs.ray_init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    out: dict = {"refits": []}
    try:
        integration.patch_engines()
        from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
        from openrlhf.trainer.ray.vllm_engine import create_vllm_engines

        integration.patch_trainer()
        engines = create_vllm_engines(1, 1, v1, 0, False, True, True, 256, gpu_memory_utilization=0.5)
        # ActorPPOTrainer's constructor needs OpenRLHF's DeepSpeed strategy on a GPU;
        # broadcast_to_vllm reads two attributes of it.
        trainer = ActorPPOTrainer.__new__(ActorPPOTrainer)
        model = AutoModelForCausalLM.from_pretrained(v2, dtype=torch.bfloat16)
        trainer.actor = SimpleNamespace(model=model)
        trainer.vllm_engines = engines
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        for path in (v2, v3):
            if path != v2:
                model.load_state_dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict())
            trainer.broadcast_to_vllm()
            tokens = [list(ray.get(engines[0].generate.remote(p, sp)).outputs[0].token_ids) for p in PROMPTS]
            workers = [dict(rank=w.rank, refit=w.refit, landed=w.bytes_landed, kept=w.kept_bytes, got=w.bytes_received)
                       for w in trainer._reshard["sender"].engine_stats]  # fmt: skip
            out["refits"].append({"tokens": tokens, "workers": workers})
        trainer._reshard["sender"].close()
    finally:
        ray.shutdown()
        sys.path.remove(stub)
        for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
            del sys.modules[name]
    out["fresh"] = procs.check(procs.run(fresh_greedy_bf16, 1, [v2, v3], timeout=600, daemon=False))[0]
    return out


def test_broadcast_to_vllm_refits_openrlhf_engines(run):
    (r1, r2), (fresh_v2, fresh_v3) = run["refits"], run["fresh"]
    assert fresh_v2 != fresh_v3
    assert r1["tokens"] == fresh_v2
    assert r2["tokens"] == fresh_v3
    for i, r in enumerate(run["refits"], 1):
        (w,) = r["workers"]
        assert w["refit"] == i and w["rank"] == 1
        # Every byte the worker keeps landed; nothing beyond what it keeps arrived.
        assert w["landed"] == w["kept"] > 0 and w["got"] <= w["kept"], w
