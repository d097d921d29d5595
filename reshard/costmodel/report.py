"""``reshard plan``: predict what a layout change costs on a described cluster."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any

from reshard.costmodel.cluster import Cluster, place
from reshard.costmodel.cost import gather_broadcast_cost, lower_bound, reshard_cost
from reshard.costmodel.delta import DeltaAssumptions, delta_cost
from reshard.costmodel.rules import EngineSpec, SideLayouts, TrainerSpec, engine_layouts, trainer_layouts
from reshard.plan.index import gc_paused
from reshard.plan.layout import clear_caches
from reshard.plan.planner import Planner
from reshard.plan.rounds import DEFAULT_ROUND_BYTES

__all__ = ["PlanReport", "plan_report"]


@dataclass(slots=True)
class PlanReport:
    data: dict[str, Any]

    def table(self) -> str:
        d = self.data
        gb = 1e9
        lines = [
            f"model {d['model']['name']}: {d['model']['params'] / 1e9:.2f}B params, "
            f"{d['model']['bytes'] / gb:.1f} GB; trainer {d['trainer']} ({d['trainer_ranks']} ranks) -> "
            f"engine {d['engine']} ({d['engine_ranks']} ranks) on {d['cluster']}"
            + (" (colocated)" if d["colocate"] else ""),
            "",
            f"{'method':<18}{'network GB':>12}{'NVLink GB':>12}{'max recv GB':>13}{'max send GB':>13}{'seconds':>10}",
        ]
        for key in ("reshard", "reshard_delta", "gather_broadcast"):
            if key not in d:
                continue
            m = d[key]
            lines.append(
                f"{key:<18}{m['network_bytes'] / gb:>12.1f}{m['nvlink_bytes'] / gb:>12.1f}"
                f"{m['max_rank_recv_bytes'] / gb:>13.2f}{m['max_rank_send_bytes'] / gb:>13.2f}"
                f"{m['estimated_seconds']:>10.3f}"
            )
        lb = d["lower_bound"]
        lines.append(
            f"{'lower bound':<18}{lb['network_bytes'] / gb:>12.1f}{'':>12}{'':>13}{'':>13}{lb['seconds']:>10.3f}"
        )
        r, g = d["reshard"]["breakdown"], d["gather_broadcast"]["breakdown"]
        lines += [
            "",
            f"speedup over gather-and-broadcast: {d['speedup']:.1f}x "
            f"({d['reshard']['estimated_seconds'] / max(lb['seconds'], 1e-12):.2f}x the lower bound)",
            f"reshard time: NIC {r['nic_seconds']:.3f}s, NVLink {r['nvlink_seconds']:.3f}s, "
            f"same-GPU {r['same_gpu_seconds']:.3f}s (links overlap; the busiest counts), "
            f"+ {int(r['rounds'])} rounds {r['round_seconds']:.3f}s; "
            f"busiest GPU sends/receives {int(r['messages_max_gpu'])} messages",
            f"gather-and-broadcast: gather {g['gather_seconds']:.3f}s then broadcast {g['broadcast_seconds']:.3f}s "
            f"(if they overlapped perfectly: {g['overlapped_seconds']:.3f}s)",
            f"planning one rank's plan: {d['plan_seconds']:.3f}s, {d['plan_cpu_seconds']:.3f}s of CPU "
            f"(slowest of ranks {d['plan_sample_ranks']})",
        ]
        if "reshard_delta" in d:
            x = d["reshard_delta"]["breakdown"]
            lines.append(
                f"delta refit at {100 * x['changed']:g}% changed: the wire carries {x['wire_ratio']:.3f}x the dense "
                f"bytes; digests {x['digest_seconds']:.3f}s, compare {x['compare_seconds']:.3f}s, links "
                f"{x['link_seconds']:.3f}s, rounds {x['round_seconds']:.3f}s: "
                f"{d['reshard_delta']['estimated_seconds'] / max(d['reshard']['estimated_seconds'], 1e-12):.2f}x "
                "a dense refit's time"
            )
        return "\n".join(lines)


def _sample(trainer: range, engine: range) -> list[int]:
    picks = [trainer.start, trainer.stop - 1, trainer.start + len(trainer) // 2]
    picks += [engine.start, engine.stop - 1, engine.start + len(engine) // 2]
    return sorted(set(picks))


def _time_one_rank(
    trainer: SideLayouts, engine: SideLayouts, domain_of, rank: int, round_bytes: int
) -> tuple[float, float]:
    """Index the layouts, build the planner and plan one rank, as that rank
    does at refit time (one pause of the cyclic GC around all of it): wall
    and CPU seconds (other work on the machine inflates only the first)."""
    with gc_paused():
        c0 = time.process_time()
        t0 = time.perf_counter()
        planner = Planner(
            trainer.layout_set("source", check_ranks=(rank,)),
            engine.layout_set("destination", check_ranks=(rank,)),
            domain_of=domain_of,
            round_bytes=round_bytes,
        )
        plan = planner.plan_for(rank)
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - c0
        del plan, planner
    return elapsed, cpu


def plan_report(
    *,
    model: str,
    trainer: str,
    engine: str,
    cluster: str | Cluster,
    colocate: bool = False,
    round_bytes: int = DEFAULT_ROUND_BYTES,
    sample_ranks: list[int] | None = None,
    changed: float | None = None,
) -> PlanReport:
    """``changed``: also predict a delta refit (``GroupConfig.delta``) when
    that share of the elements changed since the last refit."""
    from reshard.models import load_model

    cl = Cluster.parse(cluster) if isinstance(cluster, str) else cluster
    spec = load_model(model)
    tspec = TrainerSpec.parse(trainer)
    espec = EngineSpec.parse(engine)
    t_side = trainer_layouts(spec.tensors, spec.config, tspec)
    e_side = engine_layouts(spec.tensors, spec.config, espec, base=tspec.world)
    placement = place(cl, tspec.world, espec.world, colocate=colocate)
    domain_of = placement.domain_of.__getitem__
    # Time single-rank plans first, in a small heap, as a rank would plan.
    ranks = sample_ranks if sample_ranks is not None else _sample(placement.trainer_ranks, placement.engine_ranks)
    plan_seconds = plan_cpu_seconds = 0.0
    # What lives on (the model, the layouts) is frozen out of the collector,
    # so the collection before each rank costs what that rank left behind.
    gc.collect()
    gc.freeze()
    try:
        for r in ranks:
            clear_caches()  # each rank plans in its own process
            gc.collect()
            wall, cpu = _time_one_rank(t_side, e_side, domain_of, r, round_bytes)
            plan_seconds, plan_cpu_seconds = max(plan_seconds, wall), max(plan_cpu_seconds, cpu)
    finally:
        gc.unfreeze()
    # The whole plan's traffic. Each rank checks the storage of its own
    # pieces (the sampled ranks above did); checking every rank's here
    # would walk every grid's whole mesh and say nothing about traffic.
    sources = t_side.layout_set("source", check_ranks=())
    planner = Planner(
        sources, e_side.layout_set("destination", check_ranks=()), domain_of=domain_of, round_bytes=round_bytes
    )
    traffic = planner.traffic()
    ours = reshard_cost(traffic, cl, placement)
    theirs = gather_broadcast_cost(t_side.stages, sources, placement.engine_ranks, cl, placement)
    lb_bytes, lb_seconds = lower_bound(planner, cl, placement)
    data = {
        "model": {"name": spec.name, "params": spec.params, "bytes": spec.nbytes},
        "trainer": str(tspec),
        "engine": str(espec),
        "cluster": cl.name,
        "colocate": colocate,
        "trainer_ranks": tspec.world,
        "engine_ranks": espec.world,
        "reshard": ours.as_dict(),
        "gather_broadcast": theirs.as_dict(),
        "lower_bound": {"network_bytes": lb_bytes, "seconds": lb_seconds},
        "speedup": theirs.estimated_seconds / ours.estimated_seconds if ours.estimated_seconds else float("inf"),
        "plan_seconds": plan_seconds,
        "plan_cpu_seconds": plan_cpu_seconds,
        "plan_sample_ranks": ranks,
        "tensor_families": planner.num_families,
    }
    if changed is not None:
        itemsize = max(1, round(spec.nbytes / max(spec.params, 1)))
        delta = delta_cost(traffic, cl, placement, DeltaAssumptions(changed=changed, itemsize=itemsize))
        data["reshard_delta"] = delta.as_dict()
    return PlanReport(data)
