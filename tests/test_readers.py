"""Trainer readers are one registration seam: the built-ins are listed once,
in a documented order, a registered reader is used by ``Sender(model)`` to
unwrap, read or refuse, and named in errors; a name is registered once, and
an object two readers claim is refused naming both."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from reshard.plan.box import Box
from reshard.plan.layout import TensorMeta
from reshard.plan.specs import PieceSpec
from reshard.sender import deepspeed, fsdp1, lora_adapter, megatron, peft
from reshard.sender.held import Held
from reshard.sender.readers import Description, TrainerReader
from reshard.sender.trainers import BUILTIN, describe_trainer, known_trainers, readers, register_reader

DOCS = Path(__file__).resolve().parents[1] / "docs"


class Boxed(torch.nn.Module):
    """A trainer's wrapper reshard knows nothing of until a reader says so."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner


class Owned:
    """A source a reader describes outright."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _boxed_unwrap(o):
    return o.inner if isinstance(o, Boxed) else None


def _owned(source, ctx):
    if not isinstance(source, Owned):
        return None
    meta = TensorMeta("w", tuple(source.t.shape), "float32")
    return Description(
        [PieceSpec(meta, Box((0, 0), tuple(source.t.shape)), "w", tuple(source.t.shape))], [], {"w": source.t}
    )


@pytest.fixture
def registered():
    """Register readers for the test only."""
    from reshard.sender import trainers

    before = list(trainers._REGISTERED)
    yield register_reader
    trainers._REGISTERED[:] = before


def test_the_builtin_readers_are_listed_once_in_their_documented_order():
    """The trainers that keep the weights first (wrappers and storage), then
    the sources read whole; docs/trainers.md lists them in this order."""
    names = [r.name for r in BUILTIN]
    assert names == [
        deepspeed.READER.name,
        fsdp1.READER.name,
        "DistributedDataParallel",
        "torch.compile",
        megatron.READER.name,
        peft.READER.name,
        lora_adapter.READER.name,
    ]
    assert len(set(names)) == len(names)
    assert readers()[: len(BUILTIN)] == BUILTIN
    text = (DOCS / "trainers.md").read_text()
    section = text.split("## Built-in readers", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\d+\. `([^`]+)`", section, flags=re.M) == names
    assert known_trainers() == ", ".join([*names, "FSDP2 / DTensor", "plain tensors"])


def test_the_megatron_reader_is_reached_by_the_names_users_import():
    import reshard.adapters.megatron as front

    for name in megatron.__all__:
        if name != "READER":
            assert getattr(front, name) is getattr(megatron, name), name
    assert front.megatron_sender.__module__ == "reshard.adapters.megatron"


def test_a_registered_unwrap_is_read_through(registered):
    model = torch.nn.Linear(3, 2)
    registered(TrainerReader(name="Boxed", unwrap=_boxed_unwrap))
    pieces, grids, local = describe_trainer(Boxed(model), rank=0, rename=lambda n: n)
    assert not grids
    assert sorted(p.tensor.name for p in pieces) == ["bias", "weight"]
    assert local["weight"].data_ptr() == model.weight.data_ptr()


def test_a_registered_describe_owns_its_source(registered):
    t = torch.arange(6.0).view(2, 3)
    registered(TrainerReader(name="Owned", describe=_owned))
    described = describe_trainer(Owned(t), rank=3)
    assert isinstance(described, Description)
    assert [p.tensor for p in described.pieces] == [TensorMeta("w", (2, 3), "float32")]
    assert described.tensors["w"] is t


def test_a_describe_that_returns_no_description_is_refused_by_name(registered):
    def loose(source, ctx):
        return None if not isinstance(source, Owned) else ([], [], {"w": source.t})

    registered(TrainerReader(name="Loose", describe=loose))
    with pytest.raises(
        TypeError, match=r"rank 2: trainer reader 'Loose' described Owned as a tuple, not a .*Description"
    ):
        describe_trainer(Owned(torch.zeros(1)), rank=2)


def test_a_registered_refusal_names_the_tensor_the_wrapper_and_the_rank(registered):
    model = torch.nn.Linear(3, 2)
    model.weight.odd = True  # type: ignore[attr-defined]

    def refuse(name, t, ctx):
        return f"rank {ctx.rank}: {name!r} of {ctx.where} is odd" if getattr(t, "odd", False) else None

    registered(TrainerReader(name="Boxed", unwrap=_boxed_unwrap))
    registered(TrainerReader(name="Odd", refuse=refuse))
    with pytest.raises(ValueError, match=r"rank 5: 'weight' of Boxed > Linear is odd"):
        describe_trainer(Boxed(model), rank=5)


def test_a_megatron_shard_passed_as_a_module_points_to_its_reader():
    model = torch.nn.Linear(4, 4)
    model.weight.tensor_model_parallel = True  # type: ignore[attr-defined]
    with pytest.raises(
        ValueError, match=r"rank 0: 'weight' of Linear .*pass Sender a reshard\.sender\.megatron\.MegatronSource"
    ):
        describe_trainer(model, rank=0)


def test_a_name_is_registered_once(registered):
    registered(TrainerReader(name="Twice", refuse=lambda *_: None))
    with pytest.raises(ValueError, match="'Twice' is already registered; give the new one another name"):
        registered(TrainerReader(name="Twice"))
    with pytest.raises(ValueError, match=r"'torch\.compile' is already registered \(a built-in\)"):
        registered(TrainerReader(name="torch.compile"))
    assert [r.name for r in readers()].count("Twice") == 1


def test_registered_readers_come_after_the_builtins_in_registration_order(registered):
    a = registered(TrainerReader(name="A"))
    b = registered(TrainerReader(name="B"))
    assert readers() == (*BUILTIN, a, b)
    assert known_trainers().endswith("A, B, FSDP2 / DTensor, plain tensors")


def test_a_source_two_readers_describe_is_refused_naming_both(registered):
    registered(TrainerReader(name="Owned", describe=_owned))
    registered(TrainerReader(name="Owned too", describe=_owned))
    with pytest.raises(
        TypeError, match=r"rank 4: the source Owned is claimed by 2 trainer readers, 'Owned' and 'Owned too'"
    ):
        describe_trainer(Owned(torch.zeros(2, 2)), rank=4)


def test_a_wrapper_two_readers_unwrap_is_refused_naming_both(registered):
    registered(TrainerReader(name="Boxed", unwrap=_boxed_unwrap))
    registered(TrainerReader(name="Also boxed", unwrap=_boxed_unwrap))
    with pytest.raises(
        TypeError, match=r"rank 1: the wrapper Boxed is claimed by 2 trainer readers, 'Boxed' and 'Also boxed'"
    ):
        describe_trainer(Boxed(torch.nn.Linear(2, 2)), rank=1)


def _whole(name, t, ctx):
    return [Held(name, tuple(t.shape), Box((0,) * t.dim(), tuple(t.shape)), t.detach())] if t.dim() == 2 else None


def test_a_tensor_two_readers_read_is_refused_naming_both(registered):
    registered(TrainerReader(name="Mine", tensor=_whole))
    registered(TrainerReader(name="Also mine", tensor=_whole))
    with pytest.raises(
        TypeError,
        match=r"rank 6: 'weight' of Linear \(Parameter, shape \[2, 3\]\) is claimed by 2 trainer readers, "
        r"'Mine' and 'Also mine'",
    ):
        describe_trainer(torch.nn.Linear(3, 2), rank=6)


def test_a_tensor_a_module_reader_and_a_tensor_reader_claim_is_refused_naming_both(registered):
    def units(model, ctx):
        yield [], {id(model.weight)}

    registered(TrainerReader(name="Units", modules=units))
    registered(TrainerReader(name="Mine", tensor=_whole))
    with pytest.raises(TypeError, match=r"rank 0: 'weight' of Linear \(Parameter.* 'Units' and 'Mine'"):
        describe_trainer(torch.nn.Linear(3, 2), rank=0)
    from reshard.sender import trainers

    trainers._REGISTERED.pop()
    registered(TrainerReader(name="Units too", modules=units))
    with pytest.raises(TypeError, match=r"rank 0: 'weight' of Linear \(Parameter.* 'Units' and 'Units too'"):
        describe_trainer(torch.nn.Linear(3, 2), rank=0)


def test_a_draft_module_is_published_beside_the_policy_under_the_drafter_names():
    """``Sender(policy, draft=...)``: the drafter read as the policy is (any
    reader), its checkpoint names under ``draft.`` (or none, for MTP layers
    that carry the policy checkpoint's names), its local tensors apart; a
    name both publish is refused."""
    from reshard.errors import ReshardError
    from reshard.sender.trainers import with_draft

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Module()
            self.model.proj = torch.nn.Linear(4, 3, bias=False)

    policy = describe_trainer(Tiny(), rank=0)
    draft_module = Tiny()
    both = with_draft(policy, describe_trainer(draft_module, rank=0))
    names = sorted(p.tensor.name for p in both.pieces)
    assert names == ["draft.model.proj.weight", "model.proj.weight"]
    (drafted,) = [p for p in both.pieces if p.tensor.name.startswith("draft.")]
    assert both.tensors[drafted.local] is draft_module.model.proj.weight or torch.equal(
        both.tensors[drafted.local], draft_module.model.proj.weight
    )
    assert drafted.local != "model.proj.weight"
    mtp = {"model.layers.2.eh_proj.weight": torch.zeros(3, 8)}
    assert {p.tensor.name for p in with_draft(policy, describe_trainer(mtp, rank=0), "").pieces} == {
        "model.proj.weight",
        "model.layers.2.eh_proj.weight",
    }
    with pytest.raises(ReshardError, match="both publish"):
        with_draft(policy, describe_trainer(Tiny(), rank=0), "")
