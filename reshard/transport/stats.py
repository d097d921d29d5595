"""What one rank moved in one refit (:class:`ExecStats`), its account of the
whole refit (:class:`RefitStats`), and an engine worker's account as its
driver hands it to the trainer (:class:`EngineStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from reshard.plan.items import Transfer

__all__ = ["PHASES", "EngineStats", "ExecStats", "RefitStats", "count_cast"]

PHASES = {
    "wait": "blocked until a round's messages arrived or left (the wire, as this rank sees it)",
    "headers": "delta headers exchanged (blocked)",
    "pack": "non-contiguous slices copied into staging before they are sent",
    "unpack": "staged messages copied (and cast) into the destination tensors",
    "encode": "delta parts encoded against the snapshot (the gather included)",
    "gather": "new values cast or gathered into one run of the wire dtype before they are encoded",
    "patch": "delta parts applied onto the base",
    "snapshot": "a delta sender's snapshot of what it sent dense brought up to date (created, the first time)",
    "direct": "slices copied straight out of a colocated sender's memory",
    "copy": "local copies (source and destination on this rank)",
    "after_round": "the local tensors' own work between rounds (landed: an engine applying the layers whose "
    "bytes landed)",
    "after_transfer": "the local tensors' own work after the last round, before the outcome is agreed (finish: "
    "an apply draining)",
}
"""The phases of :attr:`ExecStats.phase_seconds`: where a rank's transfer time went."""


@dataclass(slots=True)
class ExecStats:
    """What one rank moved in one refit (payload bytes, without padding)."""

    rank: int
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_landed: int = 0
    """Of what this rank received (or copied locally), the bytes written into
    its local tensors, in their dtypes: ``bytes_received`` counts them in
    the dtypes they travel (the sender's), so the two differ by what was
    cast on arrival (``casts``)."""
    bytes_copied: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    rounds: int = 0
    peak_staging_bytes: int = 0
    seconds: float = 0.0
    recv_by_peer: dict[int, int] = field(default_factory=dict)
    send_by_peer: dict[int, int] = field(default_factory=dict)
    checksum_seconds: float = 0.0
    """Time spent taking and checking checksums (``checksums=True``)."""
    casts: dict[str, int] = field(default_factory=dict)
    """Bytes received (or copied) in one dtype and cast into a local tensor of
    another, by ``"src->dst"`` dtype pair (empty when every dtype matched)."""
    recv_by_link: dict[str, int] = field(default_factory=dict)
    """Bytes received per link: ``shm`` (shared memory), ``gloo`` or ``nccl``."""
    send_by_link: dict[str, int] = field(default_factory=dict)
    direct_bytes: int = 0
    """Of the ``shm`` bytes: those read straight from a colocated sender's
    exported tensors (received) or read so by a receiver (sent)."""
    dense_bytes: int = 0
    """What a dense refit moves over this rank's links, sent plus received
    (in the dtypes a dense refit moves them: the senders')."""
    wire_bytes: int = 0
    """What this refit moved over them, sent plus received: ``dense_bytes``
    without deltas; with deltas, their encoded payloads and headers instead
    of the dense bytes of the pairs that moved deltas."""
    delta_peers: list[int] = field(default_factory=list)
    """Peers this rank exchanged deltas with (``GroupConfig.delta``)."""
    dense_peers: dict[int, str] = field(default_factory=dict)
    """Peers it could have exchanged deltas with that moved dense this refit, with why."""
    delta_elements: int = 0
    """Elements of the transfers that moved as deltas (each box counted per peer
    on a receiver, once on a sender)."""
    delta_changed: int = 0
    """Of those, the elements whose bits changed since the last refit."""
    encodings: dict[str, int] = field(default_factory=dict)
    """Delta parts (one per transfer) by encoding: ``same``, ``dense``, ``sparse``, ``bitmask``."""
    delta_seconds: float = 0.0
    """Time spent encoding (sender) or applying (receiver) deltas."""
    phase_seconds: dict[str, float] = field(default_factory=dict)
    """Where this rank's transfer time went, by phase (see :data:`PHASES`)."""
    landed_seconds: float = 0.0
    """From the start of the transfer until the last byte this rank receives
    had landed in its tensors (before the work ``after_round`` does on the
    last round); on a sender, until its last send completed."""

    def received(
        self, peer: int, link: str, *, payload: int, dense: int, wire: int, landed: int, messages: int = 1
    ) -> None:
        """Count what arrived from ``peer`` over ``link``: ``payload`` bytes
        in ``messages`` messages (none when the payload is empty), standing
        for ``dense`` bytes of a dense refit, ``wire`` bytes on the wire
        (delta headers included), ``landed`` bytes written into local tensors."""
        self.messages_received += messages if payload else 0
        self.bytes_received += payload
        self.recv_by_peer[peer] = self.recv_by_peer.get(peer, 0) + payload
        self.recv_by_link[link] = self.recv_by_link.get(link, 0) + payload
        self.dense_bytes += dense
        self.wire_bytes += wire
        self.bytes_landed += landed

    def sent(self, peer: int, link: str, *, payload: int, dense: int, wire: int, messages: int = 1) -> None:
        """Count what left for ``peer`` over ``link`` (see :meth:`received`)."""
        self.messages_sent += messages if payload else 0
        self.bytes_sent += payload
        self.send_by_peer[peer] = self.send_by_peer.get(peer, 0) + payload
        self.send_by_link[link] = self.send_by_link.get(link, 0) + payload
        self.dense_bytes += dense
        self.wire_bytes += wire

    def timed(self, phase: str, seconds: float) -> None:
        """Count ``seconds`` spent in ``phase`` (one of :data:`PHASES`)."""
        self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def count_cast(stats: ExecStats, t: Transfer) -> None:
    """Count ``t``'s bytes as cast from its wire dtype into its destination's."""
    key = f"{t.dtype}->{t.dst.dtype}"
    stats.casts[key] = stats.casts.get(key, 0) + t.nbytes


@dataclass(slots=True)
class RefitStats:
    """One rank's account of one refit."""

    refit: int
    rank: int
    exec: ExecStats
    plan_seconds: float
    agree_seconds: float
    total_seconds: float
    round_bytes: int
    cpu_seconds: float = 0.0
    """CPU time this process used during the refit (every thread, user and
    system): on a host with few cores, the sum over its processes bounds
    how fast a refit can be."""
    started_at: float = 0.0
    """Wall clock (``time.time()``) when this rank entered the refit."""
    finished_at: float = 0.0
    touched: frozenset[str] | None = None
    """With ``GroupConfig.delta``, on a destination: the local tensors whose
    values changed in this refit (``None``: not tracked, any may have)."""
    replicas: tuple[int, ...] = ()
    """The engine replicas this refit reached (indices, see
    ``GroupConfig.replica_size``); with ``min_replicas``, those present."""
    missing_replicas: dict[int, str] = field(default_factory=dict)
    """The engine replicas this refit did not reach, and why (``GroupConfig.min_replicas``)."""
    missed_after: int | None = None
    """On a rank that missed refits (left out, or joined late): the refit it
    served before this one brought it the full current version."""

    def summary(self) -> str:
        """One line: what this rank moved, how fast, where the time went."""
        ex = self.exec
        moved = max(ex.bytes_sent, ex.bytes_received)
        return (
            f"refit {self.refit} rank {self.rank}: sent {ex.bytes_sent / 1e6:.1f} MB, received "
            f"{ex.bytes_received / 1e6:.1f} MB in {self.total_seconds:.3f} s "
            f"({moved / max(self.total_seconds, 1e-9) / 1e9:.2f} GB/s; plan {self.plan_seconds:.3f} s, "
            f"agree {self.agree_seconds:.3f} s, transfer {ex.seconds:.3f} s, {ex.rounds} rounds)"
        )

    def as_dict(self) -> dict:
        d = self.exec.as_dict()
        d.update(
            refit=self.refit,
            plan_seconds=self.plan_seconds,
            agree_seconds=self.agree_seconds,
            total_seconds=self.total_seconds,
            cpu_seconds=self.cpu_seconds,
            round_bytes=self.round_bytes,
            started_at=self.started_at,
            finished_at=self.finished_at,
            replicas=list(self.replicas),
            missing_replicas=dict(self.missing_replicas),
            missed_after=self.missed_after,
        )
        return d


class EngineStats(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One engine worker's account of one refit, typed (``Sender.engine_stats``).

    The worker builds it in one place (:meth:`of_refit`, from its
    :class:`RefitStats` and what its engine did) and its reply carries it
    as plain data; the trainer decodes it strictly (:meth:`of`): a field
    this type does not know is refused, never dropped. A field an engine
    does not report keeps its default."""

    rank: int = -1
    """The worker's refit rank."""
    refit: int = 0
    # -- what moved (ExecStats) -------------------------------------------------
    bytes_received: int = 0
    """Bytes that reached the worker, in the dtypes they travel (the trainer's)."""
    bytes_landed: int = 0
    """Of those, the bytes written into the worker's tensors, in the worker's
    dtypes: ``kept_bytes`` after a refit, whatever was cast on arrival."""
    bytes_sent: int = 0
    bytes_copied: int = 0
    """Bytes the worker copied from itself (a slice it both holds and keeps)."""
    messages_sent: int = 0
    messages_received: int = 0
    rounds: int = 0
    peak_staging_bytes: int = 0
    recv_by_peer: dict[int, int] = {}
    send_by_peer: dict[int, int] = {}
    recv_by_link: dict[str, int] = {}
    send_by_link: dict[str, int] = {}
    direct_bytes: int = 0
    checksum_seconds: float = 0.0
    casts: dict[str, int] = {}
    """Bytes received in one dtype and cast into another on arrival, by
    ``"src->dst"`` dtype pair (counted in the dtype they travel)."""
    dense_bytes: int = 0
    """What a dense refit moves over the worker's links (sent plus received)."""
    wire_bytes: int = 0
    """What this refit moved over them: ``dense_bytes`` without deltas."""
    delta_peers: list[int] = []
    """Trainer ranks that sent this worker deltas."""
    dense_peers: dict[int, str] = {}
    """Trainer ranks that could have, that sent dense this refit, with why."""
    delta_elements: int = 0
    """Elements the deltas covered; ``delta_changed`` of them changed."""
    delta_changed: int = 0
    encodings: dict[str, int] = {}
    """Delta parts by encoding (``same``, ``dense``, ``sparse``, ``bitmask``)."""
    delta_seconds: float = 0.0
    phase_seconds: dict[str, float] = {}
    """Where the worker's transfer time went (:data:`PHASES`)."""
    landed_seconds: float = 0.0
    # -- the refit session (RefitStats) ---------------------------------------------
    plan_seconds: float = 0.0
    agree_seconds: float = 0.0
    transfer_seconds: float = msgspec.field(default=0.0, name="seconds")
    total_seconds: float = 0.0
    """The worker's refit session, from entering the refit to its end."""
    cpu_seconds: float = 0.0
    round_bytes: int = 0
    started_at: float = 0.0
    finished_at: float = 0.0
    # -- the engine -----------------------------------------------------------------
    kept_bytes: int = 0
    """Bytes of checkpoint tensors this worker keeps, in its own dtypes: what
    a refit must land (``bytes_landed``). ``bytes_received`` equals it when
    the trainer holds the same dtypes; a trainer in float32 into a bfloat16
    engine sends twice that (see ``casts``)."""
    apply_seconds: float = 0.0
    """The engine's own apply (layerwise processing, repacking) of the new weights."""
    refit_seconds: float = 0.0
    """The whole refit on the worker: receive and apply."""
    atomic: bool = False
    """A failure would have put the old weights back."""
    delta: bool = False
    """The worker runs delta refits (``GroupConfig.delta``)."""
    two_phase: bool = False
    """Received into staging buffers while the engine served, then applied."""
    stage_seconds: float = 0.0
    staging_bytes: int = 0
    layers_processed: int = 0
    """vLLM: layers that went through its reload lifecycle (processed)."""
    layers_direct: int = 0
    """vLLM: of those, layers whose bytes landed in their live tensors."""
    layers_skipped: int = 0
    """Delta refits into vLLM: layers left as they were (none of their weights changed)."""
    buffers_kept_by_engine: int = 0
    """vLLM on a CPU: staging buffers the engine kept after processing (the pool took fresh ones)."""
    lifecycle_seconds: dict[str, float] = {}
    """vLLM: where the apply's time went, by step (``reshard.adapters.vllm.update.STEPS``)."""
    loader_tensors: int = 0
    """Tensors that went through the engine's own loader (not plain copies)."""
    drafter: str = ""
    """vLLM with speculative decoding: ``refit`` (the drafter took this refit
    beside the target), ``frozen`` (left alone, as told); ``""``: no drafter."""
    drafter_kept_bytes: int = 0
    """Of ``kept_bytes``, the drafter's own (what it does not share with the target)."""
    post_load_seconds: float = 0.0
    """SGLang: its loaders and post-load hooks after the transfer."""
    learn_seconds: float = 0.0
    """SGLang: learning the worker's layout from its loaders (once per worker)."""
    pieces: int = 0
    """SGLang: the pieces of the worker's layout."""
    # -- adapter-only (LoRA) refits --------------------------------------------------
    adapter: str = ""
    lora_path: str = ""
    lora_name: str = ""
    lora_int_id: int = 0
    versions: list[str] = []
    """The adapter's versions this worker holds (``name@refit``)."""
    versions_bytes: int = 0
    """Their bytes on this worker."""
    held: dict[str, list[str]] = {}
    """Versions no longer handed out that requests still use, with their ids."""
    alive: list[str] = []
    """Every version whose tensors are still alive in the worker's process."""
    register_seconds: float = 0.0
    """The registration of a new version with the engines (the only part of
    an adapter-only refit that stops them)."""
    replicas: list[int] = []
    """The engine replicas the refit reached (``RefitStats.replicas``)."""
    missing_replicas: dict[int, str] = {}
    """The engine replicas it did not reach, and why."""
    missed_after: int | None = None
    """This worker missed refits: the refit it served before this one."""
    # -- the driver -------------------------------------------------------------------
    paused_seconds: float | None = None
    """How long the engine's generation was paused (``None``: not reported)."""
    engine_seconds: float | None = None
    """The driver's whole call, pause and resume included."""
    staged: bool = False
    """The driver staged the refit while the engine served (two-phase)."""

    @classmethod
    def of_refit(cls, stats: RefitStats, **engine: Any) -> EngineStats:
        """A worker's account: ``stats`` (its refit session) and what its
        engine did (``engine``: fields of this type; another is a
        ``TypeError`` here, at the worker, not a field lost on the way)."""
        return cls(rank=stats.rank, **{**_session_fields(stats), **engine})

    def to_builtins(self) -> dict[str, Any]:
        """Plain data for a reply (JSON over HTTP, msgpack through a store)."""
        return msgspec.to_builtins(self)

    @classmethod
    def of(cls, reply: Any) -> EngineStats:
        """The stats of a worker's reply (an object with ``rank`` and
        ``stats``), decoded strictly: a field this type does not know raises
        ``msgspec.ValidationError`` naming it. (Lax only where JSON must be:
        the integer keys of ``dense_peers`` arrive as strings.)"""
        stats = dict(getattr(reply, "stats", None) or {})
        stats.setdefault("rank", getattr(reply, "rank", -1))
        return msgspec.convert(stats, cls, strict=False)


def _session_fields(stats: RefitStats) -> dict[str, Any]:
    fields = stats.as_dict()
    # (ExecStats' own rank is the same; the touched set stays on the worker.)
    fields.pop("rank", None)
    fields["transfer_seconds"] = fields.pop("seconds")
    return fields
