"""Hand-worked plans (8->4, 4->8, 4->3, uneven splits) and clear errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import PlanError
from reshard.plan.box import Box, chunk_range, chunks_overlapping
from reshard.plan.index import LayoutSet
from reshard.plan.layout import Grid, Layout, LocalTensor, Mesh, Piece, TensorMeta
from reshard.plan.planner import Planner
from reshard.plan.regions import Endpoint, Region, decide, decide_for


def _grid_layouts(meta: TensorMeta, ranks: list[int], shard_dim: int | None) -> list[Layout]:
    spec = tuple((0,) if d == shard_dim else () for d in range(len(meta.shape)))
    grid = Grid(tensors=(0, 1, 1), mesh=Mesh(shape=(len(ranks),), ranks=tuple(ranks)), shard=spec)
    return [Layout(rank=r, tensors=(meta,), grids=(grid,)) for r in ranks]


def _moves(n: int, src_k: int, dst_k: int) -> list[tuple[int, int, str]]:
    meta = TensorMeta("w", (n, 2), "float32")
    src = list(range(src_k))
    dst = list(range(src_k, src_k + dst_k))
    planner = Planner(
        LayoutSet.from_layouts("source", _grid_layouts(meta, src, 0)),
        LayoutSet.from_layouts("destination", _grid_layouts(meta, dst, 0)),
    )
    out = []
    for r in dst:
        for t in planner.plan_for(r).transfers():
            assert t.kind == "pull" and t.dst.rank == r
            out.append((t.src.rank, t.dst.rank - src_k, str(t.box)))
    return sorted(out)


def test_chunk_rule_matches_torch_chunk_padding():
    # torch.chunk(range(5), 4) gives sizes 2, 2, 1 and DTensor pads a 4th, empty part.
    assert [chunk_range(5, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [chunk_range(10, 3, i) for i in range(3)] == [(0, 4), (4, 8), (8, 10)]
    # vLLM vocab-parallel: 100 rows padded to 128, 4 ranks of 32.
    assert [chunk_range(100, 4, i, block=32) for i in range(4)] == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert list(chunks_overlapping(10, 3, 3, 9)) == [0, 1, 2]
    assert list(chunks_overlapping(5, 4, 4, 5)) == [2]


def test_8_to_4():
    assert _moves(8, 8, 4) == sorted((s, s // 2, f"[{s}:{s + 1}, 0:2]") for s in range(8))


def test_4_to_8():
    assert _moves(8, 4, 8) == sorted((d // 2, d, f"[{d}:{d + 1}, 0:2]") for d in range(8))


def test_4_to_3():
    # src blocks of 3: [0,3) [3,6) [6,9) [9,10); dst blocks of 4: [0,4) [4,8) [8,10)
    assert _moves(10, 4, 3) == sorted(
        [
            (0, 0, "[0:3, 0:2]"),
            (1, 0, "[3:4, 0:2]"),
            (1, 1, "[4:6, 0:2]"),
            (2, 1, "[6:8, 0:2]"),
            (2, 2, "[8:9, 0:2]"),
            (3, 2, "[9:10, 0:2]"),
        ]
    )


def test_uneven_5_rows_4_to_3_with_an_empty_shard():
    # src: [0,2) [2,4) [4,5) and an empty 4th; dst: [0,2) [2,4) [4,5)
    assert _moves(5, 4, 3) == [(0, 0, "[0:2, 0:2]"), (1, 1, "[2:4, 0:2]"), (2, 2, "[4:5, 0:2]")]


def test_row_parallel_to_column_parallel_cuts_both_dims():
    meta = TensorMeta("o_proj.weight", (4, 4), "bfloat16")
    src = _grid_layouts(meta, [0, 1], 1)
    dst = _grid_layouts(meta, [2, 3], 0)
    planner = Planner(LayoutSet.from_layouts("source", src), LayoutSet.from_layouts("destination", dst))
    got = sorted((t.src.rank, t.dst.rank, str(t.box)) for r in (2, 3) for t in planner.plan_for(r).transfers())
    assert got == [
        (0, 2, "[0:2, 0:2]"),
        (0, 3, "[2:4, 0:2]"),
        (1, 2, "[0:2, 2:4]"),
        (1, 3, "[2:4, 2:4]"),
    ]
    assert all(t.nbytes == 8 for t in planner.plan_for(2).transfers())


def test_replicated_source_is_split_between_replicas_and_domains():
    # One tensor replicated on ranks 0 and 1; ranks 2 and 3 (one domain) both need all of it.
    meta = TensorMeta("norm.weight", (64,), "float32")
    src = _grid_layouts(meta, [0, 1], None)
    dst = _grid_layouts(meta, [2, 3], None)
    planner = Planner(
        LayoutSet.from_layouts("source", src),
        LayoutSet.from_layouts("destination", dst),
        domain_of={0: 0, 1: 1, 2: 2, 3: 2},
        split_bytes=128,
    )
    t = planner.traffic()
    # The domain pulls the tensor once (256 bytes), half from each replica,
    # and forwards inside the domain what the other needer lacks.
    assert t.network_bytes == 256
    assert t.net_out[0] == t.net_out[1] == 128
    assert t.nvlink_bytes == 256


def _expect(problem_kind: str, match: str, src: list[Layout], dst: list[Layout]) -> None:
    planner = Planner(LayoutSet.from_layouts("source", src), LayoutSet.from_layouts("destination", dst))
    kinds = [p.kind for p in planner.problems()]
    assert problem_kind in kinds, kinds
    with pytest.raises(PlanError, match=match):
        planner.plan_for(dst[0].rank)


def test_shape_mismatch_names_tensor_shapes_and_ranks():
    src = _grid_layouts(TensorMeta("w", (8, 4), "float32"), [0], 0)
    dst = _grid_layouts(TensorMeta("w", (8, 5), "float32"), [1], 0)
    _expect(
        "mismatch", r"'w': source rank 0 has shape \[8, 4\] float32, destination rank 1 needs shape \[8, 5\]", src, dst
    )


def test_dtype_mismatch_that_is_no_cast():
    src = _grid_layouts(TensorMeta("w", (8,), "int32"), [0], 0)
    dst = _grid_layouts(TensorMeta("w", (8,), "bfloat16"), [1], 0)
    _expect("mismatch", r"int32, destination rank 1 needs shape \[8\] bfloat16 \(int32 cannot be cast", src, dst)
    src = _grid_layouts(TensorMeta("w", (8,), "float8_e4m3fn"), [0], 0)
    dst = _grid_layouts(TensorMeta("w", (8,), "float32"), [1], 0)
    _expect("mismatch", "float8_e4m3fn cannot be cast to float32", src, dst)


def test_float_dtypes_that_differ_move_in_the_source_dtype_and_cast_on_arrival():
    src = _grid_layouts(TensorMeta("w", (8,), "float32"), [0], 0)
    dst = _grid_layouts(TensorMeta("w", (8,), "bfloat16"), [1], 0)
    planner = Planner(LayoutSet.from_layouts("source", src), LayoutSet.from_layouts("destination", dst))
    assert planner.problems() == []
    (t,) = planner.plan_for(1).transfers()
    assert (t.dtype, t.dst.dtype, t.nbytes) == ("float32", "bfloat16", 32)
    assert str(t).endswith("32B float32->bfloat16")
    assert planner.order[0].dtype == "float32"


def test_grids_indexed_in_bulk_keep_every_entry_and_who_declared_each_tensor():
    """A grid's new tensors are indexed in bulk (one packed entry each); a
    second grid holding one of them makes its entries a list, in order, and
    problems still name the rank of the grid that declared it first."""
    a, b = TensorMeta("a", (8,), "float32"), TensorMeta("b", (8,), "float32")
    src = LayoutSet("source")
    src.add_grid((a, b), Grid(tensors=(0, 2, 1), mesh=Mesh(shape=(2,), ranks=(4, 5)), shard=((0,),)))
    assert (src.tensor_grids.get("a"), src.tensor_grids.get("b")) == ([(0, 0)], [(0, 1)])
    src.add_grid((a, b), Grid(tensors=(1, 2, 1), mesh=Mesh(shape=(1,), ranks=(7,)), shard=((),)))
    src.finish()
    assert dict(src.tensor_grids.items()) == {"a": [(0, 0)], "b": [(0, 1), (1, 0)]}
    assert (src.declared_by("a"), src.declared_by("b")) == (4, 4)
    dst = LayoutSet("destination")
    dst.add_grid(
        (TensorMeta("b", (9,), "float32"),), Grid(tensors=(0, 1, 1), mesh=Mesh(shape=(1,), ranks=(9,)), shard=((),))
    )
    dst.finish()
    (p,) = Planner(src, dst).problems()
    assert (
        p.ranks == (4, 9)
        and "'b': source rank 4 has shape [8] float32, destination rank 9 needs shape [9]" in p.message
    )


def test_unknown_tensor():
    src = _grid_layouts(TensorMeta("a", (8,), "float32"), [0], 0)
    dst = _grid_layouts(TensorMeta("b", (8,), "float32"), [1], 0)
    _expect("unknown-tensor", r"published by no source: 'b'", src, dst)


def test_box_out_of_range():
    meta = TensorMeta("w", (8,), "float32")
    src = _grid_layouts(meta, [0], 0)
    dst = [
        Layout(
            rank=1,
            tensors=(meta,),
            locals=(LocalTensor("w", (4,)),),
            pieces=(Piece(0, Box((6,), (4,)), 0, (0,)),),
        )
    ]
    _expect("out-of-range", r"box \[6:10\] is outside tensor 'w' of shape \[8\]", src, dst)


def test_local_box_out_of_range():
    meta = TensorMeta("w", (8,), "float32")
    src = _grid_layouts(meta, [0], 0)
    dst = [
        Layout(rank=1, tensors=(meta,), locals=(LocalTensor("w", (4,)),), pieces=(Piece(0, Box((0,), (4,)), 0, (2,)),))
    ]
    _expect("out-of-range", r"outside local 'w' of shape \[4\]", src, dst)


def test_grid_storage_is_checked_for_the_ranks_asked_in_mesh_order():
    """Rows 0:4 of a grid's first chunk do not fit a local of 3 rows; the
    second chunk's 3 rows do. Every rank of the first chunk is named, in
    mesh order, and a rank that checks only itself finds only its own."""
    meta = TensorMeta("w", (7, 4), "float32")
    mesh = Mesh(shape=(2, 2), ranks=(5, 3, 4, 6))
    grid = Grid(tensors=(0, 1, 1), mesh=mesh, shard=((0,), ()), local=LocalTensor("w", (3, 4)), offset=(0, 0))

    def bad(check_ranks):
        s = LayoutSet("destination", check_ranks=check_ranks)
        s.add_grid((meta,), grid)
        s.finish()
        return [p.ranks for p in s.problems if p.kind == "out-of-range"]

    assert bad(None) == [(5,), (3,)]
    assert bad((3,)) == [(3,)]
    assert bad((6, 3, 5)) == [(5,), (3,)]
    assert bad((4, 6)) == []


def test_overlapping_destination_pieces():
    meta = TensorMeta("w", (8,), "float32")
    src = _grid_layouts(meta, [0], 0)
    dst = [
        Layout(
            rank=1,
            tensors=(meta,),
            locals=(LocalTensor("a", (4,)), LocalTensor("b", (4,))),
            pieces=(Piece(0, Box((0,), (4,)), 0, (0,)), Piece(0, Box((2,), (4,)), 1, (0,))),
        )
    ]
    _expect("overlap", r"rank\(s\) \[1\] need box \[2:4\] of 'w' through two pieces", src, dst)


def test_two_tensors_writing_the_same_local_elements():
    a, b = TensorMeta("a", (4,), "float32"), TensorMeta("b", (4,), "float32")
    src = [Layout(rank=0, tensors=(a, b), grids=(Grid(tensors=(0, 2, 1), mesh=Mesh((1,)), shard=((),)),))]
    dst = [
        Layout(
            rank=1,
            tensors=(a, b),
            locals=(LocalTensor("fused", (6,)),),
            pieces=(Piece(0, Box((0,), (4,)), 0, (0,)), Piece(1, Box((0,), (4,)), 0, (2,))),
        )
    ]
    _expect("overlap", r"pieces of 'a' and 'b' both write local 'fused'", src, dst)


def test_uncovered_bytes():
    meta = TensorMeta("w", (8,), "float32")
    src = [
        Layout(rank=0, tensors=(meta,), locals=(LocalTensor("w", (4,)),), pieces=(Piece(0, Box((0,), (4,)), 0, (0,)),))
    ]
    dst = _grid_layouts(meta, [1], 0)
    _expect("uncovered", r"\[4:8\] of 'w' \(shape \[8\]\) needed by rank\(s\) \[1\] are held by no source", src, dst)


def test_grid_published_by_the_wrong_ranks():
    meta = TensorMeta("w", (8,), "float32")
    src = _grid_layouts(meta, [0], 0)
    dst = _grid_layouts(meta, [1, 2], 0)[:1]  # rank 2 never published its layout
    _expect("grid", r"lists ranks \[1, 2\] but was published by ranks \[1\]", src, dst)


# -- a rank's decisions ------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 9), min_size=0, max_size=5, unique=True),
    st.lists(st.integers(0, 9), min_size=0, max_size=5, unique=True),
    st.booleans(),
    st.lists(st.integers(0, 9), max_size=3, unique=True),
    st.integers(0, 50),
)
def test_decide_for_is_decide_filtered_to_one_rank(pulling, holders, inside, copying, rot):
    """A rank builds only its own decisions; they are exactly the whole
    decision list's that involve it, in the same order."""
    ends = {r: Endpoint(r, ("s", r)) for r in range(10)}
    if not holders and pulling:
        holders = [9]
    reg = Region(
        parts=[Box((0,), (4,))],
        needers=sorted([ends[r] for r in pulling] + [ends[r] for r in copying]),
        holders_in=[ends[r] for r in holders] if inside else [],
        holders_out=[] if inside else [ends[r] for r in holders],
        copies=[(Endpoint(r, ("s", 10 + r)), ends[r]) for r in copying],
        pulling=[ends[r] for r in pulling],
    )
    for rank in range(10):
        want = [x for x in decide(reg, rot) if rank in (x.src.rank, x.dst.rank)]
        assert decide_for(reg, rot, rank) == want
