"""Which transfers skip the process group: a colocated receiver reads them
straight from its sender's exported tensors (shared memory, CUDA IPC), the
same decision on both sides (from the hellos and the same exports); and why
a plan cannot run on a group without a process group."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from reshard.errors import Problem
from reshard.plan.items import RankPlan, Round, Transfer

if TYPE_CHECKING:
    from reshard.transport import wire
    from reshard.transport.group import RefitGroup
    from reshard.transport.wire import Export

__all__ = ["is_direct", "no_wire_problems", "no_wire_text", "wire_transfers", "without_direct"]


def is_direct(group: RefitGroup, src: int, dst: int, t: Transfer, exports: Mapping[int, Mapping[str, Export]]) -> bool:
    """Does ``t`` (from ``src`` to ``dst``) skip the wire, read by ``dst``
    straight from ``src``'s exported tensor? Both ranks decide alike: from
    the hellos and the same exports."""
    if t.kind == "fwd" or not group.direct_link(src, dst):
        return False
    e = exports.get(src, {}).get(t.src.local)
    return (
        e is not None
        and e.shape == tuple(t.src.local_shape)
        and e.dtype == t.dtype
        and (not t.src.dtype or t.src.dtype == e.dtype)
    )


def without_direct(
    group: RefitGroup,
    plan: RankPlan,
    exports: Mapping[int, Mapping[str, Export]],
    direct_in: dict[int, list[tuple[int, Transfer]]] | None = None,
    direct_out: dict[int, list[tuple[int, Transfer]]] | None = None,
) -> RankPlan:
    """``plan`` without the transfers that skip the wire (see :func:`is_direct`);
    those are kept aside per round in ``direct_in`` and ``direct_out``."""
    me = plan.rank
    direct_in = {} if direct_in is None else direct_in
    direct_out = {} if direct_out is None else direct_out

    def split(rnd: Round, by_peer: dict[int, list[Transfer]], out: dict, sending: bool) -> dict:
        kept: dict[int, list[Transfer]] = {}
        for peer, ts in by_peer.items():
            for t in ts:
                src, dst = (me, peer) if sending else (peer, me)
                if is_direct(group, src, dst, t, exports):
                    out.setdefault(rnd.index, []).append((peer, t))
                else:
                    kept.setdefault(peer, []).append(t)
        return kept

    rounds = [
        replace(
            rnd,
            sends=split(rnd, rnd.sends, direct_out, True),
            recvs=split(rnd, rnd.recvs, direct_in, False),
        )
        for rnd in plan.rounds
    ]
    return replace(plan, rounds=rounds)


def wire_transfers(plan: RankPlan, *, sends_only: bool = False) -> list[tuple[str, int, Transfer]]:
    """``("send" | "recv", peer, transfer)`` for every transfer of ``plan``
    that travels over the process group (shared-memory channels included)."""
    out: list[tuple[str, int, Transfer]] = []
    for rnd in plan.rounds:
        for side, by_peer in (("send", rnd.sends), ("recv", rnd.recvs)):
            if sends_only and side == "recv":
                continue
            for peer, ts in by_peer.items():
                out.extend((side, peer, t) for t in ts)
    return out


def no_wire_text(group: RefitGroup, wired: list[tuple[str, int, Transfer]]) -> str:
    """Why a plan that needs the process group cannot run on ``group``, naming
    its first transfers (``wired``, from :func:`wire_transfers`)."""
    me = group.rank
    parts = []
    for side, peer, t in wired[:3]:
        src, dst = (me, peer) if side == "send" else (peer, me)
        why = (
            "forwarded"
            if t.kind == "fwd"
            else (
                "not exported by its sender"
                if group.direct_link(src, dst)
                else f"rank {dst} cannot map rank {src}'s GPU"
            )
        )
        parts.append(f"{t.tensor!r}{t.box} from rank {src} to rank {dst} ({t.nbytes} bytes; {why})")
    more = f" and {len(wired) - 3} more" if len(wired) > 3 else ""
    return f"{'; '.join(parts)}{more} must cross the process group, which this group has not: {group.no_wire}"


def no_wire_problems(
    group: RefitGroup, plan: RankPlan, exports: tuple[wire.Export, ...], refused: str = ""
) -> tuple[Problem, ...]:
    """On a group without a process group (ranks share a GPU), what this
    rank's plan would send over one: every byte must be read directly.
    Each rank checks its own sends (a source with its exports, a leader its
    forwards), so the refit is refused at the plan step, before any byte
    moves. ``refused``: why this source exported less than its tensors."""
    mine = {group.rank: {e.local: e for e in exports}} if exports else {}
    wired = wire_transfers(without_direct(group, plan, mine), sends_only=True)
    if not wired:
        return ()
    peers = tuple(sorted({group.rank} | {peer for _, peer, _ in wired}))
    text = no_wire_text(group, wired)
    if refused:
        text += f"; rank {group.rank} did not export: {refused}"
    return (Problem(kind="link", message=text, tensor=wired[0][2].tensor, ranks=peers),)
