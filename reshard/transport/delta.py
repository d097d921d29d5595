"""Delta refits: what each rank keeps between refits and how every pair of
ranks proves, before any byte moves, that a delta is safe.

A delta of refit ``n`` is built against refit ``n - 1``: the sender compares
each transfer's new values (in the destination's dtype) with what it sent
last time, its *snapshot* (:class:`Snapshots`, one entry per distinct
``(tensor, box, dtype)`` of its plan), and the receiver patches its *base*,
the values its tensors hold. That is only right if the receiver's base is
the sender's snapshot, so at the plan step every rank posts (in its
:class:`~reshard.transport.wire.Status`):

- ``delta_base``: the refit its bases (snapshots) hold, or 0 with a note
  saying why none (a new or restarted process, a refit that failed here, a
  layout that changed, an engine whose apply failed);
- per peer it exchanges transfers with over the process group, a digest of
  the values it holds for the pair's transfers, in plan order (xxh3-64 of
  each transfer's bytes, then of the list), or a note why it has none (a
  sender over its snapshot budget, slices new to this plan).

Every rank then decides every pair alike (:func:`pair_reason`): a pair moves
a delta when both ranks hold the group's last successful refit and their
digests agree; otherwise it moves dense, as without deltas, and the reason
lands in the stats. After a failed refit every rank's base is void, so the
next refit is dense everywhere. A receiver computes its digests from its
tensors at every plan step, so a base changed behind reshard's back (another
load, a restarted engine, a corrupted buffer) is caught, never patched.

Pairs that share memory or read each other's exported tensors stay dense
(a copy there costs what a comparison does), and so do forwards inside a
domain (a leader forwards what it holds, dense, over the fast fabric).
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reshard.plan.delta_format import Speeds, wire_dtype
from reshard.plan.items import RankPlan, Transfer
from reshard.plan.layout import dtype_size
from reshard.transport.delta_speed import SpeedMeter
from reshard.transport.messages import local_view, torch_dtype

if TYPE_CHECKING:
    import torch

    from reshard.transport import wire
    from reshard.transport.group import RefitGroup

__all__ = [
    "DeltaRun",
    "DeltaState",
    "Snapshots",
    "capable_pairs",
    "pair_digest",
    "pair_reason",
    "region_digest",
    "snapshot_key",
]

log = logging.getLogger(__name__)

Key = tuple[str, tuple[int, ...], tuple[int, ...], str]


def snapshot_key(t: Transfer) -> Key:
    """What a snapshot entry holds: box ``t.box`` of ``t.tensor`` in the wire dtype
    (wherever the sender stores it, so a resharded trainer keeps the entries of
    boxes it still sends)."""
    return (t.tensor, t.box.offsets, t.box.sizes, wire_dtype(t))


def region_digest(t: torch.Tensor, backend: str = "gloo") -> int:
    """A 64-bit digest of a tensor's bytes in row-major order, by the group's
    backend, so that both ranks of a pair take the same one whatever device
    each holds its copy on (a GPU trainer's snapshot, a vLLM worker's host
    staging buffers): under NCCL a Fletcher pair on the tensor's device (see
    :func:`reshard.transport.checksum.checksum`); under gloo xxh3-64 of its
    bytes on the host (CRC-32 and the length where ``xxhash`` is not
    installed: such a rank never matches one that has it, so its pairs move
    dense, never wrongly)."""
    import torch

    if backend == "nccl":
        from reshard.transport.checksum import checksum

        a, b = checksum(t.contiguous().view(-1).view(torch.uint8), "nccl").tolist()
        return _combine([a, b])
    c = t.detach().cpu() if t.device.type != "cpu" else t
    c = c if c.is_contiguous() else c.contiguous()
    data = c.view(-1).view(torch.uint8).numpy().data if c.numel() else b""
    try:
        import xxhash
    except ImportError:  # pragma: no cover - xxhash is a dependency
        return (zlib.crc32(data) << 32) | (len(data) & 0xFFFFFFFF)
    return xxhash.xxh3_64_intdigest(data)


def _combine(digests: Iterable[int]) -> int:
    data = b"".join(struct.pack("<Q", d & 0xFFFFFFFFFFFFFFFF) for d in digests)
    try:
        import xxhash
    except ImportError:  # pragma: no cover
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return xxhash.xxh3_64_intdigest(data)


def pair_digest(digests: Iterable[int]) -> int:
    """One digest for a pair of ranks: of its transfers' digests, in plan order (signed 64-bit)."""
    return _combine(digests) - (1 << 63)


def capable_pairs(group: RefitGroup, plan: RankPlan) -> dict[int, list[Transfer]]:
    """Per peer, the transfers this rank exchanges with it that may move as a
    delta (pulls over the process group, in plan order): from a source's plan
    its sends, from a destination's its receives. Both ranks of a pair find
    the same transfers (their plans agree, message for message)."""
    if group.no_wire or not group.config.delta:
        return {}
    me = group.rank
    sources = group.config.num_sources
    sending = me < sources
    out: dict[int, list[Transfer]] = {}
    for rnd in plan.rounds:
        for peer, ts in (rnd.sends if sending else rnd.recvs).items():
            if (peer < sources) == sending:
                continue  # a forward between destinations
            src, dst = (me, peer) if sending else (peer, me)
            if group.direct_link(src, dst) or group.direct_link(dst, src):
                continue
            pulls = [t for t in ts if t.kind == "pull"]
            if pulls:
                out.setdefault(peer, []).extend(pulls)
    return out


def pair_reason(statuses: Mapping[int, wire.Status], src: int, dst: int, newest: int) -> str:
    """Why pair ``src -> dst`` moves dense this refit (``""``: it moves a
    delta). The same on every rank: a function of the agreed statuses."""
    if newest <= 0:
        return "first refit"
    s, d = statuses[src], statuses[dst]
    for r, st in ((src, s), (dst, d)):
        if st.delta_base != newest:
            why = st.delta_note or f"its base is refit {st.delta_base}"
            return f"rank {r} holds no base of refit {newest} ({why})"
    sd, dd = s.delta_digests.get(dst), d.delta_digests.get(src)
    if sd is None:
        return f"rank {src}: {s.delta_notes.get(dst, 'no snapshot of these slices')}"
    if dd is None:
        return f"rank {dst}: {d.delta_notes.get(src, 'no base of these slices')}"
    if sd != dd:
        return (
            f"rank {dst}'s base of the slices it gets from rank {src} is not what rank {src} sent in refit "
            f"{newest} (checksum {dd & 0xFFFFFFFFFFFFFFFF:016x}, rank {src} has {sd & 0xFFFFFFFFFFFFFFFF:016x})"
        )
    return ""


@dataclass(slots=True)
class _Entry:
    values: torch.Tensor
    """The values last sent for the key, 1-D, in the wire dtype."""
    digest: int | None = None
    """:func:`region_digest` of ``values`` (``None``: changed since taken)."""
    changed: float | None = None
    """The share of its elements that changed at its last encoding (``None``: never encoded)."""
    uncounted: int = 0
    """Refits since its changes were last counted (a part predicted dense is not always counted)."""


class Snapshots:
    """A sender's snapshot: per ``(tensor, box, dtype)`` of its plan, the values
    it last sent (one copy of what it sends, in the engines' dtypes; shared
    by every receiver of the same box).

    ``budget_bytes`` bounds it (``None``: no bound): receivers are admitted
    in rank order while their boxes fit; the others get dense refits, and the
    sender says so once (a warning). The largest transfer's elements are also
    kept as scratch for casting or gathering new values (``scratch_bytes``).
    """

    def __init__(self, *, budget_bytes: int | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.entries: dict[Key, _Entry] = {}
        self.admitted: frozenset[int] = frozenset()
        self._scratch: torch.Tensor | None = None
        self._warned = False
        self._digesting: threading.Thread | None = None
        self.backend = "gloo"
        """The group's backend, which picks the digest (:func:`region_digest`)."""

    def digest_later(self) -> None:
        """Digest the entries a refit changed in a thread of their own (xxh3
        releases the GIL), while the trainer goes on with its next step; the
        next plan step waits for it."""
        self._join()
        todo = [e for e in self.entries.values() if e.digest is None]
        if not todo:
            return
        backend = self.backend

        def run() -> None:
            for e in todo:
                e.digest = region_digest(e.values, backend)

        self._digesting = threading.Thread(target=run, name="reshard-snapshot-digests", daemon=True)
        self._digesting.start()

    def _join(self) -> None:
        if self._digesting is not None:
            self._digesting.join()
            self._digesting = None

    @property
    def nbytes(self) -> int:
        """Bytes the snapshot holds now."""
        return sum(e.values.numel() * e.values.element_size() for e in self.entries.values())

    @property
    def scratch_bytes(self) -> int:
        return 0 if self._scratch is None else self._scratch.numel()

    def admit(self, pairs: Mapping[int, list[Transfer]], *, rank: int) -> dict[int, str]:
        """Decide which peers' boxes this snapshot keeps (in peer order, while the
        budget lasts), drop entries no admitted peer needs, and return why
        each peer left out is (``over budget``)."""
        self._join()
        admitted: list[int] = []
        notes: dict[int, str] = {}
        keys: set[Key] = set()
        total = 0
        for peer in sorted(pairs):
            new = {snapshot_key(t): t for t in pairs[peer]}
            extra = sum(t.box.numel * dtype_size(wire_dtype(t)) for k, t in new.items() if k not in keys)
            if self.budget_bytes is not None and total + extra > self.budget_bytes:
                notes[peer] = (
                    f"its snapshot budget ({self.budget_bytes} bytes) is spent before the "
                    f"{extra} bytes of slices it sends rank {peer}"
                )
                continue
            total += extra
            keys.update(new)
            admitted.append(peer)
        for key in [k for k in self.entries if k not in keys]:
            del self.entries[key]
        self.admitted = frozenset(admitted)
        if notes and not self._warned:
            self._warned = True
            log.warning(
                "reshard rank %d: delta refits need %d bytes of snapshot beyond the budget of %d; the slices for "
                "rank(s) %s move dense (GroupConfig.delta_budget_bytes)",
                rank,
                sum(t.box.numel * dtype_size(wire_dtype(t)) for p in notes for t in pairs[p]),
                self.budget_bytes,
                sorted(notes),
            )
        return notes

    def digests(self, pairs: Mapping[int, list[Transfer]]) -> tuple[dict[int, int], dict[int, str]]:
        """Per admitted peer, the digest of the values this snapshot holds for
        its transfers (or why it has none: slices it never sent)."""
        self._join()
        digests: dict[int, int] = {}
        notes: dict[int, str] = {}
        for peer in sorted(self.admitted & set(pairs)):
            parts = []
            for t in pairs[peer]:
                e = self.entries.get(snapshot_key(t))
                if e is None:
                    notes[peer] = f"no snapshot of {t.tensor!r}{t.box} (slices it has not sent before)"
                    break
                if e.digest is None:
                    e.digest = region_digest(e.values, self.backend)
                parts.append(e.digest)
            else:
                digests[peer] = pair_digest(parts)
        return digests, notes

    def entry(self, t: Transfer, device: torch.device) -> torch.Tensor:
        """The entry of ``t``'s box (created, uninitialized, when missing); marked changed."""
        import torch

        self._join()
        key = snapshot_key(t)
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = _Entry(torch.empty(t.box.numel, dtype=torch_dtype(key[3]), device=device))
        e.digest = None
        return e.values

    def last_changed(self, t: Transfer) -> float | None:
        """The share of ``t``'s elements that changed when its box was last encoded."""
        e = self.entries.get(snapshot_key(t))
        return None if e is None else e.changed

    def recount(self, t: Transfer, every: int = 4) -> bool:
        """Whether this refit counts the changes of ``t``'s part, predicted
        dense: every ``every``-th refit (else the snapshot is only copied)."""
        e = self.entries.get(snapshot_key(t))
        if e is None:
            return True
        e.uncounted += 1
        if e.uncounted >= every:
            e.uncounted = 0
            return True
        return False

    def encoded(self, t: Transfer, k: int) -> None:
        """``k`` of ``t``'s elements changed in this encoding (what the next refit predicts from)."""
        e = self.entries.get(snapshot_key(t))
        if e is not None and t.box.numel:
            e.changed = k / t.box.numel
            e.uncounted = 0

    def new_values(self, t: Transfer, src: torch.Tensor) -> torch.Tensor:
        """``t``'s new values: its region of source tensor ``src`` in the wire
        dtype, contiguous and 1-D (a view when it already is one), or on the
        host a 2-D view of its rows when they are contiguous runs of the
        source (the encoder reads them in place), else a copy in the scratch
        buffer, valid until the next call."""
        import torch

        view = local_view(src, t.src, t.box)
        wdt = torch_dtype(wire_dtype(t))
        if view.dtype == wdt and view.is_contiguous():
            return view.reshape(-1)
        if view.dtype == wdt and view.device.type == "cpu" and view.dim() >= 2 and view.stride(-1) == 1:
            try:  # rows of the source (a column slice): read in place where the encoder can
                return view.view(-1, view.shape[-1])
            except RuntimeError:
                pass
        need = t.box.numel * dtype_size(wire_dtype(t))
        if self._scratch is None or self._scratch.numel() < need or self._scratch.device != view.device:
            self._scratch = torch.empty(need, dtype=torch.uint8, device=view.device)
        out = self._scratch[:need].view(wdt)
        out.view(view.shape).copy_(view)
        return out

    def clear(self) -> None:
        self._join()
        self.entries.clear()
        self._scratch = None


@dataclass(slots=True)
class DeltaState:
    """One rank's delta bookkeeping across refits (held by its session)."""

    base: int = 0
    """The refit whose values this rank's snapshot (sender) or base (receiver) holds; 0: none."""
    note: str = "no refit has completed on it yet"
    """Why ``base`` is 0."""
    snapshots: Snapshots | None = None
    """A sender's snapshot."""
    speeds: SpeedMeter = field(default_factory=SpeedMeter)
    """A sender's measured speeds, which decide when a part goes dense (:mod:`reshard.transport.delta_speed`)."""
    budget_bytes: int | None = None
    private: bool = False
    """A receiver whose base only reshard writes (a vLLM worker's buffers):
    its digests are taken once a refit succeeded, in a thread, instead of at
    the next plan step (a base changed behind reshard's back would then go
    unnoticed, so it is only for private buffers)."""
    _later: tuple[Any, dict, threading.Thread] | None = None

    def void(self, why: str) -> None:
        """The base no longer holds a known refit (the next refit is dense)."""
        self.base = 0
        self.note = why
        self._later = None

    def digest_later(self, group: RefitGroup, plan: RankPlan, destinations: Mapping[str, torch.Tensor]) -> None:
        """A private receiver: digest its base now, in a thread, for the next
        plan step (if it plans the same transfers into the same tensors)."""
        pairs = capable_pairs(group, plan)
        result: dict = {}
        backend = group.backend
        # The tensors themselves (not their ids, which a later object may
        # reuse; nor the mapping, which an engine may build anew per refit
        # around the same buffers): the digests vouch for exactly these.
        tensors = dict(destinations.items())

        def run() -> None:
            result["digests"] = base_digests(pairs, tensors, backend)

        thread = threading.Thread(target=run, name="reshard-base-digests", daemon=True)
        thread.start()
        self._later = ((plan, tensors, backend), result, thread)

    def status(
        self, group: RefitGroup, plan: RankPlan, destinations: Mapping[str, torch.Tensor] | None
    ) -> tuple[int, str, dict[int, int], dict[int, str]]:
        """``(delta_base, delta_note, delta_digests, delta_notes)`` of this
        rank's plan status (see the module docstring)."""
        pairs = capable_pairs(group, plan)
        if not pairs:
            if self.snapshots is not None:
                self.snapshots.admit({}, rank=group.rank)  # no peer needs the snapshot any more
            return self.base, self.note, {}, {}
        if group.rank < group.config.num_sources:
            if self.snapshots is None:
                self.snapshots = Snapshots(budget_bytes=self.budget_bytes)
            self.snapshots.backend = group.backend
            notes = self.snapshots.admit(pairs, rank=group.rank)
            digests, more = self.snapshots.digests(pairs)
            notes.update(more)
            return self.base, self.note, digests, notes
        if destinations is None:
            why = "its tensors materialize during the refit (no base to patch)"
            return self.base, self.note, {}, dict.fromkeys(pairs, why)
        later, self._later = self._later, None
        if later is not None:
            (later_plan, later_dests, later_backend), result, thread = later
            thread.join()
            same = (
                later_plan is plan
                and later_backend == group.backend
                and later_dests.keys() == destinations.keys()
                and all(t is destinations[n] for n, t in later_dests.items())
            )
            if same and "digests" in result:
                return self.base, self.note, *result["digests"]
        return self.base, self.note, *base_digests(pairs, destinations, group.backend)


def base_digests(
    pairs: Mapping[int, list[Transfer]], destinations: Mapping[str, torch.Tensor], backend: str = "gloo"
) -> tuple[dict[int, int], dict[int, str]]:
    """A receiver's digests of its base, per source peer: what its tensors hold
    now for the pair's transfers (read at every plan step)."""
    digests: dict[int, int] = {}
    notes: dict[int, str] = {}
    for peer, ts in sorted(pairs.items()):
        parts = []
        for t in ts:
            tensor = destinations.get(t.dst.local)
            if tensor is None:
                notes[peer] = f"no local tensor {t.dst.local!r}"
                break
            parts.append(region_digest(local_view(tensor, t.dst, t.box), backend))
        else:
            digests[peer] = pair_digest(parts)
    return digests, notes


@dataclass(slots=True)
class DeltaRun:
    """One refit's delta decisions for one rank's executor."""

    peers: frozenset[int]
    """Peers this rank exchanges deltas with (one payload per round after a header)."""
    dense: dict[int, str] = field(default_factory=dict)
    """Peers it could have, that move dense this refit, with why."""
    snapshots: Snapshots | None = None
    """A sender's snapshot (updated as it sends, dense peers' boxes included)."""
    speeds: Speeds | None = None
    """A sender's speeds for this refit's choices (``None``: the smallest encoding)."""
    touched: set[str] = field(default_factory=set)
    """A receiver's local tensors whose values changed in this refit (filled by the executor)."""
