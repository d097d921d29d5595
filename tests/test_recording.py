"""Learning a layout from an engine's loaders proves plain copies, it does
not assume them: each loader below is the pattern of a real engine's
(Gemma's norm ``+= 1`` in SGLang, a dtype cast, a transposed
``contiguous()``, a parameter scaled after its copy), run by
:func:`record_loads` on meta stand-ins exactly as the vLLM and SGLang
adapters run their models' ``load_weights``."""

from __future__ import annotations

import pytest
import torch

from reshard.adapters.core.recording import LOADER_PREFIX, record_loads
from reshard.plan.box import Box
from reshard.plan.layout import TensorMeta

ROWS, COLS = 6, 4


def _learn(loader, *, strict: bool, live: bool = False, shard: int = 0):
    """Record ``loader(param, name, checkpoint tensor)`` over a model of two
    parameters (``a.weight`` [ROWS/2 or ROWS, COLS], ``b.weight`` [COLS]); with
    ``shard`` = 1 or 2 the first is that half of the rows (a TP shard)."""
    device = "cpu" if live else "meta"
    rows = ROWS // 2 if shard else ROWS
    a = torch.zeros(rows, COLS, device=device)
    b = torch.zeros(COLS, device=device)
    params = {a.untyped_storage()._cdata: ("a.weight", a), b.untyped_storage()._cdata: ("b.weight", b)}
    by_name = {"a.weight": a, "b.weight": b}
    metas = [TensorMeta("a.weight", (ROWS, COLS), "float32"), TensorMeta("b.weight", (COLS,), "float32")]

    def load(weights):
        for name, w in weights:
            if name == "a.weight" and shard:
                w = w.narrow(0, (shard - 1) * rows, rows)
            loader(by_name[name], name, w)

    return record_loads(params, {"a": ["a.weight"], "b": ["b.weight"]}, metas, load, strict=strict)


def plain(param, name, w):
    param.copy_(w)


def gemma_norm(param, name, w):
    # SGLang's Gemma loader: the norm weights are offset in place, then copied.
    if name == "b.weight":
        w += 1.0
    param.copy_(w)


def cast(param, name, w):
    param.copy_(w.to(torch.float16) if name == "a.weight" else w)


def transposed(param, name, w):
    param.copy_(w.t().contiguous().t() if name == "a.weight" else w)


def scaled_after(param, name, w):
    param.copy_(w)
    if name == "b.weight":
        param.mul_(2.0)


def constant(param, name, w):
    param.copy_(torch.zeros_like(w) if name == "b.weight" else w)


@pytest.mark.parametrize("strict", [False, True], ids=["vllm", "sglang"])
def test_plain_copies_are_pieces(strict):
    learned = _learn(plain, strict=strict, live=strict)
    assert not learned.problems() and not learned.via_loader
    assert {(p.tensor.name, p.local, p.box) for p in learned.pieces} == {
        ("a.weight", "a.weight", Box((0, 0), (ROWS, COLS))),
        ("b.weight", "b.weight", Box((0,), (COLS,))),
    }


@pytest.mark.parametrize("strict", [False, True], ids=["vllm", "sglang"])
def test_a_checkpoint_tensor_changed_in_place_goes_through_the_loader(strict):
    learned = _learn(gemma_norm, strict=strict, live=strict)
    assert not learned.problems()
    assert set(learned.via_loader) == {"b.weight"}
    via = learned.via_loader["b.weight"]
    assert via.params == ("b.weight",) and "in place" in via.reason and "add_" in via.reason
    # No plain piece writes it: the refit fetches it whole into a buffer and
    # runs the loader on it.
    assert [(p.tensor.name, p.local) for p in learned.pieces] == [
        ("a.weight", "a.weight"),
        ("b.weight", LOADER_PREFIX + "b.weight"),
    ]
    assert learned.local_shapes[LOADER_PREFIX + "b.weight"] == (COLS,)


@pytest.mark.parametrize("loader", [cast, transposed], ids=["cast", "contiguous-copy"])
def test_values_computed_from_a_checkpoint_tensor_go_through_the_loader(loader):
    learned = _learn(loader, strict=False)
    assert not learned.problems()
    assert set(learned.via_loader) == {"a.weight"}
    assert learned.via_loader["a.weight"].params == ("a.weight",)
    assert learned.via_loader["a.weight"].region == Box((0, 0), (ROWS, COLS))


@pytest.mark.parametrize("shard", [1, 2])
def test_a_loader_tensor_is_fetched_only_where_the_loader_reads_it(shard):
    """A TP shard computed on (here: cast) is fetched as that shard only."""
    learned = _learn(cast, strict=False, shard=shard)
    via = learned.via_loader["a.weight"]
    assert via.region == Box(((shard - 1) * ROWS // 2, 0), (ROWS // 2, COLS))
    (piece,) = [p for p in learned.pieces if p.local == via.local]
    assert piece.box == via.region and piece.local_shape == (ROWS, COLS) and piece.offset == via.region.offsets


def test_a_parameter_written_again_after_its_copy_goes_through_the_loader():
    learned = _learn(scaled_after, strict=False)
    assert set(learned.via_loader) == {"b.weight"}
    assert "b.weight is written again by aten.mul_" in learned.via_loader["b.weight"].reason


def test_live_parameters_written_again_are_refused():
    learned = _learn(scaled_after, strict=True, live=True)
    assert any("b.weight: written by aten.mul_" in p for p in learned.problems())


@pytest.mark.parametrize("strict", [False, True], ids=["vllm", "sglang"])
def test_a_parameter_set_from_values_no_checkpoint_tensor_determines_is_refused(strict):
    learned = _learn(constant, strict=strict, live=strict)
    assert any("b.weight: written from" in p and "no checkpoint tensor determines" in p for p in learned.problems())


def _halves(param, name, w):
    # Two copies that tile the parameter (a fused projection's two halves).
    if name == "a.weight":
        param.narrow(0, 0, ROWS // 2).copy_(w.narrow(0, 0, ROWS // 2))
        param.narrow(0, ROWS // 2, ROWS // 2).copy_(w.narrow(0, ROWS // 2, ROWS // 2))
    else:
        param.narrow(0, 0, 2).copy_(w.narrow(0, 0, 2))


def _twice(param, name, w):
    # The same rows written twice, the last row never: the sizes add up, the boxes do not tile.
    if name == "a.weight":
        param.narrow(0, 0, ROWS // 2).copy_(w.narrow(0, 0, ROWS // 2))
        param.narrow(0, 1, ROWS // 2).copy_(w.narrow(0, 1, ROWS // 2))
        param.narrow(0, ROWS // 2, ROWS // 2 - 1).copy_(w.narrow(0, ROWS // 2, ROWS // 2 - 1))
    else:
        param.copy_(w)


def test_parameters_the_pieces_tile_need_no_zeroing():
    """A refit skips zeroing only the parameters every element of which some
    piece writes exactly once; padding, overlaps and loader tensors keep it."""
    assert _learn(_halves, strict=False).whole() == {"a.weight"}
    assert _learn(plain, strict=False).whole() == {"a.weight", "b.weight"}
    assert _learn(_twice, strict=False).whole() == {"b.weight"}
    # A parameter a loader tensor writes is the loader's to fill.
    assert _learn(scaled_after, strict=False).whole() == {"a.weight"}
