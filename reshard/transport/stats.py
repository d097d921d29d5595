"""What one rank moved in one refit (:class:`ExecStats`), and its account
of the whole refit (:class:`RefitStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from reshard.plan.items import Transfer

__all__ = ["PHASES", "ExecStats", "RefitStats", "count_cast"]

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
    "after_round": "the caller's work between rounds (an engine applying the layers whose bytes landed)",
    "after_transfer": "the caller's work after the last round, before the outcome is agreed (an apply draining)",
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
        )
        return d
