"""A session's direct reads: what a source rank exports for its colocated
receivers (shared memory, or CUDA IPC on a GPU) and what a destination
reads of them.

A source publishes its exports under ``exports/<rank>/<digest>`` once per
change, so that a plan status carries only the digest; a destination reads
a source's exports from the store only when their digest is new to it.
Which transfers then skip the wire is decided in
:mod:`reshard.transport.links`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from reshard.errors import RefitError
from reshard.plan.items import RankPlan
from reshard.transport import wire
from reshard.transport.ipc import CudaExporter
from reshard.transport.shm import Exporter

if TYPE_CHECKING:
    import torch

    from reshard.transport.config import GroupConfig
    from reshard.transport.group import RefitGroup

__all__ = ["SessionExports"]

log = logging.getLogger(__name__)


class SessionExports:
    """One rank's exports across its refits (see the module docstring)."""

    def __init__(self, rank: int, *, is_source: bool) -> None:
        self.rank = rank
        self.is_source = is_source
        self._exporter: Exporter | CudaExporter | None = None
        self._published: tuple[int, str] = (-1, "")
        self._read: dict[int, tuple[str, dict[str, wire.Export]]] = {}

    @property
    def refused(self) -> str:
        """Why this source exported less than its tensors (empty: it did not)."""
        return self._exporter.refused if self._exporter is not None else ""

    def publish(
        self,
        group: RefitGroup,
        config: GroupConfig,
        tensors: Mapping[str, torch.Tensor] | None,
        device: torch.device | str,
        plan: Callable[[], RankPlan],
    ) -> tuple[tuple[wire.Export, ...], str]:
        """A source rank's tensors for the colocated receivers to read
        directly, and their digest: in shared memory
        (``GroupConfig.export_sources``), or on a GPU by CUDA IPC
        (``shared_memory``); empty otherwise. ``plan``: this rank's plan (for
        which destinations read which tensor by CUDA IPC)."""
        if not (config.shared_memory and self.is_source) or tensors is None:
            return (), ""
        cuda = group.hellos[self.rank].ipc_host != ""
        if cuda:
            readers = self._ipc_readers(group, plan)
            if not readers:
                return (), ""
            import torch

            # Receivers copy once the plan is agreed: whatever the trainer
            # queued on this GPU (its optimizer step) must have landed.
            torch.cuda.synchronize(device)
            if not isinstance(self._exporter, CudaExporter):
                self._exporter = CudaExporter()
            before = self._exporter.refused
            local = {r for rs in readers.values() for r in rs if group.same_process(r)}
            out = self._exporter.exports(tensors, readers, epoch=group.epoch, local=local)
            where = "for CUDA IPC"
        else:
            if not config.export_sources:
                return (), ""
            destinations = range(config.num_sources, config.world_size)
            if not any(group.direct_link(self.rank, r) == "shm" for r in destinations):
                return (), ""
            if not isinstance(self._exporter, Exporter):
                self._exporter = Exporter()
            before = self._exporter.refused
            out = self._exporter.exports(tensors)
            where = "to shared memory"
        if self._exporter.refused and self._exporter.refused != before:
            log.warning("rank %d: source tensors not exported %s: %s", self.rank, where, self._exporter.refused)
        if not out:
            return (), ""
        msg = wire.Exports(rank=self.rank, exports=out)
        digest = hashlib.blake2b(wire.encode(msg), digest_size=12).hexdigest()
        key = f"exports/{self.rank}/{digest}"
        if (group.epoch, key) != self._published:
            group.put(key, msg, step="plan")
            self._published = (group.epoch, key)
        return out, digest

    def _ipc_readers(self, group: RefitGroup, plan: Callable[[], RankPlan]) -> dict[str, set[int]]:
        """Per local tensor of this source rank, the destinations that read
        some of it by CUDA IPC (from the plan; none when it cannot be planned,
        and the plan step says why)."""
        try:
            planned = plan()
        except Exception:  # the plan step plans again, and says why on every rank
            return {}
        readers: dict[str, set[int]] = {}
        for rnd in planned.rounds:
            for peer, ts in rnd.sends.items():
                if group.direct_link(self.rank, peer) != "ipc":
                    continue
                for t in ts:
                    if t.kind != "fwd":
                        readers.setdefault(t.src.local, set()).add(peer)
        return readers

    def needed(
        self, group: RefitGroup, statuses: list[wire.Status], mine: tuple[wire.Export, ...]
    ) -> dict[int, dict[str, wire.Export]]:
        """Per source rank, the exports this rank's executor needs: a source
        its own; a destination those of the sources it shares memory with
        (read from the store when their digest is new to it)."""
        if self.is_source:
            return {self.rank: {e.local: e for e in mine}} if mine else {}
        wanted = {s.rank: s.exports for s in statuses if s.exports and group.direct_link(s.rank, self.rank)}
        missing = [(r, d) for r, d in wanted.items() if self._read.get(r, ("", None))[0] != d]
        if missing:
            got = group.get_many([f"exports/{r}/{d}" for r, d in missing], wire.Exports, step="transfer")
            for (r, d), msg in zip(missing, got, strict=True):
                assert isinstance(msg, wire.Exports)
                if msg.rank != r:
                    raise RefitError("transfer", {self.rank: f"exports/{r}/{d} holds rank {msg.rank}'s exports"})
                self._read[r] = (d, {e.local: e for e in msg.exports})
        out = {r: self._read[r][1] for r in wanted}
        group.retain_exports({r: es.values() for r, es in out.items()})
        return out
