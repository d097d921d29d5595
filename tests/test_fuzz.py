"""Bad input: whatever bytes a rank reads from the store, and whatever layouts
it is handed, it raises a clear error (MetadataError, PlanError) or plans;
it never crashes with an obscure exception and never hangs."""

from __future__ import annotations

import signal
import tracemalloc
from contextlib import contextmanager

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from reshard.errors import MetadataError, PlanError, Problem
from reshard.plan.box import Box
from reshard.plan.index import LayoutSet
from reshard.plan.layout import Grid, Layout, LocalTensor, Mesh, Piece, TensorMeta
from reshard.plan.planner import Planner
from reshard.transport import wire
from reshard.transport.auth import job_keys

from .strategies import problems

FUZZ = settings(max_examples=300, deadline=None)

LAYOUT = wire.RankLayout(
    rank=1,
    table="ab" * 16,
    locals=(LocalTensor("w", (4, 6)),),
    pieces=(Piece(0, Box((0, 0), (4, 6)), 0, (0, 0)),),
    grids=(Grid(tensors=(0, 1, 1), mesh=Mesh(shape=(2,), start=0), shard=((0,), ())),),
)
MESSAGES = [
    wire.Hello(rank=3, role="destination", domain="node-1", host="h", pid=42, checksums=True),
    LAYOUT,
    wire.Table(tensors=(TensorMeta("model.embed_tokens.weight", (128, 64), "bfloat16"),)),
    wire.Status(rank=0, step="plan", refit=7, ok=False, error="x", problems=(Problem(kind="mismatch", message="m"),)),
]
ENCODED = [wire.encode(m) for m in MESSAGES]


HANG_BUDGET_S = 300
"""A hang guard, not a speed check: decoding a few KB, or planning these tiny
layouts (no more work than their pieces and ranks: tests/test_plan_scale.py
counts it), takes a quiet machine milliseconds."""


@contextmanager
def deadline(seconds: float):
    """Fail (instead of hanging) when the body runs longer than ``seconds``."""

    def expire(*_):
        raise TimeoutError(f"took more than {seconds}s: a hang")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _decode(data: bytes) -> None:
    """Decoding raises MetadataError or returns a message; nothing else."""
    with deadline(HANG_BUDGET_S):
        try:
            wire.decode(data)
        except MetadataError as e:
            assert str(e)


# -- metadata -------------------------------------------------------------------


def test_valid_messages_round_trip():
    for m, b in zip(MESSAGES, ENCODED, strict=True):
        assert wire.decode(b, type(m)) == m


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes_never_crash_the_decoder(data):
    _decode(data)


@FUZZ
@given(st.sampled_from(ENCODED), st.data())
def test_truncated_and_corrupted_messages_are_rejected_clearly(blob, data):
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(MetadataError):
        wire.decode(blob[:cut])
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(blob) - 1), st.integers(1, 255)), min_size=1, max_size=4))
    b = bytearray(blob)
    for i, x in flips:
        b[i] ^= x
    _decode(bytes(b))


@pytest.mark.parametrize(
    "blob",
    [
        b"\xdd\xff\xff\xff\xff",  # an array of 4G elements
        b"\xdf\xff\xff\xff\xff",  # a map of 4G entries
        b"\xdb\xff\xff\xff\xff" + b"a" * 10,  # a 4 GB string
        b"\xc6\xff\xff\xff\xff",  # a 4 GB binary
        b"\x91" * 100_000,  # nested arrays
    ],
)
def test_huge_length_prefixes_are_rejected_at_once(blob):
    # Refused from the prefix alone: the decoder allocates next to nothing
    # (tracemalloc sees msgspec's allocations; a list of 1M entries peaks at
    # 9.5 MB), never the 4 GB the prefix asks for.
    tracemalloc.start()
    try:
        with deadline(HANG_BUDGET_S), pytest.raises(MetadataError, match="malformed refit metadata"):
            wire.decode(blob)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_oversized_metadata_is_refused_before_decoding():
    with pytest.raises(MetadataError, match="exceeds the 1024-byte limit"):
        wire.decode(b"\x00" * 1025, limit=1024)
    big = wire.encode(wire.Table(tensors=tuple(TensorMeta(f"t{i}", (1,), "float32") for i in range(50))))
    with pytest.raises(MetadataError, match="exceeds"):
        wire.decode(big, wire.Table, limit=len(big) - 1)


@pytest.mark.parametrize("version", [0, -1, wire.WIRE_VERSION + 1, 2**40])
def test_wrong_wire_versions_are_refused(version):
    blob = wire.encode(msgspec.structs.replace(MESSAGES[0], version=version))
    with pytest.raises(MetadataError, match="wire version"):
        wire.decode(blob)


def test_a_message_of_the_wrong_type_is_refused():
    with pytest.raises(MetadataError, match="expected a Status message, got Hello"):
        wire.decode(ENCODED[0], wire.Status)


@FUZZ
@given(st.binary(max_size=512), st.data())
def test_sealed_values_reject_anything_but_the_original(payload, data):
    keys = job_keys("token-a", "job", 0)
    sealed = keys.seal("e0/layout/1", payload)
    assert keys.open("e0/layout/1", sealed) == payload
    i = data.draw(st.integers(0, len(sealed) - 1))
    forged = bytearray(sealed)
    forged[i] ^= data.draw(st.integers(1, 255))
    for key, value in [
        ("e0/layout/1", bytes(forged)),
        ("e0/layout/1", sealed[:i]),
        ("e0/layout/2", sealed),  # moved to another key
        ("e1/layout/1", sealed),  # replayed into a later epoch
        ("e0/layout/1", data.draw(st.binary(max_size=128))),
    ]:
        with pytest.raises(MetadataError):
            keys.open(key, value)
    with pytest.raises(MetadataError, match="different job token"):
        job_keys("token-b", "job", 0).open("e0/layout/1", sealed)


# -- planning inputs -------------------------------------------------------------


def _plan_everything(src: list[Layout], dst: list[Layout], domain_of: dict[int, int]) -> str:
    """What a session does with the layouts it read: check them, then plan every
    rank. Returns how it ended; any other exception fails the test."""
    ns = len(src)
    world = ns + len(dst)
    try:
        for lay in src:
            wire.check_layout(lay, ranks=range(ns))
        for lay in dst:
            wire.check_layout(lay, ranks=range(ns, world))
    except MetadataError as e:
        assert "layout of rank" in str(e)
        return "metadata"
    try:
        planner = Planner(
            LayoutSet.from_layouts("source", src),
            LayoutSet.from_layouts("destination", dst),
            domain_of=domain_of,
            round_bytes=256,
        )
        planner.check()
        for r in range(world):
            planner.plan_for(r)
    except PlanError as e:
        assert e.problems and str(e)
        return "plan"
    return "ok"


@settings(max_examples=150, deadline=None)
@given(problems(max_ranks=3))
def test_the_layout_check_accepts_every_valid_layout(p):
    ns = len(p.src)
    for lay in p.src:
        wire.check_layout(lay, ranks=range(ns))
    for lay in p.dst:
        wire.check_layout(lay, ranks=range(ns, ns + len(p.dst)))


_INTS = st.sampled_from([-(2**63), -7, -1, 0, 1, 2, 3, 5, 64, 2**31, 2**40, 2**63 - 1])


def _mutate(data, obj):
    """One random change deep inside a layout's plain-data form."""
    if isinstance(obj, tuple):
        obj = list(obj)
    if isinstance(obj, list) and obj and data.draw(st.integers(0, 7)) > 0:
        i = data.draw(st.integers(0, len(obj) - 1))
        how = data.draw(st.sampled_from(["deeper"] * 8 + ["drop", "dup"]))
        out = list(obj)
        if how == "deeper":
            out[i] = _mutate(data, obj[i])
        elif how == "drop":
            del out[i]
        else:
            out.insert(i, obj[i])
        return out
    if isinstance(obj, list) and not obj:
        return obj
    if isinstance(obj, dict) and obj:
        k = data.draw(st.sampled_from(sorted(k for k, v in obj.items() if v not in ([], ()))))
        return {**obj, k: _mutate(data, obj[k])}
    if isinstance(obj, bool):
        return not obj
    if isinstance(obj, int):
        return data.draw(_INTS)
    if isinstance(obj, str):
        return data.draw(st.sampled_from(["", "x", "float32", "int4", "model.g0.t0.weight"]))
    return data.draw(st.one_of(_INTS, st.just([]), st.just(None)))


@st.composite
def mutated_problems(draw) -> tuple[list[Layout], list[Layout], dict[int, int]] | None:
    """A valid problem with one rank's layout changed deep inside (1-3
    changes); ``None`` when the decoder would refuse the changed layout (as
    MetadataError on the wire)."""
    p = draw(problems(max_ranks=3))
    side = draw(st.sampled_from(["src", "dst"]))
    layouts = list(getattr(p, side))
    i = draw(st.integers(0, len(layouts) - 1))
    raw = msgspec.to_builtins(layouts[i])
    data = draw(st.data())
    for _ in range(draw(st.integers(1, 3))):
        raw = _mutate(data, raw)
    try:
        layouts[i] = msgspec.convert(raw, Layout)
    except msgspec.ValidationError:
        return None
    src, dst = (layouts, p.dst) if side == "src" else (p.src, layouts)
    return src, dst, p.domain_of


def _grid(rank: int, start: int, stop: int) -> Grid:
    return Grid(tensors=(start, stop, 1), mesh=Mesh(shape=(1,), ranks=(rank,)), shard=((),))


_STALL_TABLE = tuple(
    TensorMeta(n, (1,), "float32") for n in ("model.g0.t0.weight", "model.g0.t1.weight", "model.g1.t0.weight")
)
STALL = (
    # Found by the fuzzer (seed 255565009511103148063601438894549950811, shrunk):
    # one destination table gives a tensor a dim of 2**40 that the sources
    # hold as [1]; the planner walked every row block of it before comparing
    # the tables, for minutes, on every rank.
    [
        Layout(rank=0, tensors=_STALL_TABLE, grids=(_grid(0, 0, 2), _grid(0, 2, 3))),
        Layout(rank=1, tensors=_STALL_TABLE),
    ],
    [
        Layout(
            rank=2,
            tensors=(TensorMeta("model.g0.t0.weight", (2**40,), "float32"), *_STALL_TABLE[1:]),
            locals=(LocalTensor("model.g0.t1.weight#0", (1,)),),
            pieces=(Piece(1, Box((0,), (1,)), 0, (0,)),),
            grids=(_grid(2, 2, 3),),
        )
    ],
    {0: 0, 1: 0, 2: 0},
)


@FUZZ
@given(mutated_problems())
@example(STALL)
def test_mutated_layouts_are_rejected_clearly_or_planned(case):
    if case is None:
        return
    src, dst, domain_of = case
    with deadline(HANG_BUDGET_S):
        _plan_everything(src, dst, domain_of)


def test_the_stall_the_fuzzer_found_is_refused_by_name():
    src, dst, domain_of = STALL
    assert _plan_everything(src, dst, domain_of) == "plan"
    planner = Planner(
        LayoutSet.from_layouts("source", src), LayoutSet.from_layouts("destination", dst), round_bytes=256
    )
    with pytest.raises(
        PlanError, match=r"source rank 0 has shape \[1\] float32, destination rank 2 needs shape \[1099511627776\]"
    ):
        planner.plan_for(0)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (dict(rank=9), "outside its side's ranks"),
        (dict(tensors=(TensorMeta("w", (4, -6), "float32"),)), "negative size"),
        (dict(tensors=(TensorMeta("w", (4, 6), "int4"),)), "unknown dtype 'int4'"),
        (dict(tensors=(TensorMeta("w", (2**30, 2**30), "float32"),)), "more than 2**48 elements"),
        (dict(pieces=(Piece(0, Box((0,), (4, 6)), 0, (0, 0)),)), "has not the tensor's 2 dims"),
        (dict(pieces=(Piece(3, Box((0, 0), (4, 6)), 0, (0, 0)),)), "outside its tables"),
        (dict(pieces=(Piece(0, Box((0, 0), (4, 6)), 0, (0, 0), (0, 0)),)), "do not map 2 global dims"),
        (dict(grids=(Grid(tensors=(0, 1, 1), mesh=Mesh(shape=(2**21,)), shard=((0,), ())),)), "a mesh of 2097152"),
        (dict(grids=(Grid(tensors=(0, 1, 1), mesh=Mesh(shape=(3,), ranks=(0, 1)), shard=((0,), ())),)), "lists 2"),
        (dict(grids=(Grid(tensors=(0, 1, 1), mesh=Mesh(shape=(4,), start=0), shard=((0,), ())),)), "span 0..3"),
        (dict(grids=(Grid(tensors=(0, 1, 1), mesh=Mesh(shape=(2,)), shard=((0,), (0,))),)), "shard spec"),
        (dict(grids=(Grid(tensors=(0, 5, 1), mesh=Mesh(shape=(2,)), shard=((0,), ())),)), "of a table of 1"),
        (dict(grids=(Grid(tensors=(0, 1, 0), mesh=Mesh(shape=(2,)), shard=((0,), ())),)), "of a table of 1"),
        (dict(version=2), "layout version 2"),
        # Found by the fuzzer: a local's dtype reached the planner's byte counts.
        (dict(locals=(LocalTensor("w", (4, 6), "x"),)), "local tensor 'w' has unknown dtype 'x'"),
        (
            dict(
                grids=(
                    Grid(
                        tensors=(0, 1, 1),
                        mesh=Mesh(shape=(2,)),
                        shard=((0,), ()),
                        local=LocalTensor("g", (2, 6), "int4"),
                    ),
                )
            ),
            "grid 0: local tensor 'g' has unknown dtype 'int4'",
        ),
        (dict(tensors=(TensorMeta("w", (4, 6), "float32"),) * 2), "'w' appears twice in its table"),
    ],
)
def test_malformed_layouts_are_named_precisely(change, needle):
    base = Layout(
        rank=1,
        tensors=(TensorMeta("w", (4, 6), "float32"),),
        locals=(LocalTensor("w", (4, 6)),),
        pieces=(Piece(0, Box((0, 0), (4, 6)), 0, (0, 0)),),
    )
    with pytest.raises(MetadataError, match="layout of rank") as e:
        wire.check_layout(msgspec.structs.replace(base, **change), ranks=range(0, 3))
    assert needle in str(e.value)


@pytest.mark.parametrize("grid", [False, True])
def test_source_ranks_that_disagree_on_a_tensors_rank_are_a_plan_error(grid):
    """Found by the fuzzer: boxes of a rank that disagrees on a tensor's shape
    used to reach the overlap math (IndexError)."""
    a, b = TensorMeta("w", (4, 6), "float32"), TensorMeta("w", (24,), "float32")
    s0 = Layout(
        rank=0, tensors=(a,), locals=(LocalTensor("w", (2, 6)),), pieces=(Piece(0, Box((0, 0), (2, 6)), 0, (0, 0)),)
    )
    s1 = Layout(rank=1, tensors=(b,), locals=(LocalTensor("w", (24,)),), pieces=(Piece(0, Box((0,), (24,)), 0, (0,)),))
    if grid:
        s1 = Layout(
            rank=1, tensors=(b,), grids=(Grid(tensors=(0, 1, 1), mesh=Mesh(shape=(1,), start=1), shard=((0,),)),)
        )
    d = Layout(
        rank=2, tensors=(a,), locals=(LocalTensor("w", (4, 6)),), pieces=(Piece(0, Box((0, 0), (4, 6)), 0, (0, 0)),)
    )
    assert _plan_everything([s0, s1], [d], {0: 0, 1: 0, 2: 0}) == "plan"
    planner = Planner(LayoutSet.from_layouts("source", [s0, s1]), LayoutSet.from_layouts("destination", [d]))
    with pytest.raises(PlanError, match="source ranks disagree on tensor 'w'"):
        planner.plan_for(2)
