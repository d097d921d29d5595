"""The planner's cost does not grow with tensor bytes: the round table is
arithmetic (checked against a block-by-block oracle), a refusal comes before
any work that grows with sizes or ranks, and a layout scaled up by 2**20
plans the same transfers with the same work (counted in lines the planner
runs, not seconds)."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import msgspec
from hypothesis import example, given, settings
from hypothesis import strategies as st

from reshard.errors import PlanError
from reshard.plan.box import Box
from reshard.plan.index import LayoutSet, natural_key, natural_order
from reshard.plan.layout import DTYPE_SIZES, Grid, Layout, LocalTensor, Mesh, Piece, TensorMeta
from reshard.plan.planner import Planner
from reshard.plan.rounds import SHARE_UNITS, RoundTable

from .strategies import problems

SCALE = 2**20
PLAN_DIR = str(Planner.__module__.replace(".", "/").rsplit("/", 1)[0])


def _oracle_rounds(metas, round_bytes, shares):
    """The round of every row block, walked block by block (the planner's
    rule before it became arithmetic)."""
    out = []
    rnd, fill = 0, 0
    for i, meta in enumerate(metas):
        rows = meta.shape[0] if meta.shape else 1
        numel = math.prod(meta.shape)
        share = numel if shares is None else min(max(shares[i], 1), numel)
        row_bytes = meta.nbytes // rows if rows else 0
        row_weight = row_bytes * -(-share * SHARE_UNITS // numel) if numel else 0
        rpb = max(1, round_bytes * SHARE_UNITS // row_weight) if row_weight else max(rows, 1)
        blocks = []
        for b in range(max(1, -(-rows // rpb))):
            ub = min(rpb, rows - b * rpb) * row_weight
            if fill and fill + ub > round_bytes * SHARE_UNITS:
                rnd += 1
                fill = 0
            fill += ub
            blocks.append(rnd)
        out.append((rpb, blocks))
    return out, (rnd + 1 if metas else 0)


_METAS = st.lists(
    st.tuples(
        st.lists(st.integers(0, 40), min_size=0, max_size=3),
        st.sampled_from(sorted(DTYPE_SIZES)),
        st.integers(0, 2000),
    ),
    max_size=8,
)


@settings(max_examples=400, deadline=None)
@given(_METAS, st.integers(1, 5000), st.booleans())
@example([([3], "float32", 0), ([40, 7], "float32", 100)], 33, True)
def test_the_round_table_equals_the_block_by_block_oracle(specs, round_bytes, with_shares):
    metas = [TensorMeta(f"t{i}", tuple(shape), dtype) for i, (shape, dtype, _) in enumerate(specs)]
    shares = [s for _, _, s in specs] if with_shares else None
    table = RoundTable(metas, round_bytes, shares)
    blocks, num_rounds = _oracle_rounds(metas, round_bytes, shares)
    assert table.num_rounds == num_rounds
    for i, (rpb, rounds) in enumerate(blocks):
        assert table.rows_per_block[i] == rpb
        assert [table.block_round(i, b) for b in range(table.num_blocks[i])] == rounds
        assert table.single(i) == (rounds[0] if len(rounds) == 1 else None)
        rows = metas[i].shape[0] if metas[i].shape else 1
        if metas[i].shape and rows:
            box = Box((0,) * len(metas[i].shape), metas[i].shape)
            parts = table.split(i, box)
            assert [r for r, _ in parts] == rounds
            assert sum(b.sizes[0] for _, b in parts) == rows


_NAME = st.text(alphabet="ab._\n\x000123456789\u0663\u00e9", max_size=12)


@settings(max_examples=400, deadline=None)
@given(st.lists(_NAME, max_size=12), st.sampled_from([1, 19, 20, 21, 30]))
@example(["a.10", "a.9", "a.009", "a.", "a.!", "a9", "a"], 1)
def test_natural_order_is_the_order_of_natural_key(names, width):
    """The one-pass order of many names equals sorting by the tuple key,
    ties kept in input order, for names that take the fallback too."""
    metas = [TensorMeta(n, (1,), "float32") for n in names]
    metas += [TensorMeta("x" + "7" * width, (1,), "float32"), TensorMeta("x8", (1,), "float32")]
    assert [m.name for m in natural_order(metas)] == [m.name for m in sorted(metas, key=lambda m: natural_key(m.name))]


# -- work, counted ------------------------------------------------------------------


def _work(fn: Callable[[], object]) -> tuple[int, object]:
    """Lines of ``reshard/plan/`` that ``fn`` runs, and what it returned.

    ``fn`` runs once untraced first, so the caches of layout helpers (shared
    by every planner) are warm for both sides of a comparison."""
    fn()
    lines = 0

    def local(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
        return local

    def tracer(frame, event, arg):
        return local if PLAN_DIR in frame.f_code.co_filename else None

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        out = fn()
    finally:
        sys.settrace(old)
    return lines, out


# -- scaling a layout ---------------------------------------------------------------
#
# Every tensor gets a trailing dim of ``n`` elements that no rank cuts, at
# ``n = 1`` and at ``n = SCALE``: each tensor, box, local and piece grows by
# exactly SCALE times from one to the other, with the same dims and rows.


def _scale_layout(lay: Layout, n: int) -> Layout:
    def box(b: Box) -> Box:
        return Box((*b.offsets, 0), (*b.sizes, n))

    def local(lt: LocalTensor) -> LocalTensor:
        return LocalTensor(lt.name, (*lt.shape, n), lt.dtype)

    pieces = []
    for p in lay.pieces:
        ndim, local_ndim = len(lay.tensors[p.tensor].shape), len(lay.locals[p.local].shape)
        dims = (*(p.dims or range(ndim)), local_ndim) if p.dims or ndim != local_ndim else ()
        pieces.append(Piece(p.tensor, box(p.box), p.local, (*p.offset, 0), dims))
    grids = []
    for g in lay.grids:
        extra: dict = {}
        if g.local is not None:
            extra = dict(
                local=local(g.local), offset=(*g.offset, 0), step=(*g.step, 0), dims=(*g.dims, len(g.local.shape))
            )
        shard = (*g.shard, *((),) * (len(lay.tensors[g.tensors[0]].shape) - len(g.shard)), ())
        grids.append(msgspec.structs.replace(g, shard=shard, block=(*g.block, 0) if g.block else (), **extra))
    return Layout(
        rank=lay.rank,
        tensors=tuple(TensorMeta(m.name, (*m.shape, n), m.dtype) for m in lay.tensors),
        locals=tuple(local(lt) for lt in lay.locals),
        pieces=tuple(pieces),
        grids=tuple(grids),
    )


def _planner(src, dst, domain_of, round_bytes) -> Planner:
    return Planner(
        LayoutSet.from_layouts("source", src),
        LayoutSet.from_layouts("destination", dst),
        domain_of=domain_of,
        round_bytes=round_bytes,
        # No region is split: a split cuts the largest dim, which scaling changes.
        split_bytes=1 << 62,
    )


def _unscaled(t, n: int) -> tuple:
    """A transfer of the layout grown by ``n``, with its trailing dim dropped."""
    b = t.box
    ends = (t.src.rank, t.src.local, t.dst.rank, t.dst.local)
    return (t.tensor, b.offsets[:-1], b.sizes[:-1], *ends, str(t.kind), t.round, t.nbytes // n)


def _plan_all(planner: Planner, ranks) -> dict:
    planner.check()
    return {r: planner.plan_for(r) for r in ranks}


@settings(max_examples=150, deadline=None)
@given(problems(max_ranks=3), st.sampled_from([7, 64, 256]))
def test_a_layout_scaled_up_plans_alike_with_no_more_work(p, round_bytes):
    ranks = p.ranks

    def plans(n: int) -> dict:
        src, dst = [_scale_layout(x, n) for x in p.src], [_scale_layout(x, n) for x in p.dst]
        return _plan_all(_planner(src, dst, p.domain_of, round_bytes * n), ranks)

    small_work, small = _work(lambda: plans(1))
    big_work, big = _work(lambda: plans(SCALE))
    for r in ranks:
        got = sorted(_unscaled(t, SCALE) for t in big[r].transfers())
        assert got == sorted(_unscaled(t, 1) for t in small[r].transfers())
        assert big[r].num_rounds == small[r].num_rounds
    assert big_work <= small_work


@settings(max_examples=100, deadline=None)
@given(problems(max_ranks=3))
def test_indexing_checking_and_costing_do_no_more_work_at_any_size(p):
    """With the round budget fixed, only the plan's own rounds grow with bytes:
    building the planner, its checks and the whole plan's traffic do not."""

    def run(n: int) -> int:
        src, dst = [_scale_layout(x, n) for x in p.src], [_scale_layout(x, n) for x in p.dst]
        planner = _planner(src, dst, p.domain_of, 256)
        planner.check()
        return planner.traffic().network_bytes

    small_work, small = _work(lambda: run(1))
    big_work, big = _work(lambda: run(SCALE))
    assert big == small * SCALE
    # A tensor cut into several row blocks takes other branches of the round
    # table's packing: a few lines per tensor, the same at any size.
    assert big_work <= small_work + 4 * len(p.table)


# -- refusals come first ---------------------------------------------------------


def _one_tensor(rank: int, shape: tuple[int, ...]) -> Layout:
    meta = TensorMeta("model.w", shape, "float32")
    return Layout(
        rank=rank, tensors=(meta,), grids=(Grid(tensors=(0, 1, 1), mesh=Mesh(shape=(1,), start=rank), shard=((0,),)),)
    )


def test_a_destination_that_disagrees_on_a_huge_tensor_is_refused_without_walking_it():
    """The fuzzer's stall: one destination rank's table gives a tensor a dim
    of 2**40 while the others agree on a small one. Every rank refuses it by
    name, and the work does not depend on the bad size."""

    def refuse(size: int) -> tuple[int, str]:
        src = [_one_tensor(0, (8, 4))]
        dst = [_one_tensor(1, (8, 4)), _one_tensor(2, (size, 4))]
        planner = Planner(
            LayoutSet.from_layouts("source", src),
            LayoutSet.from_layouts("destination", dst),
            round_bytes=256,
        )
        messages = []
        for r in range(3):
            try:
                planner.plan_for(r)
            except PlanError as e:
                messages.append(str(e))
        assert len(messages) == 3
        return messages[0]

    small_work, _ = _work(lambda: refuse(9))
    big_work, big = _work(lambda: refuse(2**40))
    assert "destination ranks disagree on tensor 'model.w'" in big
    assert "[1099511627776, 4]" in big and "rank 2" in big
    assert big_work == small_work


# -- what grows with the world ----------------------------------------------------


def test_an_engine_ranks_plan_does_not_grow_per_tensor_with_engine_replicas():
    """Engine replicas added, the trainer kept: an engine rank has the same
    transfers, and its planning work and memory grow by a few lines and
    bytes per added rank (its meshes list their ranks), less than one line
    or one pointer per tensor and added rank (benchmarks/plan_scale.py
    measures the same at DeepSeek-V3 scale)."""
    import json
    import tracemalloc
    from pathlib import Path

    import reshard.models
    from reshard.costmodel.rules import EngineSpec, TrainerSpec, engine_layouts, trainer_layouts
    from reshard.models.canonical import canonical_tensors
    from reshard.plan.layout import clear_caches

    configs = Path(reshard.models.__file__).parent / "configs"
    config = json.loads((configs / "qwen3-30b-a3b.json").read_text())
    config.update(num_hidden_layers=2, num_experts=32)
    tensors = tuple(canonical_tensors(config))
    trainer = TrainerSpec.parse("pp=2,ep=2")
    t_side = trainer_layouts(tensors, config, trainer)
    rank = trainer.world  # the first engine rank

    def cost(dp: int) -> tuple[int, int, list[str]]:
        e_side = engine_layouts(tensors, config, EngineSpec(tp=2, dp=dp), base=trainer.world)

        def plan():
            clear_caches()  # as the rank's own process: no mesh index yet
            src = t_side.layout_set("source", check_ranks=(rank,))
            dst = e_side.layout_set("destination", check_ranks=(rank,))
            return Planner(src, dst, domain_of=lambda r: r // 8).plan_for(rank)

        work, got = _work(plan)
        clear_caches()
        tracemalloc.start()
        try:
            plan()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        return work, peak, sorted(str(t) for t in got.transfers())

    small_work, small_peak, small = cost(2)
    big_work, big_peak, big = cost(64)
    added = 2 * (64 - 2)
    assert big == small and len(small) > len(tensors)
    assert big_work - small_work < added * len(tensors) // 2
    assert big_peak - small_peak < added * len(tensors) * 8
