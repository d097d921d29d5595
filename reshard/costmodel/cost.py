"""Time model for a refit: reshard's plan and gather-and-broadcast.

Assumptions (all of them; docs/cost-model.md discusses where they are
optimistic):

1. Every GPU has one scale-out NIC rail, full duplex: ``nic`` bytes/s in and
   out at once. The fabric between hosts is non-blocking (no congestion in
   switches). Inside a domain every GPU reaches every other at ``nvlink``
   bytes/s per direction (NVSwitch). Two processes on one GPU (colocated
   trainer and engine) copy at ``hbm`` bytes/s.
2. A method's link time is the busiest link: the max over GPUs of bytes in
   and out on each link class divided by its bandwidth. Transfers are
   perfectly pipelined (a forward overlaps the next pull).
3. Each grouped round costs ``round_latency`` (launch and completion of one
   batch of sends and receives). Messages of one round to different peers
   proceed concurrently, so their latency is folded into the round's; the
   report shows the message count of the busiest GPU so a plan made of many
   tiny messages is visible. reshard packs the small transfers between a
   pair of ranks in a round into one message, so a pair exchanges at most
   min(transfers, rounds) messages.
4. Gather-and-broadcast (vLLM's ``nccl`` backend, OpenRLHF, NeMo RL's
   broadcast path): per pipeline stage, the stage's first rank gathers the
   full tensors (over NVLink from its domain, over its NIC from elsewhere;
   stages gather in parallel), then the full model is broadcast to every
   engine rank through one pipelined chain (NCCL ring broadcast), which
   crosses domain boundaries through one GPU's NIC per hop: ``bytes / nic``.
   Gather and broadcast run one after the other, bucket by bucket, as those
   frameworks do (``gather_then_broadcast``); ``overlapped_seconds`` is the
   bound if they overlapped perfectly.
5. Lower bound: each destination domain must receive, across its NICs,
   every byte its ranks need that no rank in it holds (counted once).
6. ``Cluster.nic_per_host``: a host's ranks share one NIC (its load is the
   sum of theirs); ``Cluster.broadcast == "tree"``: gloo's binomial tree of
   whole buckets instead of a ring (:func:`tree_broadcast_seconds`);
   ``Cluster.refit_seconds``: a fixed cost added to every method.
   Checked against a measured run: docs/cost-model.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from reshard.costmodel.cluster import Cluster, Deployment
from reshard.plan.index import LayoutSet
from reshard.plan.planner import Planner
from reshard.plan.traffic import Traffic

__all__ = [
    "LinkLoads",
    "MethodCost",
    "gather_broadcast_cost",
    "link_loads",
    "lower_bound",
    "reshard_cost",
    "tree_broadcast_seconds",
]


@dataclass(slots=True)
class MethodCost:
    network_bytes: int
    nvlink_bytes: int
    max_rank_recv_bytes: int
    max_rank_send_bytes: int
    estimated_seconds: float
    breakdown: dict[str, float] = field(default_factory=dict)
    local_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "network_bytes": self.network_bytes,
            "nvlink_bytes": self.nvlink_bytes,
            "local_bytes": self.local_bytes,
            "max_rank_recv_bytes": self.max_rank_recv_bytes,
            "max_rank_send_bytes": self.max_rank_send_bytes,
            "estimated_seconds": self.estimated_seconds,
            "breakdown": self.breakdown,
        }


@dataclass(slots=True)
class LinkLoads:
    """Bytes per GPU and link of one plan's traffic (:func:`link_loads`)."""

    nic_in: Counter = field(default_factory=Counter)
    nic_out: Counter = field(default_factory=Counter)
    nvl_in: Counter = field(default_factory=Counter)
    nvl_out: Counter = field(default_factory=Counter)
    same_gpu: Counter = field(default_factory=Counter)
    send: Counter = field(default_factory=Counter)
    """Per rank, bytes it sends (same-GPU pairs included)."""
    recv: Counter = field(default_factory=Counter)
    net_bytes: int = 0
    nvl_bytes: int = 0
    host_of: dict = field(default_factory=dict)
    """Per GPU, its host (NICs shared per host: ``Cluster.nic_per_host``)."""

    def nics(self, cluster: Cluster) -> tuple[Counter, Counter]:
        """Bytes into and out of each NIC: per GPU, or per host where its GPUs share one."""
        if not cluster.nic_per_host:
            return self.nic_in, self.nic_out
        nic_in: Counter = Counter()
        nic_out: Counter = Counter()
        for g, b in self.nic_in.items():
            nic_in[self.host_of[g]] += b
        for g, b in self.nic_out.items():
            nic_out[self.host_of[g]] += b
        return nic_in, nic_out

    def nic_seconds(self, cluster: Cluster) -> float:
        nic_in, nic_out = self.nics(cluster)
        return max((b / cluster.nic_bytes_per_s for b in (*nic_in.values(), *nic_out.values())), default=0.0)

    @property
    def gpus(self) -> set:
        return set(self.nic_in) | set(self.nic_out) | set(self.nvl_in) | set(self.nvl_out) | set(self.same_gpu)

    def seconds(self, cluster: Cluster) -> float:
        """The busiest link (links overlap): a GPU's, or a NIC's."""
        nvl, hbm = cluster.nvlink_bytes_per_s, cluster.hbm_bytes_per_s
        inside = max(
            (max(self.nvl_in[g] / nvl, self.nvl_out[g] / nvl, self.same_gpu[g] / hbm) for g in self.gpus),
            default=0.0,
        )
        return max(inside, self.nic_seconds(cluster))


def link_loads(
    traffic: Traffic, placement: Deployment, wire: Callable[[int, int, int], int] | None = None
) -> LinkLoads:
    """Where ``traffic``'s bytes go: pairs on one GPU copy through its
    memory, pairs in one NVLink domain over NVLink, the others over NICs.
    ``wire(src, dst, bytes)``: what a pair on two GPUs puts on the wire
    (default: its bytes)."""
    out = LinkLoads()
    out.host_of = dict(zip(placement.gpu_of, placement.host_of, strict=True))
    for (s, d), b in traffic.pairs.items():
        gs, gd = placement.gpu_of[s], placement.gpu_of[d]
        if gs != gd and wire is not None:
            b = wire(s, d, b)
        out.send[s] += b
        out.recv[d] += b
        if gs == gd:
            out.same_gpu[gs] += b
        elif placement.domain_of[s] == placement.domain_of[d]:
            out.nvl_out[gs] += b
            out.nvl_in[gd] += b
            out.nvl_bytes += b
        else:
            out.nic_out[gs] += b
            out.nic_in[gd] += b
            out.net_bytes += b
    for r, b in traffic.local.items():
        out.same_gpu[placement.gpu_of[r]] += b
    return out


def reshard_cost(traffic: Traffic, cluster: Cluster, placement: Deployment) -> MethodCost:
    nvl, hbm = cluster.nvlink_bytes_per_s, cluster.hbm_bytes_per_s
    loads = link_loads(traffic, placement)
    rounds = traffic.num_rounds
    messages: Counter = Counter()
    for s, d in traffic.pairs:
        m = min(traffic.transfers[(s, d)], rounds)
        messages[placement.gpu_of[s]] += m
        messages[placement.gpu_of[d]] += m
    gpus = loads.gpus
    nic_t = loads.nic_seconds(cluster)
    nvl_t = max((max(loads.nvl_in[g], loads.nvl_out[g]) / nvl for g in gpus), default=0.0)
    hbm_t = max((loads.same_gpu[g] / hbm for g in gpus), default=0.0)
    round_t = rounds * cluster.round_latency_s
    return MethodCost(
        network_bytes=loads.net_bytes,
        nvlink_bytes=loads.nvl_bytes,
        local_bytes=sum(loads.same_gpu.values()),
        max_rank_recv_bytes=max(loads.recv.values(), default=0),
        max_rank_send_bytes=max(loads.send.values(), default=0),
        estimated_seconds=loads.seconds(cluster) + round_t + cluster.refit_seconds,
        breakdown={
            "refit_seconds": cluster.refit_seconds,
            "nic_seconds": nic_t,
            "nvlink_seconds": nvl_t,
            "same_gpu_seconds": hbm_t,
            "messages_max_gpu": float(max(messages.values(), default=0)),
            "round_seconds": round_t,
            "rounds": float(rounds),
        },
    )


def gather_broadcast_cost(
    stages: list[tuple[int, list[str]]],
    sources: LayoutSet,
    engine_ranks: range,
    cluster: Cluster,
    placement: Deployment,
) -> MethodCost:
    """Gather full tensors on each stage's first rank, then broadcast them all."""
    nic, nvl = cluster.nic_bytes_per_s, cluster.nvlink_bytes_per_s
    engine_domains = {placement.domain_of[r] for r in engine_ranks}
    n_engine = len(engine_ranks)
    gather_t = 0.0
    net = nvlink = 0
    total = 0
    max_recv = 0
    bcast_net = bcast_nvl = 0
    stage_sizes: list[tuple[int, int]] = []
    for root, names in stages:
        root_dom = placement.domain_of[root]
        stage_bytes = own = near = 0
        for name in names:
            meta = sources.metas[name]
            item = meta.nbytes // max(1, _numel(meta.shape))
            stage_bytes += meta.nbytes
            for gid, _ in sources.tensor_grids.get(name, ()):
                for box, ranks, _ in sources.grids[gid].holders(meta.shape):
                    if root in ranks:
                        own += box.numel * item
                    elif any(placement.domain_of[r] == root_dom for r in ranks):
                        near += box.numel * item
            by_box: dict = {}
            for s in sources.tensor_slots.get(name, ()):
                by_box.setdefault(s.box, []).append(s.rank)
            for box, ranks in by_box.items():
                if root in ranks:
                    own += box.numel * item
                elif any(placement.domain_of[r] == root_dom for r in ranks):
                    near += box.numel * item
        stage_sizes.append((root, stage_bytes))
        far = stage_bytes - own - near
        gather_t = max(gather_t, far / nic, near / nvl)
        net += far
        nvlink += near
        max_recv = max(max_recv, far + near)
        total += stage_bytes
        entries = len(engine_domains - {root_dom})
        bcast_net += stage_bytes * entries
        bcast_nvl += stage_bytes * (n_engine - entries)
    crosses = any(placement.domain_of[root] not in engine_domains for root, _ in stages) or len(engine_domains) > 1
    bcast_bw = nic if crosses else nvl
    hops = n_engine
    if cluster.broadcast == "tree":
        # gloo: a binomial tree over [root, *engines], whole buckets per level.
        bcast_t = sum(tree_broadcast_seconds([root, *engine_ranks], b, cluster, placement) for root, b in stage_sizes)
        bcast_t += hops * cluster.message_latency_s
    else:
        # NCCL's ring pipelines the bytes once through the slowest link.
        bcast_t = total / bcast_bw + hops * cluster.message_latency_s
    return MethodCost(
        network_bytes=net + bcast_net,
        nvlink_bytes=nvlink + bcast_nvl,
        max_rank_recv_bytes=max(max_recv, total),
        max_rank_send_bytes=total,
        estimated_seconds=gather_t + bcast_t + cluster.refit_seconds,
        breakdown={
            "refit_seconds": cluster.refit_seconds,
            "gather_seconds": gather_t,
            "broadcast_seconds": bcast_t,
            "overlapped_seconds": max(gather_t, bcast_t),
        },
    )


def tree_broadcast_seconds(members: list[int], nbytes: int, cluster: Cluster, placement: Deployment) -> float:
    """A binomial-tree broadcast of ``nbytes`` from ``members[0]`` (gloo's):
    at level ``k`` each member ``i < 2**k`` sends the whole buffer to member
    ``i + 2**k``; a level lasts as long as its busiest link (a NIC, shared
    per host where ``Cluster.nic_per_host``, or a GPU's NVLink), and levels
    run one after the other."""
    total = 0.0
    step = 1
    n = len(members)
    while step < n:
        nic_in: Counter = Counter()
        nic_out: Counter = Counter()
        nvl: Counter = Counter()
        for i in range(min(step, n - step)):
            s, d = members[i], members[i + step]
            gs, gd = placement.gpu_of[s], placement.gpu_of[d]
            if gs == gd:
                continue
            if placement.domain_of[s] == placement.domain_of[d]:
                nvl[gs] += nbytes
                nvl[gd] += nbytes
                continue
            ks = placement.host_of[s] if cluster.nic_per_host else gs
            kd = placement.host_of[d] if cluster.nic_per_host else gd
            nic_out[ks] += nbytes
            nic_in[kd] += nbytes
        total += max(
            max((b / cluster.nic_bytes_per_s for b in (*nic_in.values(), *nic_out.values())), default=0.0),
            max((b / cluster.nvlink_bytes_per_s for b in nvl.values()), default=0.0),
        )
        step *= 2
    return total


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def lower_bound(planner: Planner, cluster: Cluster, placement: Deployment) -> tuple[int, float]:
    """(network bytes, seconds) no plan for these layouts can beat."""
    ingress = planner.domain_ingress()
    seconds = 0.0
    for dom, b in ingress.items():
        if cluster.nic_per_host:
            nics = len({h for h, d in zip(placement.host_of, placement.domain_of, strict=True) if d == dom})
        else:
            nics = placement.ranks_in_domain(dom)
        seconds = max(seconds, b / (nics * cluster.nic_bytes_per_s))
    return sum(ingress.values()), seconds
