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
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from reshard.costmodel.cluster import Cluster, Deployment
from reshard.plan.index import LayoutSet
from reshard.plan.planner import Planner
from reshard.plan.traffic import Traffic

__all__ = ["MethodCost", "gather_broadcast_cost", "lower_bound", "reshard_cost"]


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


def reshard_cost(traffic: Traffic, cluster: Cluster, placement: Deployment) -> MethodCost:
    nic, nvl, hbm = cluster.nic_bytes_per_s, cluster.nvlink_bytes_per_s, cluster.hbm_bytes_per_s
    nic_in: Counter = Counter()
    nic_out: Counter = Counter()
    nvl_in: Counter = Counter()
    nvl_out: Counter = Counter()
    same_gpu: Counter = Counter()
    messages: Counter = Counter()
    rounds = traffic.num_rounds
    net_bytes = nvl_bytes = 0
    for (s, d), b in traffic.pairs.items():
        gs, gd = placement.gpu_of[s], placement.gpu_of[d]
        m = min(traffic.transfers[(s, d)], rounds)
        messages[gs] += m
        messages[gd] += m
        if gs == gd:
            same_gpu[gs] += b
            continue
        if placement.domain_of[s] == placement.domain_of[d]:
            nvl_out[gs] += b
            nvl_in[gd] += b
            nvl_bytes += b
        else:
            nic_out[gs] += b
            nic_in[gd] += b
            net_bytes += b
    for r, b in traffic.local.items():
        same_gpu[placement.gpu_of[r]] += b
    gpus = set(nic_in) | set(nic_out) | set(nvl_in) | set(nvl_out) | set(same_gpu)
    nic_t = max((max(nic_in[g], nic_out[g]) / nic for g in gpus), default=0.0)
    nvl_t = max((max(nvl_in[g], nvl_out[g]) / nvl for g in gpus), default=0.0)
    hbm_t = max((same_gpu[g] / hbm for g in gpus), default=0.0)
    link_t = max(
        (max(nic_in[g] / nic, nic_out[g] / nic, nvl_in[g] / nvl, nvl_out[g] / nvl, same_gpu[g] / hbm) for g in gpus),
        default=0.0,
    )
    round_t = rounds * cluster.round_latency_s
    recv: Counter = Counter()
    send: Counter = Counter()
    for (s, d), b in traffic.pairs.items():
        send[s] += b
        recv[d] += b
    return MethodCost(
        network_bytes=net_bytes,
        nvlink_bytes=nvl_bytes,
        local_bytes=sum(same_gpu.values()),
        max_rank_recv_bytes=max(recv.values(), default=0),
        max_rank_send_bytes=max(send.values(), default=0),
        estimated_seconds=link_t + round_t,
        breakdown={
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
    bcast_t = total / bcast_bw + hops * cluster.message_latency_s
    return MethodCost(
        network_bytes=net + bcast_net,
        nvlink_bytes=nvlink + bcast_nvl,
        max_rank_recv_bytes=max(max_recv, total),
        max_rank_send_bytes=total,
        estimated_seconds=gather_t + bcast_t,
        breakdown={
            "gather_seconds": gather_t,
            "broadcast_seconds": bcast_t,
            "overlapped_seconds": max(gather_t, bcast_t),
        },
    )


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
        seconds = max(seconds, b / (placement.ranks_in_domain(dom) * cluster.nic_bytes_per_s))
    return sum(ingress.values()), seconds
