"""Wire types: what ranks tell each other through the store (msgspec, versioned).

Nothing that crosses a process boundary is pickled. Every message carries a
``version`` field; new fields are appended with defaults. Decoding checks
the size first, then validates types, so malformed metadata is a clear
:class:`~reshard.errors.MetadataError` naming the field, not a crash deep
in the planner; :func:`check_layout` then checks what types cannot (ranges,
index bounds, ranks) before a layout reaches the planner.
"""

from __future__ import annotations

import math

import msgspec

from reshard.errors import MetadataError, Problem
from reshard.plan.layout import DTYPE_SIZES, LAYOUT_VERSION, Grid, Layout, LocalTensor, Piece, TensorMeta

__all__ = [
    "MAX_MESSAGE_BYTES",
    "WIRE_VERSION",
    "CudaIpc",
    "Export",
    "Exports",
    "Hello",
    "IpcRef",
    "RankLayout",
    "Status",
    "Table",
    "check_layout",
    "decode",
    "encode",
]

WIRE_VERSION = 1

MAX_MESSAGE_BYTES = 64 << 20
"""Default bound on one metadata message (``GroupConfig.max_metadata_bytes``):
larger ones are refused before decoding. The tensor table of a 1T-parameter
MoE (~100k tensors) is ~7 MB; a rank's layout with grids tens of KB."""

MAX_NDIM = 16
"""Most dims a tensor (or a mesh) of a layout may have."""
MAX_NUMEL = 1 << 48
"""Most elements a tensor of a layout may have (a bound that keeps sizes
meaningful; 2**48 elements is 512 TiB of bf16)."""
MAX_MESH_SIZE = 1 << 20


class Hello(msgspec.Struct, frozen=True, kw_only=True, tag="hello"):
    """Who a rank is. Published once when it joins."""

    rank: int
    role: str
    """``source`` (trainer) or ``destination`` (engine worker)."""
    domain: str
    """Ranks with equal labels share a fast fabric (an NVLink domain)."""
    host: str
    pid: int
    device: str = "cpu"
    version: int = WIRE_VERSION
    checksums: bool = False
    """Whether this rank runs refits with per-message checksums (all must agree)."""
    num_sources: int = 0
    """The group's role split as this rank was configured (all must agree; 0: not said)."""
    num_destinations: int = 0
    budget_bytes: int = 0
    """This rank's staging budget: an input of the plan every rank knows."""
    round_bytes: int = 0
    """Round size this rank asks for; the group plans with the smallest asked."""
    big_bytes: int = 0
    """Message size from which transfers travel alone; the group uses the smallest asked."""
    shm_host: str = ""
    """The host (and ``/dev/shm`` mount) this rank shares memory on; empty:
    no shared-memory links (``GroupConfig.shared_memory``)."""
    gpu: str = ""
    """The UUID of this rank's GPU (CUDA tensors; empty otherwise)."""
    gpus: tuple[str, ...] = ()
    """The UUIDs of the GPUs this process sees, in its own device order
    (what it can map by CUDA IPC)."""
    ipc_host: str = ""
    """The host this rank maps other processes' GPU memory on (CUDA
    tensors with ``GroupConfig.shared_memory``); empty: no CUDA IPC links."""
    delta: bool = False
    """Whether this rank runs delta refits (``GroupConfig.delta``; all must agree)."""
    process: str = ""
    """A random token of this rank's process: ranks with equal tokens run in
    one process (TRL's colocate mode: a trainer rank and its vLLM worker),
    where CUDA refuses to open an IPC handle the process exported itself."""
    backend: str = ""
    """The process group this rank builds (``gloo`` or ``nccl``; all must
    agree: a gloo rank and an NCCL rank would each wait for the other's
    process group forever). Empty: not said."""


class RankLayout(msgspec.Struct, frozen=True, kw_only=True, tag="layout"):
    """A rank's layout with its tensor table stored separately (by digest),
    so ranks that share a table store it once."""

    rank: int
    table: str
    locals: tuple[LocalTensor, ...] = ()
    pieces: tuple[Piece, ...] = ()
    grids: tuple[Grid, ...] = ()
    version: int = WIRE_VERSION


class Table(msgspec.Struct, frozen=True, kw_only=True, tag="table"):
    tensors: tuple[TensorMeta, ...]
    version: int = WIRE_VERSION


class IpcRef(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """The reference counter a sender keeps for one receiver of a CUDA
    storage (torch's: the block stays allocated while a receiver maps it)."""

    reader: int
    """The destination rank this counter is for."""
    counter: bytes
    """The counter file's name."""
    counter_offset: int


class CudaIpc(msgspec.Struct, frozen=True, kw_only=True):
    """Where a CUDA storage lives, as another process on the host opens it:
    the GPU, the allocation's IPC handle and the storage's place in it."""

    gpu: str
    """UUID of the GPU that holds the storage."""
    handle: bytes
    """The IPC handle of the allocation the storage lies in."""
    storage_offset: int
    """Bytes from the allocation's start to the storage's."""
    event: bytes = b""
    event_sync: bool = False
    refs: tuple[IpcRef, ...] = ()
    """One counter per receiver that may map the storage."""
    local: int = 0
    """The storage's key in its exporting process, where receivers in that
    same process find it (:func:`reshard.transport.ipc.local_storage`); 0:
    none of them reads it. ``handle`` is empty when only they do."""


class Export(msgspec.Struct, frozen=True, kw_only=True):
    """A source tensor whose storage a colocated receiver maps and reads
    directly. In shared memory (``GroupConfig.export_sources``): the sender's
    file descriptor of the storage (opened through ``/proc/<pid>/fd``), its
    inode (so a reused descriptor number is never mistaken for the old
    storage) and size, and the tensor's view of it. On a GPU (``cuda`` set;
    ``fd`` is -1): the storage's CUDA IPC handle instead of a descriptor."""

    local: str
    fd: int
    inode: int
    storage_bytes: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    """Storage offset, in elements."""
    cuda: CudaIpc | None = None
    """A CUDA storage: how to open it (``fd`` and ``inode`` are unused)."""


class Exports(msgspec.Struct, frozen=True, kw_only=True, tag="exports"):
    """A source rank's exported tensors, published once per change under
    ``exports/<rank>/<digest>`` (the digest travels in its plan status)."""

    rank: int
    exports: tuple[Export, ...] = ()
    version: int = WIRE_VERSION


class Status(msgspec.Struct, frozen=True, kw_only=True, tag="status"):
    """One rank's outcome of one step of one refit."""

    rank: int
    step: str
    refit: int
    ok: bool
    error: str = ""
    problems: tuple[Problem, ...] = ()
    staging_need: int = 0
    """Bytes of staging this rank's plan needs in its busiest round."""
    version: int = WIRE_VERSION
    last_refit: int = 0
    """Step ``enter``: the last refit that succeeded on this rank."""
    sends: dict[int, tuple[int, int, int]] = {}
    """Step ``plan``: per peer, the messages this rank's plan sends it
    (count, bytes, digest of every message's round, index and size)."""
    recvs: dict[int, tuple[int, int, int]] = {}
    """Step ``plan``: per peer, the messages this rank's plan expects from it."""
    layout: str = ""
    """Step ``enter``: the digest of the layout this rank refits with
    (:func:`~reshard.plan.layout.layout_digest`); one that differs from the
    layout the others last read makes every rank read the layouts again."""
    exports: str = ""
    """Step ``plan``, a source rank with ``GroupConfig.export_sources``: the
    digest of its source tensors in shared memory (:class:`Exports`), which
    colocated receivers read directly; empty: none."""
    delta_base: int = 0
    """Step ``plan`` (``GroupConfig.delta``): the refit whose values this rank's
    snapshot (a source) or tensors (a destination) hold; 0: none, see
    ``delta_note`` (:mod:`reshard.transport.delta`)."""
    delta_note: str = ""
    """Why ``delta_base`` is 0 (a new process, a failed refit, a changed layout)."""
    delta_digests: dict[int, int] = {}
    """Step ``plan``: per peer this rank may exchange deltas with, a digest of
    the values it holds for the pair's transfers (a source: what it sent
    last; a destination: what its tensors hold now)."""
    delta_notes: dict[int, str] = {}
    """Step ``plan``: per such peer without a digest, why (a sender's snapshot
    over budget, slices new to this plan)."""


class Roster(msgspec.Struct, frozen=True, kw_only=True, tag="roster"):
    """Who takes part (``GroupConfig.min_replicas``): the ranks of a group's
    epoch (``refit`` 0, key ``members``) or of one refit (key
    ``roster/<seq>``), decided by refit rank 0 (:mod:`reshard.transport.members`)."""

    refit: int = 0
    present: tuple[int, ...] = ()
    """The refit ranks that take part, sorted."""
    missing: dict[int, str] = {}
    """Engine replicas that do not take part (replica index -> why)."""
    error: str = ""
    """Why there is no refit (too few replicas); every rank raises it."""
    version: int = WIRE_VERSION


Message = Hello | RankLayout | Table | Status | Exports | Roster

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, expect: type | None = None, *, limit: int = MAX_MESSAGE_BYTES) -> Message:
    """Decode one message; ``expect`` checks its type. Raises
    :class:`MetadataError` (never anything else) for data that is too large,
    malformed, of the wrong type or of a newer wire version."""
    if len(data) > limit:
        raise MetadataError(f"refit metadata of {len(data)} bytes exceeds the {limit}-byte limit")
    try:
        msg = _decoder.decode(data)
    except msgspec.MsgspecError as e:
        raise MetadataError(f"malformed refit metadata ({len(data)} bytes): {e}") from None
    if expect is not None and not isinstance(msg, expect):
        raise MetadataError(f"expected a {expect.__name__} message, got {type(msg).__name__}")
    if msg.version > WIRE_VERSION or msg.version < 1:
        raise MetadataError(
            f"{type(msg).__name__} has wire version {msg.version}; this reshard reads versions 1 to {WIRE_VERSION}"
        )
    return msg


def check_layout(layout: Layout, *, ranks: range) -> None:
    """Check what decoding cannot: sizes, index bounds and ranks of a layout
    published by a rank of ``ranks`` (its side: sources or destinations).

    Raises :class:`MetadataError` naming the rank and the first bad field, so
    that a malformed layout never reaches the planner.
    """
    r = layout.rank

    def bad(what: str) -> MetadataError:
        return MetadataError(f"layout of rank {r}: {what}")

    if r not in ranks:
        raise bad(f"rank {r} is outside its side's ranks {ranks.start}..{ranks.stop - 1}")
    if not 1 <= layout.version <= LAYOUT_VERSION:
        raise bad(f"layout version {layout.version}; this reshard reads versions 1 to {LAYOUT_VERSION}")
    names: set[str] = set()
    for i, t in enumerate(layout.tensors):
        if not t.name:
            raise bad(f"tensor {i} has an empty name")
        if t.name in names:
            raise bad(f"tensor {t.name!r} appears twice in its table")
        names.add(t.name)
        if t.dtype not in DTYPE_SIZES:
            raise bad(f"tensor {t.name!r} has unknown dtype {t.dtype!r}")
        _check_shape(t.shape, f"tensor {t.name!r}", bad)
    for i, loc in enumerate(layout.locals):
        _check_local(loc, f"local tensor {i}", "", bad)
    nt, nl = len(layout.tensors), len(layout.locals)
    for i, p in enumerate(layout.pieces):
        if not 0 <= p.tensor < nt or not 0 <= p.local < nl:
            raise bad(f"piece {i} refers to tensor {p.tensor} / local {p.local} outside its tables ({nt}, {nl})")
        meta, loc = layout.tensors[p.tensor], layout.locals[p.local]
        what = f"piece {i} of {meta.name!r}"
        nd = len(meta.shape)
        if len(p.box.offsets) != nd or len(p.box.sizes) != nd:
            raise bad(f"{what}: box {p.box.offsets}/{p.box.sizes} has not the tensor's {nd} dims")
        if any(o < 0 for o in p.box.offsets) or any(s < 0 for s in p.box.sizes):
            raise bad(f"{what}: box {p.box.offsets}/{p.box.sizes} has negative entries")
        _check_storage(p.offset, p.dims, nd, len(loc.shape), what, bad)
    for i, g in enumerate(layout.grids):
        _check_grid(g, layout.tensors, ranks, f"grid {i}", bad)


def _check_shape(shape: tuple[int, ...], what: str, bad) -> None:
    if len(shape) > MAX_NDIM:
        raise bad(f"{what} has {len(shape)} dims (at most {MAX_NDIM})")
    if any(n < 0 for n in shape):
        raise bad(f"{what} has a negative size in shape {list(shape)}")
    if math.prod(shape) > MAX_NUMEL:
        raise bad(f"{what} of shape {list(shape)} has more than 2**48 elements")


def _check_local(loc: LocalTensor, unnamed: str, where: str, bad) -> None:
    """``unnamed``: what to call a local without a name; ``where``: a prefix
    naming the grid it belongs to (empty for the layout's own locals)."""
    if not loc.name:
        raise bad(f"{where}{unnamed} has an empty name")
    if loc.dtype and loc.dtype not in DTYPE_SIZES:
        raise bad(f"{where}local tensor {loc.name!r} has unknown dtype {loc.dtype!r}")
    _check_shape(loc.shape, f"{where}local tensor {loc.name!r}", bad)


def _check_storage(offset: tuple[int, ...], dims: tuple[int, ...], nd: int, local_nd: int, what: str, bad) -> None:
    if offset and len(offset) != local_nd:
        raise bad(f"{what}: offset {offset} has not the local tensor's {local_nd} dims")
    if any(o < 0 for o in offset):
        raise bad(f"{what}: offset {offset} has negative entries")
    if dims and (len(dims) != nd or len(set(dims)) != nd or any(not 0 <= d < local_nd for d in dims)):
        raise bad(f"{what}: dims {dims} do not map {nd} global dims into {local_nd} local dims")
    if not dims and local_nd < nd:
        raise bad(f"{what}: a {nd}-dim box does not fit a {local_nd}-dim local tensor")


def _check_grid(g: Grid, tensors: tuple[TensorMeta, ...], ranks: range, what: str, bad) -> None:
    start, stop, step = g.tensors
    if step < 1 or not 0 <= start <= stop <= len(tensors):
        raise bad(f"{what} refers to tensors {g.tensors} of a table of {len(tensors)}")
    mesh = g.mesh
    nm = len(mesh.shape)
    if not 1 <= nm <= MAX_NDIM or any(n < 1 for n in mesh.shape):
        raise bad(f"{what}: mesh shape {list(mesh.shape)} is not 1 to {MAX_NDIM} positive sizes")
    size = math.prod(mesh.shape)
    if size > MAX_MESH_SIZE:
        raise bad(f"{what}: a mesh of {size} ranks")
    if mesh.ranks:
        if len(mesh.ranks) != size:
            raise bad(f"{what}: mesh of shape {list(mesh.shape)} lists {len(mesh.ranks)} ranks")
        lo, hi = min(mesh.ranks), max(mesh.ranks)
    else:
        strides = mesh.strides
        if strides and len(strides) != nm:
            raise bad(f"{what}: mesh strides {strides} for a mesh of shape {list(mesh.shape)}")
        if not strides:
            lo, hi = mesh.start, mesh.start + size - 1
        else:
            lo = mesh.start + sum(min(0, s * (n - 1)) for s, n in zip(strides, mesh.shape, strict=True))
            hi = mesh.start + sum(max(0, s * (n - 1)) for s, n in zip(strides, mesh.shape, strict=True))
    if lo < ranks.start or hi >= ranks.stop:
        raise bad(f"{what}: mesh ranks span {lo}..{hi}, outside its side's ranks {ranks.start}..{ranks.stop - 1}")
    axes = [a for dim_axes in g.shard for a in dim_axes]
    if any(not 0 <= a < nm for a in axes) or len(set(axes)) != len(axes):
        raise bad(f"{what}: shard spec {g.shard} on a mesh of {nm} axes")
    if g.block and (len(g.block) != len(g.shard) or any(b < 0 for b in g.block)):
        raise bad(f"{what}: block {g.block} for shard spec {g.shard}")
    nd = len(g.shard)
    for ti in range(start, stop, step):
        meta = tensors[ti]
        if len(meta.shape) != nd:
            raise bad(f"{what}: shard spec {g.shard} for {meta.name!r} of shape {list(meta.shape)}")
    if g.local is not None:
        _check_local(g.local, "local tensor", f"{what}: ", bad)
        local_nd = len(g.local.shape)
        _check_storage(g.offset, g.dims, nd, local_nd, what, bad)
        if g.step and len(g.step) != local_nd:
            raise bad(f"{what}: step {g.step} has not the local tensor's {local_nd} dims")
