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
