"""Trainer readers are one registration seam: a reader registered once is
used by ``Sender(model)`` to unwrap, read or refuse, and named in errors."""

from __future__ import annotations

import pytest
import torch

from reshard.plan.box import Box
from reshard.plan.layout import TensorMeta
from reshard.plan.specs import PieceSpec
from reshard.sender.readers import TrainerReader, known_trainers, readers, register_reader
from reshard.sender.trainers import describe_trainer


class Boxed(torch.nn.Module):
    """A trainer's wrapper reshard knows nothing of until a reader says so."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner


class Owned:
    """A source a reader describes outright."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


@pytest.fixture
def registered():
    """Register readers for the test only."""
    before = readers()
    added: list[TrainerReader] = []

    def add(reader: TrainerReader) -> TrainerReader:
        added.append(register_reader(reader))
        return reader

    yield add
    import reshard.sender.readers as r

    r._READERS[:] = list(before)


def test_the_builtin_readers_are_registered_and_named_in_errors():
    names = [r.name for r in readers()]
    for trainer in ("DeepSpeed", "FSDP1", "DistributedDataParallel", "torch.compile", "Megatron"):
        assert any(trainer in n for n in names), trainer
    assert "FSDP1 (FullyShardedDataParallel)" in known_trainers()


def test_a_registered_unwrap_is_read_through(registered):
    model = torch.nn.Linear(3, 2)
    registered(TrainerReader(name="Boxed", unwrap=lambda o: o.inner if isinstance(o, Boxed) else None))
    pieces, grids, local = describe_trainer(Boxed(model), rank=0, rename=lambda n: n)
    assert not grids
    assert sorted(p.tensor.name for p in pieces) == ["bias", "weight"]
    assert local["weight"].data_ptr() == model.weight.data_ptr()


def test_a_registered_describe_owns_its_source(registered):
    t = torch.arange(6.0).view(2, 3)
    meta = TensorMeta("w", (2, 3), "float32")

    def describe(source, ctx):
        if not isinstance(source, Owned):
            return None
        return [PieceSpec(meta, Box((0, 0), (2, 3)), "w", (2, 3))], [], {"w": source.t}

    registered(TrainerReader(name="Owned", describe=describe))
    pieces, _, local = describe_trainer(Owned(t), rank=3)
    assert [p.tensor for p in pieces] == [meta] and local["w"] is t


def test_a_registered_refusal_names_the_tensor_the_wrapper_and_the_rank(registered):
    model = torch.nn.Linear(3, 2)
    model.weight.odd = True  # type: ignore[attr-defined]

    def refuse(name, t, ctx):
        return f"rank {ctx.rank}: {name!r} of {ctx.where} is odd" if getattr(t, "odd", False) else None

    registered(TrainerReader(name="Boxed", unwrap=lambda o: o.inner if isinstance(o, Boxed) else None))
    registered(TrainerReader(name="Odd", refuse=refuse))
    with pytest.raises(ValueError, match=r"rank 5: 'weight' of Boxed > Linear is odd"):
        describe_trainer(Boxed(model), rank=5)


def test_a_megatron_shard_passed_as_a_module_points_to_its_reader():
    model = torch.nn.Linear(4, 4)
    model.weight.tensor_model_parallel = True  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="MegatronSource"):
        describe_trainer(model, rank=0)


def test_registering_a_reader_again_replaces_it(registered):
    registered(TrainerReader(name="Twice", refuse=lambda *_: None))
    registered(TrainerReader(name="Twice"))
    assert [r.name for r in readers()].count("Twice") == 1
