"""A refit's bookkeeping inside vLLM's layerwise lifecycle, built alone from a
``WorkerModel`` (a torch model and a learned layout, no engine): which round
releases each layer, which layers a delta loads, the loader buffers."""

from __future__ import annotations

import torch

from reshard.adapters.core.recording import LOADER_PREFIX, LearnedLayout, ViaLoader
from reshard.adapters.vllm.update import LayerwiseUpdate, WorkerModel
from reshard.plan.box import Box
from reshard.plan.items import RankPlan, Round, Transfer, TransferKind
from reshard.plan.layout import Slot, TensorMeta
from reshard.plan.specs import PieceSpec

from .support import HANG_S


def _worker() -> WorkerModel:
    model = torch.nn.ModuleDict(
        {"a": torch.nn.Linear(4, 2, bias=False), "b": torch.nn.Linear(4, 2, bias=False), "c": torch.nn.Linear(4, 2)}
    )
    metas = {n: TensorMeta(n, (2, 4), "float32") for n in ("a.weight", "b.weight", "c.weight")}
    norm = TensorMeta("c.norm", (3,), "float32")
    learned = LearnedLayout(
        pieces=[PieceSpec(m, Box((0, 0), (2, 4)), n, (2, 4)) for n, m in metas.items()],
        local_shapes={n: (2, 4) for n in metas} | {LOADER_PREFIX + norm.name: (3,)},
        layers={"a": ["a.weight"], "b": ["b.weight"], "c": ["c.weight", "c.bias"]},
        via_loader={norm.name: ViaLoader(norm, Box((0,), (2,)), ("c.bias",), "the loader adds one")},
    )
    return WorkerModel(model=model, model_config=None, learned=learned, rank=3)


def _recv(local: str, rnd: int, kind: TransferKind = TransferKind.PULL) -> Transfer:
    box = Box((0, 0), (2, 4))
    return Transfer(
        local, box, Slot(0, box, local, (2, 4), (0, 0)), Slot(3, box, local, (2, 4), (0, 0)), kind, rnd, 32, 0
    )


def test_layers_are_released_after_the_last_round_that_writes_them():
    update = LayerwiseUpdate(_worker(), refit=7)
    plan = RankPlan(
        rank=3,
        rounds=[
            Round(0, recvs={0: [_recv("a.weight", 0), _recv("b.weight", 0)]}),
            Round(2, recvs={1: [_recv("b.weight", 2)]}),
        ],
        num_rounds=3,
    )
    update.release(plan)
    assert update.release_round("a") == 0
    assert update.release_round("b") == 2
    # A layer a loader tensor writes waits for the loaders, whatever its rounds.
    assert update.release_round("c") > 2
    assert update.loader_layers == {"c"}


def test_a_delta_loads_the_layers_of_what_changed_and_of_loaders_that_changed():
    update = LayerwiseUpdate(_worker(), refit=1)
    assert update.to_load(None) == {"a", "b", "c"}
    assert update.to_load({"b.weight"}) == {"b"}
    assert update.to_load({LOADER_PREFIX + "c.norm"}) == {"c"}
    assert update.to_load(set()) == set()


def test_loader_buffers_have_the_checkpoint_shape_and_are_kept():
    worker = _worker()
    buf = worker.loader_buffer(LOADER_PREFIX + "c.norm")
    assert buf.shape == (3,) and not buf.any()
    assert worker.loader_buffer(LOADER_PREFIX + "c.norm") is buf
    # A second refit of the same worker reads the same buffer.
    assert LayerwiseUpdate(worker, refit=2).owner.loader_buffer(LOADER_PREFIX + "c.norm") is buf


def test_the_applier_works_on_one_thread_for_the_newest_round_and_drains():
    """Rounds released while the applier is busy fold into the newest (work
    for round i covers the earlier ones), all on the pool's one thread, with
    the caller's intra-op threads and grad mode; drain waits for the last."""
    import concurrent.futures as cf
    import threading

    from reshard.adapters.vllm.applier import Applier

    pool = cf.ThreadPoolExecutor(1)
    started, gate = threading.Event(), threading.Event()
    seen: list[tuple[int, str, int, bool]] = []

    def work(i: int, tag: str) -> None:
        if i == 0:
            started.set()
            assert gate.wait(HANG_S)
        seen.append((i, threading.current_thread().name, torch.get_num_threads(), torch.is_grad_enabled()))

    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            applier = Applier(work, pool)
            with applier:
                applier.released(0, "a")
                assert started.wait(HANG_S)
                applier.released(1, "b")
                applier.released(2, "c")
                gate.set()
                applier.drain()
        assert [s[0] for s in seen] == [0, 2]
        assert len({s[1] for s in seen}) == 1 and seen[0][1] != threading.current_thread().name
        assert all(s[2] == threads and s[3] is False for s in seen)
        # The next refit's applier runs on the same thread (its malloc arena keeps the memory).
        again: list[str] = []
        with Applier(lambda i: again.append(threading.current_thread().name), pool) as applier:
            applier.released(0)
            applier.drain()
        assert again == [seen[0][1]]
    finally:
        pool.shutdown()


def test_a_drained_applier_stops_yielding():
    """On CPU the applier's work runs at idle priority while the transfer
    lasts; once it is over (``drain``) the rest must not starve behind a busy
    neighbour: the thread gets normal priority back, or where the system
    refuses that, the work not yet started runs on the caller's thread. The
    next refit's work is idle again."""
    import concurrent.futures as cf
    import os
    import threading

    import pytest

    from reshard.adapters.vllm.applier import Applier

    if not hasattr(os, "SCHED_IDLE"):
        pytest.skip("no SCHED_IDLE here")
    pool = cf.ThreadPoolExecutor(1)
    try:
        for refused in (False, True):
            started, gate = threading.Event(), threading.Event()
            seen: dict[int, tuple[str, int]] = {}

            def work(i: int, started=started, gate=gate, seen=seen) -> None:
                seen[i] = (threading.current_thread().name, os.sched_getscheduler(0))
                if i == 0:
                    started.set()
                    assert gate.wait(HANG_S)

            applier = Applier(work, pool, idle=True)
            lift = applier._lift
            # Round 0 ends once the drain has decided (under its lock) who runs round 1.
            applier._lift = lambda lift=lift, gate=gate, refused=refused: (gate.set(), False if refused else lift())[1]
            with applier:
                applier.released(0)
                assert started.wait(HANG_S)
                applier.released(1)
                applier.drain()
            worker = seen[0][0]
            assert seen[0][1] == os.SCHED_IDLE and worker != threading.current_thread().name
            if refused:
                assert seen[1] == (threading.current_thread().name, os.SCHED_OTHER)
            else:
                if seen[1][1] != os.SCHED_OTHER:
                    pytest.skip("this system refuses to lift an idle thread (no CAP_SYS_NICE); the refused case passed")
                assert seen[1] == (worker, os.SCHED_OTHER)
            again: list[int] = []
            ran = threading.Event()

            def record(i: int, again=again, ran=ran) -> None:
                again.append(os.sched_getscheduler(0))
                ran.set()

            with Applier(record, pool, idle=True) as applier:
                applier.released(0)
                assert ran.wait(HANG_S)
                applier.drain()
            assert again == [os.SCHED_IDLE]
    finally:
        pool.shutdown()


def test_the_appliers_error_fails_the_drain_and_an_error_stops_it():
    import concurrent.futures as cf
    import threading

    import pytest

    from reshard.adapters.vllm.applier import Applier

    pool = cf.ThreadPoolExecutor(1)
    try:

        def broken(i: int) -> None:
            raise RuntimeError(f"processing round {i} failed")

        with pytest.raises(RuntimeError, match="round 4 failed"), Applier(broken, pool) as applier:
            applier.released(4)
            applier.drain()

        # A transfer error leaves the block: work in progress ends, nothing queued runs.
        started, gate, ran = threading.Event(), threading.Event(), []

        def slow(i: int) -> None:
            started.set()
            assert gate.wait(HANG_S)
            ran.append(i)

        with pytest.raises(KeyError), Applier(slow, pool) as applier:
            applier.released(0)
            assert started.wait(HANG_S)
            applier.released(1)
            gate.set()
            raise KeyError("the transfer failed")
        assert ran == [0]
    finally:
        pool.shutdown()
