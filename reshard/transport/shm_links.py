"""The executor's shared-memory links: a round's messages to and from a peer
this rank shares memory with go through a channel of
:mod:`reshard.transport.shm` instead of the process group, laid out in the
channel's slot in message order (each aligned), cut as on the wire."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from reshard.errors import RefitError
from reshard.plan.items import RankPlan
from reshard.transport.messages import align, messages, packed_size

if TYPE_CHECKING:
    import torch

    from reshard.transport.group import RefitGroup

__all__ = ["ShmLinks", "ShmWork"]


class ShmWork:
    """A shared-memory receive, waited on like a process-group work."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.wait = run


class ShmLinks:
    """One executor's channels to the peers it shares memory with.

    ``stop`` is set when the executor stops: receives waiting in a helper
    thread give up then."""

    def __init__(self, group: RefitGroup, plan: RankPlan, *, big_bytes: int, refit: int, stop: threading.Event) -> None:
        self.group = group
        self.rank = plan.rank
        self.refit = refit
        self.stop = stop
        # Per shared-memory peer: the slot its channel needs (the busiest round).
        self.slots: dict[tuple[str, int], int] = {}
        for rnd in plan.rounds:
            for side, by_peer in (("send", rnd.sends), ("recv", rnd.recvs)):
                for peer, transfers in by_peer.items():
                    if group.shares_memory(peer):
                        n = sum(align(packed_size(m)) for m in messages(transfers, big_bytes))
                        key = (side, peer)
                        self.slots[key] = max(self.slots.get(key, 0), n)

    @staticmethod
    def parts(bufs: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
        """``(offset, buffer)`` in the slot: messages in index order, each aligned."""
        parts = []
        pos = 0
        for _tag, buf in sorted(bufs, key=lambda x: x[0]):
            parts.append((pos, buf))
            pos += align(buf.numel())
        return parts

    def _error(self, text: str) -> RefitError:
        return RefitError("transfer", {self.rank: text}, version=self.refit)

    def watch(self, peer: int, *, main: bool) -> Callable[[], None]:
        """What a shared-memory wait checks: the peer's process is alive; and
        on the main thread, aborts and cancels; on the helper, this refit
        stopping."""
        group = self.group

        def watch() -> None:
            if not group.peer_alive(peer):
                raise self._error(f"rank {peer} (pid {group.hellos[peer].pid}, shared memory) died")
            if not main:
                if self.stop.is_set():
                    raise self._error("stopped")
                return
            why = group.cancelled() if group.cancelled is not None else None
            if why:
                raise self._error(f"cancelled: {why}")
            msg = group.aborted()
            if msg is not None:
                raise self._error(f"stopped: {msg}")

        return watch

    def send(self, peer: int, bufs: list[tuple[int, torch.Tensor]]) -> None:
        """Copy a round's messages to ``peer`` into its channel (waiting for the slot)."""
        group = self.group
        slot = self.slots[("send", peer)]
        seq = group.shm_seq(self.rank, peer, slot)
        deadline = time.monotonic() + group.config.timeout_s
        watch = self.watch(peer, main=True)
        try:
            ch = group.channel(self.rank, peer, slot, deadline=deadline, watch=watch)
            ch.put(seq, self.parts(bufs), watch, deadline)
        except TimeoutError as e:
            raise self._error(f"{e} (sending to rank {peer} through shared memory)") from e

    def receive(self, peer: int, bufs: list[tuple[int, torch.Tensor]]) -> ShmWork:
        """A work whose ``wait()`` copies a round's messages from ``peer``'s channel."""
        group = self.group
        slot = self.slots[("recv", peer)]
        seq = group.shm_seq(peer, self.rank, slot)
        watch = self.watch(peer, main=False)
        parts = self.parts(bufs)

        def run() -> None:
            deadline = time.monotonic() + group.config.timeout_s
            try:
                ch = group.channel(peer, self.rank, slot, deadline=deadline, watch=watch)
                ch.get(seq, parts, watch, deadline)
            except TimeoutError as e:
                raise RuntimeError(f"{e} (receiving from rank {peer} through shared memory)") from e

        return ShmWork(run)
