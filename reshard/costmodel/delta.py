"""Time model for a delta refit (``GroupConfig.delta``), on top of reshard's plan.

Assumptions, beyond those of :mod:`reshard.costmodel.cost`:

1. A share ``changed`` of the elements changed since the last refit, spread
   evenly (what an RL step at a small learning rate does to bf16 weights).
   Each transfer from a trainer rank to an engine rank then moves the
   smallest exact encoding of its elements
   (:mod:`reshard.plan.delta_format`, whose :func:`wire_ratio` gives the
   ratio to dense), and a header per transfer.
2. Forwards inside an engine domain, and pairs of ranks on one GPU, stay
   dense (they copy at NVLink or HBM speed, where comparing costs as much).
3. Before its sends a trainer rank compares what it sends with its snapshot
   (reads both, writes back what changed) at ``compare_bytes_per_s`` per byte
   sent (HBM-bound on a GPU; default: half the HBM rate, two reads per
   byte); at the plan step every engine rank digests the base of every pair
   that may move a delta at ``digest_bytes_per_s`` (default: the HBM rate).
   These do not overlap the transfer (a conservative bound: the compare of a
   round overlaps the previous round's bytes in the executor).
4. Each round exchanges a header before its payloads: one more round latency.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from reshard.costmodel.cluster import Cluster, Deployment
from reshard.costmodel.cost import MethodCost, link_loads
from reshard.plan.delta_format import HEADER_BYTES, wire_ratio
from reshard.plan.traffic import Traffic

__all__ = ["DeltaAssumptions", "delta_cost", "wire_ratio"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DeltaAssumptions:
    changed: float
    """Share of the elements that changed since the last refit."""
    itemsize: int = 2
    """Bytes per element in the engine (bf16: 2)."""
    compare_bytes_per_s: float | None = None
    """How fast a trainer rank compares what it sends with its snapshot (``None``: half the cluster's HBM rate)."""
    digest_bytes_per_s: float | None = None
    """How fast an engine rank digests its base at the plan step (``None``: the HBM rate)."""

    def __post_init__(self) -> None:
        wire_ratio(self.changed, self.itemsize)  # validates
        if self.itemsize < 1:
            raise ValueError(f"itemsize must be >= 1, got {self.itemsize}")


def delta_cost(traffic: Traffic, cluster: Cluster, placement: Deployment, a: DeltaAssumptions) -> MethodCost:
    """A delta refit of the plan behind ``traffic`` (see the module docstring)."""
    hbm = cluster.hbm_bytes_per_s
    compare_rate = a.compare_bytes_per_s or hbm / 2
    digest_rate = a.digest_bytes_per_s or hbm
    ratio = wire_ratio(a.changed, a.itemsize)
    trainers = placement.trainer_ranks
    compared: Counter = Counter()
    digested: Counter = Counter()

    def wire(s: int, d: int, b: int) -> int:
        if s not in trainers or d in trainers:
            return b  # forwards between engine ranks move dense
        compared[placement.gpu_of[s]] += b
        digested[placement.gpu_of[d]] += b
        return int(b * ratio) + HEADER_BYTES * traffic.transfers[(s, d)]

    loads = link_loads(traffic, placement, wire)
    link_t = loads.seconds(cluster)
    compare_t = max((b / compare_rate for b in compared.values()), default=0.0)
    digest_t = max((b / digest_rate for b in digested.values()), default=0.0)
    round_t = 2 * traffic.num_rounds * cluster.round_latency_s
    return MethodCost(
        network_bytes=loads.net_bytes,
        nvlink_bytes=loads.nvl_bytes,
        local_bytes=sum(loads.same_gpu.values()),
        max_rank_recv_bytes=max(loads.recv.values(), default=0),
        max_rank_send_bytes=max(loads.send.values(), default=0),
        estimated_seconds=digest_t + compare_t + link_t + round_t + cluster.refit_seconds,
        breakdown={
            "changed": a.changed,
            "wire_ratio": ratio,
            "link_seconds": link_t,
            "compare_seconds": compare_t,
            "digest_seconds": digest_t,
            "round_seconds": round_t,
        },
    )
