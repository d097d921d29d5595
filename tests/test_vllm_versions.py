"""What differs between vLLM 0.32 (run here) and 0.33 (what GPU users
install), each handled so the same code is right on both (docs/vllm.md,
"Versions"): the pause mode that fails no request, the executor's worker
order with prefill context parallelism, the NCCL settings reshard's
communicators are built with, and the state vLLM's own finish refreshes."""

from __future__ import annotations

import itertools
import os

import pytest

from . import procs
from .support import group_config


@pytest.mark.parametrize(
    ("version", "mode"),
    [
        ("0.32.0", "wait"),
        ("0.31.2", "wait"),
        ("0.32.1rc1", "wait"),
        ("0.33.0", "keep"),
        ("0.33.1.dev12+g1234abcd", "keep"),
        ("0.34", "keep"),
        ("1.0.0", "keep"),
        (None, "keep"),
        ("unknown", "keep"),
    ],
)
def test_the_pause_mode_never_fails_a_request_on_each_version(version, mode):
    from reshard.adapters.vllm.driver import pause_mode_for

    assert pause_mode_for(version) == mode


def test_executor_rank_is_vllms_worker_order_with_prefill_context_parallelism():
    """vLLM lays an executor's workers out PP x PCP x TP (TP fastest,
    ``vllm.distributed.parallel_state``): the oracle is that layout itself."""
    import torch

    from reshard.adapters.vllm.backend import executor_rank

    for nt, nc, np_ in itertools.product((1, 2, 3, 4), (1, 2, 3), (1, 2, 3)):
        layout = torch.arange(np_ * nc * nt).reshape(np_, nc, nt)
        seen = set()
        for t, c, p in itertools.product(range(nt), range(nc), range(np_)):
            me, last = executor_rank((t, nt), (c, nc), (p, np_))
            assert me == int(layout[p, c, t])
            assert last == np_ * nc * nt - 1
            seen.add(me)
        assert seen == set(range(np_ * nc * nt))
    with pytest.raises(ValueError, match="pcp rank 2 is outside a group of 2"):
        executor_rank((0, 1), (2, 2), (0, 1))


def test_workers_build_reshard_communicators_in_vllms_unpinned_nccl_env():
    from vllm.utils.nccl import unpinned_nccl_env

    from reshard.adapters.vllm.receiver import vllm_pg_env

    assert vllm_pg_env() is unpinned_nccl_env


_PG_ENV = "RESHARD_TEST_PG_ENV"


def _marking_env():
    """A ``pg_env`` that marks the environment while it is entered."""
    import contextlib

    @contextlib.contextmanager
    def env():
        os.environ[_PG_ENV] = "inside"
        try:
            yield
        finally:
            os.environ.pop(_PG_ENV)

    return env()


def _join_with_env(rank: int, address: str) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    from reshard.transport.group import RefitGroup

    original = dist.ProcessGroupGloo
    seen: list[str | None] = []

    def spy(*args):
        seen.append(os.environ.get(_PG_ENV))
        return original(*args)

    spy._Options = original._Options  # type: ignore[attr-defined]
    spy.create_default_device = original.create_default_device  # type: ignore[attr-defined]
    dist.ProcessGroupGloo = spy  # type: ignore[misc,assignment]
    try:
        cfg = group_config(address, 1, 1, pg_env=_marking_env)
        group = RefitGroup.join(cfg, rank=rank)
        try:
            after = os.environ.get(_PG_ENV)
            # The group built inside pg_env carries a collective.
            one = torch.ones(1)
            group.pg.allreduce([one]).wait()
            # Neither rank drops its group before both are done with it: a rank
            # whose gloo connect returned first may otherwise close while its
            # peer is still connecting (a fresh clone beside a busy loop: the
            # peer's join failed, "Connection closed by peer").
            group.store.set(f"done/{rank}", b"1")
            group.store.wait([f"done/{r}" for r in range(2)], datetime.timedelta(seconds=procs.GROUP_TIMEOUT_S))
            return {"seen": seen, "after": after, "sum": one.item()}
        finally:
            group.close()
    finally:
        dist.ProcessGroupGloo = original  # type: ignore[misc]


def test_the_refit_group_builds_its_process_group_inside_pg_env():
    server = procs.StoreServer()
    for r in procs.check(procs.run(_join_with_env, 2, server.address, timeout=120)):
        assert r["seen"] == ["inside"] and r["after"] is None and r["sum"] == 2.0, r


class _Runner:
    def __init__(self) -> None:
        self.resets = 0

    def reset_lora_state(self) -> None:
        self.resets += 1


class _Receiver:
    rank = 3
    mixed = False

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def pull(self, refit: int, *, method: str, atomic=None):
        from reshard.transport.stats import EngineStats

        if self.fail:
            raise RuntimeError("the transfer failed")
        return EngineStats(rank=self.rank, refit=refit)

    def commit(self, refit: int):
        return self.pull(refit, method="reshard")


@pytest.mark.parametrize("call", ["reshard_pull", "reshard_commit"])
def test_the_extension_refreshes_what_vllms_own_finish_refreshes(call):
    """After the weights changed (and only then), the extension path calls the
    runner's ``reset_lora_state``, as vLLM's ``finish_weight_update`` does
    (LoRA adapters; quantized draft heads in 0.33)."""
    from reshard.adapters.vllm.extension import ReshardWorkerExtension

    worker = ReshardWorkerExtension()
    worker.model_runner = _Runner()
    worker._reshard = _Receiver(fail=False)
    reply = getattr(worker, call)("4")
    assert reply["ok"] and reply["stats"]["refit"] == 4 and reply["stats"]["rank"] == 3
    assert worker.model_runner.resets == 1
    worker._reshard = _Receiver(fail=True)
    reply = getattr(worker, call)("5")
    assert not reply["ok"] and "the transfer failed" in reply["error"]
    assert worker.model_runner.resets == 1


def test_a_refit_waits_for_an_offline_engines_replies_asleep():
    """vLLM's executor spins (``sched_yield``) for a second after each reply
    it reads; for ``reshard_pull`` and ``reshard_commit`` the driver makes it
    wait on its workers' notification instead, and puts the spin back after.
    The attributes it sets are vLLM's own: checked on its classes."""
    import inspect
    from types import SimpleNamespace

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue, SpinCondition
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from reshard.adapters.vllm.driver import commit_workers, pull_workers, stage_workers

    assert "busy_loop_s" in inspect.getsource(SpinCondition.wait)
    assert "self._spin_condition" in inspect.getsource(MessageQueue)
    assert "self.response_mqs" in inspect.getsource(MultiprocExecutor)
    assert "self.engine_core = EngineCore(" in inspect.getsource(InprocClient)

    conds = [SimpleNamespace(busy_loop_s=1), SimpleNamespace(busy_loop_s=1)]
    seen: list[tuple[str, list]] = []

    def collective_rpc(method, args=()):
        seen.append((method, [c.busy_loop_s for c in conds]))
        stats = {"staged": True}
        return [{"ok": True, "rank": 2 + i, "stats": stats} for i in range(len(conds))]

    executor = SimpleNamespace(response_mqs=[SimpleNamespace(_spin_condition=c) for c in conds])
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=SimpleNamespace(model_executor=executor))),
        collective_rpc=collective_rpc,
    )
    pull_workers(llm, 1)
    stage_workers(llm, 2)
    commit_workers(llm, 2)
    assert seen == [
        ("reshard_pull", [0, 0]),
        ("reshard_stage", [1, 1]),
        ("reshard_staged", [1, 1]),
        ("reshard_commit", [0, 0]),
    ]
    assert [c.busy_loop_s for c in conds] == [1, 1]
