"""The RL framework integrations without an engine: they import without the
frameworks, check the framework versions they patch, validate their options,
and refuse misconfigurations with errors that name the fix."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from reshard.errors import ReshardError


def test_the_integrations_import_without_any_framework():
    code = (
        "import sys, reshard.integrations, reshard.integrations.trl, reshard.integrations.verl, "
        "reshard.integrations.openrlhf\n"
        "heavy = ('trl', 'verl', 'openrlhf', 'vllm', 'torch', 'ray', 'transformers', 'accelerate', 'deepspeed')\n"
        "print(','.join(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert out == "", f"imported at module level: {out}"


def test_trl_options_are_checked():
    from reshard.integrations.trl import ReshardOptions

    with pytest.raises(ValueError, match="pause_mode 'later'"):
        ReshardOptions(pause_mode="later")
    with pytest.raises(ValueError, match="timeout_s"):
        ReshardOptions(timeout_s=0)
    with pytest.raises(ValueError, match=r"\['address'\]"):
        ReshardOptions(extra={"address": "h:1"})


def test_trl_version_is_pinned(monkeypatch):
    pytest.importorskip("trl")
    import importlib.metadata

    from reshard.integrations.trl import TRL_VERSION, check_trl_version

    assert check_trl_version() == TRL_VERSION
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.17.0")
    with pytest.raises(ImportError, match=r"TRL 1\.16\.0 .* but TRL 1\.17\.0 is installed: pip install trl==1\.16\.0"):
        check_trl_version()


def test_each_integration_checks_its_pin_before_building_a_class(monkeypatch):
    """The lazy classes are built once, after the framework's version check,
    under the drop-in's module and their own name."""
    import importlib.metadata

    from reshard.integrations.framework import LazyClasses, Pinned

    pin = Pinned(
        module="reshard.integrations.x", framework="X", distribution="x-framework", version="1.0", read="its hooks"
    )
    lazy = LazyClasses("reshard.integrations.x", pin)
    built = []

    @lazy.builds("ReshardThing")
    def thing() -> type:
        built.append(1)

        class Local:
            pass

        return Local

    with pytest.raises(
        ImportError, match=r"reshard\.integrations\.x needs X 1\.0: pip install --no-deps x-framework==1\.0"
    ):
        lazy.getattr("ReshardThing")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.1" if name == "x-framework" else "")
    with pytest.raises(ImportError, match=r"written against X 1\.0 \(its hooks\) but X 1\.1 is installed"):
        thing()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.0")
    cls = lazy.getattr("ReshardThing")
    assert cls is thing() and built == [1]
    assert (cls.__module__, cls.__name__, cls.__qualname__) == (
        "reshard.integrations.x",
        "ReshardThing",
        "ReshardThing",
    )
    with pytest.raises(AttributeError, match=r"module 'reshard\.integrations\.x' has no attribute 'Other'"):
        lazy.getattr("Other")


def test_trl_refuses_a_trainer_that_does_not_build_vllm_generation():
    pytest.importorskip("trl")
    from reshard.integrations.trl import with_reshard

    class Plain:
        pass

    with pytest.raises(TypeError, match="does not build TRL's VLLMGeneration"):
        with_reshard(Plain)


def test_trl_takes_a_users_subclass_of_a_trl_trainer():
    """A subclass defined outside TRL builds VLLMGeneration through the TRL
    class it derives from: that module's name is the one swapped."""
    pytest.importorskip("trl")
    import trl

    from reshard.integrations.trl import with_reshard

    class MyGRPO(trl.GRPOTrainer):
        pass

    cls = with_reshard(MyGRPO)
    assert issubclass(cls, MyGRPO) and cls.__name__ == "ReshardMyGRPO"


def test_verl_options_and_misconfigurations_name_the_fix():
    pytest.importorskip("verl")
    from reshard.integrations.verl import MANAGER, VerlOptions, _engine_class, _manager_class

    with pytest.raises(ValueError, match=r"unknown keys \['adress'\]"):
        VerlOptions.of({"adress": "h:1"})
    with pytest.raises(ValueError, match=r"\['num_sources'\] are no group settings"):
        VerlOptions(group={"num_sources": 3})
    with pytest.raises(ValueError, match="backend must be auto, gloo or nccl"):
        VerlOptions.of({"group_backend": "mpi"})
    engine = _engine_class()(bucket_size=1 << 20, is_master=True, timeout_s=5)
    assert engine.options.timeout_s == 5
    # verl's own manager passes full tensors: refused, naming the manager to set.
    for call in (engine.prepare, engine.finalize):
        with pytest.raises(ReshardError, match=re.escape(f"checkpoint_manager_class={MANAGER}")):
            call()
    with pytest.raises(ReshardError, match=r"checkpoint_engine\.backend is 'nccl'"):
        _manager_class()(config=SimpleNamespace(backend="nccl"), actor_wg=None, replicas=[])


def test_verl_setup_hook_lets_vllm_032_take_verls_pause_keyword():
    pytest.importorskip("vllm")
    code = textwrap.dedent(
        """
        import asyncio, inspect
        from vllm.v1.engine.async_llm import AsyncLLM
        assert "wait_for_inflight_requests" not in inspect.signature(AsyncLLM.pause_generation).parameters
        from reshard.integrations.verl import setup_worker_process
        setup_worker_process()
        setup_worker_process()  # idempotent

        calls = []
        class Core:
            async def pause_scheduler_async(self, **kw):
                calls.append(kw)
        class Renderer:
            async def clear_mm_cache_async(self):
                pass
        fake = type("Fake", (), {"engine_core": Core(), "renderer": Renderer()})()
        # verl 0.9.1's call:
        asyncio.run(AsyncLLM.pause_generation(fake, wait_for_inflight_requests=False, clear_cache=True))
        asyncio.run(AsyncLLM.pause_generation(fake, mode="keep", clear_cache=False))
        print(calls)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == (
        "[{'mode': 'abort', 'clear_cache': True}, {'mode': 'keep', 'clear_cache': False}]"
    )


def test_openrlhf_version_is_pinned(monkeypatch):
    pytest.importorskip("openrlhf")
    import importlib.metadata

    from reshard.integrations.openrlhf import OPENRLHF_VERSION, check_openrlhf_version

    assert check_openrlhf_version() == OPENRLHF_VERSION
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.12.0")
    with pytest.raises(ImportError, match=r"OpenRLHF 0\.11\.2 .*ActorPPOTrainer\.broadcast_to_vllm.* 0\.12\.0"):
        check_openrlhf_version()


def _share_from_rank0(rank: int, port: int, fail: bool) -> tuple[str, int] | str:
    import torch.distributed as dist

    from reshard.integrations.openrlhf import _rank0_setup

    def count() -> int:
        if fail:
            raise RuntimeError("the engines are gone")
        return 7

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        return _rank0_setup("trainer-0:29500" if rank == 0 else None, count, rank, 2)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()


def test_openrlhf_ranks_share_rank0s_store_address_without_pickling():
    from . import procs

    out = procs.check(procs.run(_share_from_rank0, 2, procs.free_port(), False, timeout=120))
    assert out == [("trainer-0:29500", 7), ("trainer-0:29500", 7)]


def test_openrlhf_rank0_failing_its_setup_fails_every_rank():
    from . import procs

    out = procs.check(procs.run(_share_from_rank0, 2, procs.free_port(), True, timeout=120))
    assert out == [
        "RuntimeError: the engines are gone",
        "ReshardError: trainer rank 1: trainer rank 0 could not set up the refits: RuntimeError: the engines are gone",
    ]


@pytest.mark.parametrize(("lora", "refused"), [({}, True), ({"merge": False}, True), ({"merge": True}, False)])
def test_verl_refuses_a_lora_policy_its_rollout_would_apply_unmerged(lora, refused, tmp_path):
    """verl's own model config (HFModelConfig) of a LoRA policy: merged (the
    refit reshard does) or refused naming the setting (verl's default is
    unmerged)."""
    pytest.importorskip("verl")
    from verl.workers.config import HFModelConfig

    from reshard.integrations.verl import lora_unmerged
    from reshard.testing.tiny import build_tiny_model

    path = str(build_tiny_model(tmp_path / "m", "qwen2", seed=0))
    plain = HFModelConfig(path=path)
    lora_unmerged(plain, 0)  # no LoRA: nothing to refuse
    cfg = HFModelConfig(path=path, lora_rank=8, lora=lora)
    if refused:
        with pytest.raises(
            ReshardError, match=r"actor rank 3: .*lora.merge=False.*set actor_rollout_ref.model.lora.merge=True"
        ):
            lora_unmerged(cfg, 3)
    else:
        lora_unmerged(cfg, 3)


class _Remote:
    """A Ray actor method's ``.remote`` stand-in: runs the call now, returns an awaitable."""

    def __init__(self, call):
        self.call = call

    def remote(self, *args, **kwargs):
        import asyncio

        done = asyncio.get_running_loop().create_future()
        done.set_result(self.call(*args, **kwargs))
        return done


def test_every_group_setting_reaches_verls_actors_and_vllm_workers(tmp_path):
    """verl's config, its ``CheckpointEngineConfig``, its registry and
    manager base class build reshard's backend and manager, as in a verl job
    (tests/test_verl.py); only Ray's actor handles are stood in. Every
    ``GroupConfig`` setting of group scope reaches the vLLM workers' config
    (as vLLM parses the init_info), every group and trainer setting the
    actors' senders (a new setting joins ``NON_DEFAULT_SETTINGS``, which
    tests/test_group_settings.py holds to ``GroupConfig``)."""
    pytest.importorskip("verl")
    pytest.importorskip("vllm")
    import asyncio

    import torch
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs, load_class_from_fqn

    from reshard.adapters.vllm.backend import ReshardEngine
    from reshard.integrations.verl import GROUP_SETTINGS
    from reshard.transport.config import GROUP, TRAINER, scope_fields, settings

    from .support import NON_DEFAULT_SETTINGS
    from .verl_support import RESHARD, verl_config

    # The manager derives these (2 actors, a replica of 3 workers, its first
    # join); a user sets every other one, away from its default.
    derived = {"num_sources": 2, "num_destinations": 3, "generation": 1}
    user = {k: v for k, v in NON_DEFAULT_SETTINGS.items() if k not in derived}
    assert set(GROUP_SETTINGS.values()) == set(user) - {"address", "job", "timeout_s"}
    # As a user writes them on verl's command line (backend as group_backend).
    key = {setting: k for k, setting in GROUP_SETTINGS.items()}
    given = {key.get(k, k): v for k, v in {**user, "atomic": True}.items()}
    reshard_kwargs = [
        f"+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.reshard.{k}="
        + (str(v).lower() if isinstance(v, bool) else f"'{v}'" if isinstance(v, str) else str(v))
        for k, v in given.items()
    ]
    cfg = verl_config(str(tmp_path), RESHARD + reshard_kwargs)
    ce = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine)

    class Actor:
        """An actor worker as verl's ActorRolloutRefWorker.init_model leaves it."""

        def __init__(self, rank):
            self.rank = rank
            self.actor = SimpleNamespace(engine=SimpleNamespace(module=torch.nn.Linear(4, 4)))
            import_external_libs(ce.custom_backend_module or None)
            self.checkpoint_engine = CheckpointEngineRegistry.new(
                ce.backend, is_master=rank == 0, bucket_size=1 << 20, **ce.engine_kwargs.get(ce.backend, {})
            )
            self.__ray_call__ = _Remote(lambda fn, *args: fn(self, *args))

    infos = []
    server = SimpleNamespace(collective_rpc=_Remote(lambda method, kwargs: infos.append((method, kwargs["init_info"]))))
    replica = SimpleNamespace(
        replica_rank=0, world_size=3, servers=[server], config=SimpleNamespace(data_parallel_size=1)
    )
    actors = [Actor(0), Actor(1)]
    manager = load_class_from_fqn(cfg.actor_rollout_ref.rollout.checkpoint_manager_class, "manager")(
        config=ce, actor_wg=SimpleNamespace(workers=actors), replicas=[replica]
    )
    try:
        asyncio.run(manager._join())
        expected = {**user, **derived}
        for a in actors:
            sender = a.checkpoint_engine.sender
            assert sender.rank == a.rank
            assert settings(sender.session.config, GROUP, TRAINER) == expected
        ((method, info),) = infos
        assert method == "init_weight_transfer_engine"
        spec = ReshardEngine.init_info_cls(**info).spec
        assert settings(spec.config(), GROUP) == {k: expected[k] for k in scope_fields(GROUP)}
        assert (spec.engine_offset, spec.atomic) == (0, True)
    finally:
        for a in actors:
            a.checkpoint_engine.close()
