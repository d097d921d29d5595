"""Plan items: what one rank does in a refit.

A :class:`Transfer` reads like a DCP ``ReadItem``: a box of a canonical
tensor, the slot it is read from (``src``) and the slot it lands in
(``dst``), its kind, round and size on the wire. A :class:`RankPlan` is one
rank's transfers grouped by round and peer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import msgspec

from reshard.plan.box import Box
from reshard.plan.layout import Slot

__all__ = ["RankPlan", "Round", "Transfer", "TransferKind"]


class TransferKind(StrEnum):
    """How a transfer moves (its value compares equal to its name)."""

    PULL = "pull"
    """From a source (trainer) slot to a destination slot on another rank."""
    FWD = "fwd"
    """A leader forwards what it received earlier in this refit to another
    destination rank of its domain."""
    COPY = "copy"
    """Within one rank (it holds the source and needs the destination)."""


class Transfer(msgspec.Struct, frozen=True, gc=False):
    """Move ``box`` of ``tensor`` from ``src`` (a slot on the sending rank)
    to ``dst`` (a slot on the receiving rank) in round ``round``.

    ``kind``: ``pull`` reads a source (trainer) slot; ``fwd`` reads a
    destination slot the sender received earlier in this refit (a leader
    forwarding inside its domain); ``copy`` stays on one rank.

    ``dtype``: the element type on the wire, the source slot's (the
    canonical dtype for a pull, the leader's for a forward); ``nbytes``
    counts those. A destination slot of another dtype casts on arrival.

    A Struct (like :class:`~reshard.plan.layout.Slot`): built ten times
    faster than a dataclass, and a plan has tens of thousands.
    """

    tensor: str
    box: Box
    src: Slot
    dst: Slot
    kind: TransferKind
    round: int
    nbytes: int
    ordinal: int
    dtype: str = ""

    def sort_key(self) -> tuple:
        return (self.ordinal, self.box.offsets, self.box.sizes, self.dst.local, self.kind)

    def __str__(self) -> str:
        cast = f" {self.dtype}->{self.dst.dtype}" if self.dst.dtype and self.dst.dtype != self.dtype else ""
        return (
            f"{self.tensor}{self.box} {self.src.rank}->{self.dst.rank} {self.kind} r{self.round} {self.nbytes}B{cast}"
        )


@dataclass(slots=True)
class Round:
    index: int
    sends: dict[int, list[Transfer]] = field(default_factory=dict)
    recvs: dict[int, list[Transfer]] = field(default_factory=dict)
    copies: list[Transfer] = field(default_factory=list)


@dataclass(slots=True)
class RankPlan:
    """Everything one rank does in a refit, round by round."""

    rank: int
    rounds: list[Round]
    num_rounds: int

    def transfers(self) -> list[Transfer]:
        out: list[Transfer] = []
        for r in self.rounds:
            for ts in r.sends.values():
                out.extend(ts)
            for ts in r.recvs.values():
                out.extend(ts)
            out.extend(r.copies)
        return out

    @property
    def send_bytes(self) -> int:
        return sum(t.nbytes for r in self.rounds for ts in r.sends.values() for t in ts)

    @property
    def recv_bytes(self) -> int:
        return sum(t.nbytes for r in self.rounds for ts in r.recvs.values() for t in ts)
