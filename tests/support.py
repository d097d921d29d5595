"""What several test modules share: the refit group config of a test that
expects its refits to succeed, one way to wait for a state, files written
so that a reader never sees half of one, and the random-layout helpers that
move a problem's bytes and check them (``tests/test_transport.py`` and the
modules that reuse its problems).

Tests wait for events (a store key, a file, a server's own state), never for
time to pass: :func:`wait_for` polls the state itself, and its budget is a
hang guard that no busy machine reaches, never the thing a test asserts.
"""

from __future__ import annotations

import os
import re
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import torch

from reshard import GroupConfig
from reshard.plan.index import LayoutSet
from reshard.plan.layout import Layout, Slot, TensorMeta
from reshard.receiver import Receiver, Tensors
from reshard.sender import Sender

from .procs import GROUP_TIMEOUT_S

if TYPE_CHECKING:
    from .strategies import Problem

T = TypeVar("T")

NON_DEFAULT_SETTINGS: dict[str, Any] = dict(
    address="trainer-0:29611",
    num_sources=3,
    num_destinations=5,
    job="j",
    generation=4,
    timeout_s=12.5,
    backend="gloo",
    checksums=True,
    max_metadata_bytes=1 << 20,
    shared_memory=True,
    export_sources=True,
    delta=True,
    delta_budget_bytes=1 << 30,
    replica_size=1,
    min_replicas=1,
    join_timeout_s=5.0,
    replica_timeout_s=7.0,
)
"""Every ``GroupConfig`` setting of scope ``group`` or ``trainer``, away
from its default (``tests/test_group_settings.py`` holds it to the config):
what the tests that carry settings to engines and frameworks send."""

HANG_S = 2 * GROUP_TIMEOUT_S
"""The budget of a wait or join that only a hang exhausts: twice the group
timeout, so a rank that fails by its own timeout reports that first."""


# -- refit groups ------------------------------------------------------------------


def group_kwargs(address: str, num_sources: int, num_destinations: int, **overrides: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`group_config`, for configs that travel
    as plain dicts (to an engine, or to trainer processes)."""
    return {
        "address": address,
        "num_sources": num_sources,
        "num_destinations": num_destinations,
        "timeout_s": GROUP_TIMEOUT_S,
        "host_store": False,
        **overrides,
    }


def group_config(address: str, num_sources: int, num_destinations: int, **overrides: Any) -> GroupConfig:
    """The group of a test whose ranks must join and whose refits must
    succeed: the store is the test's (``host_store=False``) and the timeout
    is :data:`tests.procs.GROUP_TIMEOUT_S`, a hang guard. Tests of failures
    pass the timeout they exercise."""
    return GroupConfig(**group_kwargs(address, num_sources, num_destinations, **overrides))


# -- local tensors with a test's hooks ---------------------------------------------


class Watched(Tensors):
    """A rank's tensors (:class:`reshard.receiver.Tensors`) whose lifecycle
    steps also run a test's callables: ``begin(plan)`` once every rank
    agreed, ``landed(i)`` after each round (a test fails or kills a rank
    there)."""

    def __init__(
        self,
        tensors,
        *,
        begin: Callable[[Any], None] | None = None,
        landed: Callable[[int], None] | None = None,
        private: bool = False,
    ) -> None:
        super().__init__(tensors, private=private)
        self._begin, self._landed = begin, landed

    def begin(self, plan) -> None:
        if self._begin is not None:
            self._begin(plan)

    def landed(self, index: int, changed) -> None:
        if self._landed is not None:
            self._landed(index)


# -- waiting for a state -----------------------------------------------------------


def wait_for(predicate: Callable[[], T], budget_s: float, what: str) -> T:
    """Poll ``predicate`` until it returns something true and return that;
    fail naming ``what`` if ``budget_s`` runs out first (a hang guard: pick a
    budget no slow machine reaches)."""
    deadline = time.monotonic() + budget_s
    pause = 0.005
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {budget_s:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def noticed(error: str, dead: int) -> bool:
    """Whether a refit's ``error`` says it ended on an event that shows rank
    ``dead`` gone, not on a timeout: a link to it that failed (the executor's
    "(while exchanging with ranks [...])", or a shared-memory peer's "rank N
    (pid P, shared memory) died"), from this rank or from the rank whose
    abort stopped it, or the group rebuilt by the process that replaced it.
    A timeout says "did not complete within" (the executor) or "Timed out"
    (gloo) instead."""
    links = re.findall(r"\(while exchanging with ranks \[([\d, ]+)\]\)", error)
    on_link = any(dead in (int(r) for r in ranks.split(", ")) for ranks in links)
    died = f"rank {dead} (pid " in error and "shared memory) died" in error
    rebuilt = "the refit group was rebuilt by another rank" in error
    timed_out = "did not complete within" in error or "Timed out" in error
    return (on_link or died or rebuilt) and not timed_out


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` under a temporary name, then rename it: a
    reader that sees the file sees all of it."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, p)


def read_when_written(path: str | os.PathLike, budget_s: float = HANG_S) -> str:
    """The text of ``path`` once some process wrote it (with
    :func:`write_atomically`, or as an empty marker file)."""
    p = Path(path)
    wait_for(p.exists, budget_s, f"{p} to be written")
    return p.read_text()


# -- random layouts: bytes and checks ------------------------------------------------

MAX_WORLD = 5
"""The most ranks a collected problem may have (:func:`collect_problems`)."""


def global_tensor(meta: TensorMeta) -> torch.Tensor:
    """Deterministic random bytes for a canonical tensor (any dtype, bit patterns included)."""
    g = torch.Generator().manual_seed(zlib.crc32(meta.name.encode()))
    dtype = getattr(torch, meta.dtype)
    n = 1
    for s in meta.shape:
        n *= s
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(meta.shape)


def expand(layout: Layout) -> list[tuple[TensorMeta, Slot]]:
    """Every (tensor, slot) of one rank's layout, grids expanded for that rank."""
    ls = LayoutSet.from_layouts("x", [layout])
    out = []
    for name, slots in ls.tensor_slots.items():
        out += [(ls.metas[name], s) for s in slots]
    for name, entries in ls.tensor_grids.items():
        meta = ls.metas[name]
        for gid, pos in entries:
            info = ls.grids[gid]
            for c in info.coord_of.get(layout.rank, ()):
                s = info.slot(meta, pos, layout.rank, c)
                if not s.box.is_empty():
                    out.append((meta, s))
    return out


def local_view(t: torch.Tensor, slot: Slot, box) -> torch.Tensor:
    offs, sizes = slot.local_box(box)
    v = t[tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))]
    kept, to_global, _ = slot.axes()
    return v.reshape([v.shape[k] for k in kept]).permute(to_global)


def make_locals(items, fill_from_global: bool) -> dict[str, torch.Tensor]:
    # A local's dtype: the one any of its slots names (a cast), else its tensors'.
    dtypes: dict[str, str] = {}
    for meta, s in items:
        if s.dtype or s.local not in dtypes:
            dtypes[s.local] = s.dtype or dtypes.get(s.local) or meta.dtype
    tensors: dict[str, torch.Tensor] = {}
    for meta, s in items:
        t = tensors.setdefault(s.local, torch.zeros(s.local_shape, dtype=getattr(torch, dtypes[s.local])))
        if fill_from_global:
            g = global_tensor(meta)[tuple(slice(o, o + n) for o, n in zip(s.box.offsets, s.box.sizes, strict=True))]
            local_view(t, s, s.box).copy_(g)
    return tensors


PROBLEMS_SEED = 0xF62DCE8775BD0538CFF55B243B7100CF551D78C113A6FC4F3DE03F694A3E1B17F08693F246233338F2E0443698EF9E2B
"""The seed :func:`collect_problems` draws with: the one Hypothesis derived
(``derandomize``) from the source of the collector this replaces, so the
problems are the ones the tests always played. Derived seeds change with
every edit of the collector's source; a pinned one does not."""


def collect_problems(n: int) -> list[Problem]:
    """The first ``n`` problems the strategy draws with :data:`PROBLEMS_SEED`
    (the same ones every run) that have at most :data:`MAX_WORLD` ranks."""
    from hypothesis import Phase, given, seed, settings

    from .strategies import problems

    found: list[Problem] = []

    @seed(PROBLEMS_SEED)
    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None)
    @given(problems(max_ranks=3))
    def collect(p):
        if len(p.ranks) <= MAX_WORLD:
            found.append(p)

    collect()
    return found


def encode_problem(p: Problem) -> bytes:
    """A problem as ranks in other processes read it (:func:`run_problems`)."""
    return msgspec.msgpack.encode({"src": p.src, "dst": p.dst, "domains": p.domain_of})


def run_problems(rank: int, port: int, encoded: list[bytes], budget: int, shm: bool | str = False) -> list[str]:
    """One process: play rank ``rank`` in every problem it takes part in
    (``shm``: over shared memory, each problem's ranks split over two hosts;
    ``"export"``: with the trainers' tensors exported to shared memory)."""
    done = []
    for i, blob in enumerate(encoded):
        p = msgspec.msgpack.decode(blob, type=dict[str, object])
        src = msgspec.convert(p["src"], list[Layout])
        dst = msgspec.convert(p["dst"], list[Layout])
        domains = msgspec.convert(p["domains"], dict[int, int])
        if rank not in domains:
            continue
        cfg = group_config(
            f"127.0.0.1:{port}",
            len(src),
            len(dst),
            job=f"p{i}",
            domain=f"d{domains[rank]}",
            shared_memory=bool(shm),
            shm_host=f"h{rank % 2}" if shm else None,
            export_sources=shm == "export",
        )
        if rank < len(src):
            lay = src[rank]
            s = Sender.from_layout(lay, make_locals(expand(lay), True), config=cfg, budget_bytes=budget)
            s.push(1)
            s.close()
        else:
            lay = dst[rank - len(src)]
            items = expand(lay)
            tensors = make_locals(items, False)
            r = Receiver(tensors, config=cfg, rank=rank, layout=lay, budget_bytes=budget)
            stats = r.pull(1)
            r.close()
            assert stats.exec.peak_staging_bytes <= budget, (stats.exec.peak_staging_bytes, budget)
            if stats.exec.direct_bytes:
                done.append("direct")
            for meta, sl in items:
                want = global_tensor(meta)[
                    tuple(slice(o, o + n) for o, n in zip(sl.box.offsets, sl.box.sizes, strict=True))
                ]
                got = local_view(tensors[sl.local], sl, sl.box).contiguous()
                want = want.to(got.dtype).contiguous()  # a local of another dtype keeps the cast value
                assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), (
                    f"problem {i} rank {rank}: {meta.name}{sl.box} differs"
                )
        done.append(f"p{i}")
    return done


def relayouts(rank: int, address: str, shm: bool = False) -> list[tuple[bool, int]]:
    """Layouts that change between refits, on one rank or on either side: every
    rank replans (or takes the plan cached for those layouts, also on a group
    rebuilt after ``close``) and the bytes land where the new layouts say."""
    from reshard.plan.box import Box
    from reshard.plan.specs import PieceSpec, build_layout

    meta = TensorMeta("w", (64, 48), "float32")
    cfg = group_config(address, 2, 2, shared_memory=shm)

    def version(n: int) -> torch.Tensor:
        return torch.randn(64, 48, generator=torch.Generator().manual_seed(n))

    def rows(r: int, lo: int, n: int, full: torch.Tensor) -> tuple[list[PieceSpec], dict[str, torch.Tensor]]:
        return [PieceSpec(meta, Box((lo, 0), (n, 48)), "w", (n, 48))], {"w": full[lo : lo + n].clone()}

    # Refit n: (source rank 1 holds the whole tensor?, receivers split columns?)
    steps = {1: (False, False), 2: (False, False), 3: (True, False), 4: (True, False), 5: (False, False)}
    steps[6] = (False, True)
    out: list[tuple[bool, int]] = []
    if rank < 2:
        pieces, tensors = rows(rank, rank * 32, 32, version(1))
        s = Sender.from_pieces(pieces, tensors, config=cfg, rank=rank)
        for n, (whole, _) in steps.items():
            if n == 4:
                s.close()  # the next push joins a rebuilt group
            if rank == 1:
                pieces, tensors = rows(rank, 0, 64, version(n)) if whole else rows(rank, 32, 32, version(n))
                s.set_layout(build_layout(rank, pieces), tensors)
            else:
                s.session.tensors["w"].copy_(version(n)[:32])
            s.push(n)
            out.append((True, s.session.plans_made))
        s.close()
        return out
    j = rank - 2
    r = None
    for n, (_, columns) in steps.items():
        box = Box((0, j * 24), (64, 24)) if columns else Box((j * 32, 0), (32, 48))
        piece = PieceSpec(meta, box, "w", box.sizes)
        dst = torch.zeros(box.sizes)
        if r is None:
            r = Receiver({"w": dst}, [piece], config=cfg, rank=rank)
        else:
            if n == 4:
                r.close()
            r.set_layout(build_layout(rank, [piece]), {"w": dst})
        r.pull(n)
        want = version(n)[tuple(slice(o, o + k) for o, k in zip(box.offsets, box.sizes, strict=True))]
        out.append((torch.equal(dst, want), r.session.plans_made))
    assert r is not None
    r.close()
    return out
