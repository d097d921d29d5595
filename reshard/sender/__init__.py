"""The trainer side: a :class:`Sender` on every trainer rank.

Call order (every trainer rank, collectively with every engine worker):

1. ``sender = Sender(model, config=GroupConfig(...))`` - reads what this rank
   holds: DTensor parameters (FSDP2 ``fully_shard``, TP) from their mesh and
   placements, DeepSpeed ZeRO-3 partitions and FSDP1 flat parameters from
   their own records (:mod:`reshard.sender.trainers`), plain tensors as
   replicas, fused transformers parameters split into checkpoint tensors,
   and whatever a registered trainer reader reads
   (:mod:`reshard.sender.readers`: Megatron's ``MegatronSource``); or
   explicit :class:`PieceSpec` records (:meth:`Sender.from_pieces`).
2. ``sender.push(n)`` for refits ``n = 1, 2, ...``: joins the refit group on
   first use, then plans and sends. Every engine worker calls its receiver's
   ``pull(n)`` at the same time.
3. ``sender.close()``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from reshard.plan.layout import Layout
from reshard.plan.specs import GridSpec, PieceSpec, build_layout
from reshard.sender.engines import Engines, EngineStats, push_beside
from reshard.sender.pieces import default_rename
from reshard.sender.readers import Description
from reshard.sender.trainers import DRAFT_NAMES, describe_trainer, with_draft
from reshard.transport.group import GroupConfig
from reshard.transport.locals import LocalTensors, local_tensors
from reshard.transport.session import DEFAULT_BUDGET_BYTES, RefitSession, RefitStats

if TYPE_CHECKING:
    import torch

__all__ = ["Sender", "default_device", "default_rank", "default_rename"]

log = logging.getLogger("reshard")


class Sender:
    """Serves one trainer rank's tensors to refits (see the module docstring)."""

    def __init__(
        self,
        source: torch.nn.Module | Mapping[str, torch.Tensor] | Any,
        *,
        config: GroupConfig,
        rank: int | None = None,
        rename: Callable[[str], str | None] | None = default_rename,
        model_type: str | None = None,
        include_buffers: bool = True,
        source_rank_of: Callable[[int], int] | None = None,
        device: torch.device | str | None = None,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        round_bytes: int | None = None,
        progress: bool | None = None,
        draft: torch.nn.Module | Mapping[str, torch.Tensor] | Any = None,
        draft_names: str = DRAFT_NAMES,
    ) -> None:
        """``source``: a module (parameters and persistent buffers), as the
        trainer wrapped it, or a dict of named tensors, or what a registered
        trainer reader takes (:mod:`reshard.sender.readers`; e.g.
        ``reshard.sender.megatron.MegatronSource``). ``rank``: this trainer rank (default: the rank in
        the default process group, else 0). ``rename`` maps a parameter name
        to its checkpoint name (``None`` skips it; the default strips FSDP,
        DDP and ``torch.compile`` prefixes). ``model_type``: the transformers
        model type whose checkpoint conversion splits fused parameters
        (default: the unwrapped model's ``config.model_type`` when present).
        ``source_rank_of`` maps a DTensor mesh rank (a rank of the trainer's
        default group) to its refit rank (default: the same number).
        ``progress``: draw a progress line during long refits (default: on
        refit rank 0 when stderr is a terminal).

        ``draft``: a speculative drafter trained beside the policy (a draft
        model, an EAGLE head, MTP layers in a module of their own), read as
        ``source`` is and published under the engine's drafter names: its
        checkpoint names under ``draft_names`` (``"draft."``, as vLLM
        engines name a drafter with a checkpoint of its own; ``""`` for MTP
        layers, which carry the policy checkpoint's names). MTP layers
        inside the policy module need nothing: they are the policy's."""
        if rank is None:
            rank = default_rank()
        if rank >= config.num_sources:
            raise ValueError(f"trainer rank {rank} but the refit group has {config.num_sources} source ranks")

        def describe(src: Any) -> Description:
            return describe_trainer(
                src,
                rank=rank,
                rename=rename,
                model_type=model_type if src is source else None,
                include_buffers=include_buffers,
                source_rank_of=source_rank_of,
            )

        if draft is None:
            self._describe: Callable[[], tuple] | None = lambda: describe(source)
        else:
            self._describe = lambda: with_draft(describe(source), describe(draft), draft_names)
        pieces, grids, tensors = self._describe()
        layout = build_layout(rank, pieces, grids)
        self._init(config, rank, layout, tensors, device, budget_bytes, round_bytes, progress)

    @classmethod
    def from_pieces(
        cls,
        pieces: Sequence[PieceSpec],
        tensors: Mapping[str, torch.Tensor],
        *,
        config: GroupConfig,
        rank: int,
        grids: Sequence[GridSpec] = (),
        device: torch.device | str | None = None,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        round_bytes: int | None = None,
        progress: bool | None = None,
    ) -> Sender:
        """A sender for an explicit layout: ``pieces`` say which box of which
        canonical tensor sits where in ``tensors`` (local name -> tensor)."""
        self = cls.__new__(cls)
        self._describe = None
        self._init(
            config, rank, build_layout(rank, pieces, grids), tensors, device, budget_bytes, round_bytes, progress
        )
        return self

    @classmethod
    def from_layout(
        cls,
        layout: Layout,
        tensors: Mapping[str, torch.Tensor],
        *,
        config: GroupConfig,
        device: torch.device | str | None = None,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        round_bytes: int | None = None,
        progress: bool | None = None,
    ) -> Sender:
        """A sender for a ready-made :class:`Layout` (pieces and grids)."""
        self = cls.__new__(cls)
        self._describe = None
        self._init(config, layout.rank, layout, tensors, device, budget_bytes, round_bytes, progress)
        return self

    def _init(self, config, rank, layout: Layout, tensors, device, budget_bytes, round_bytes, progress) -> None:
        # Local tensors are checked against the layout at every push, where a
        # problem reaches every rank of the refit instead of only this one.
        if device is None:
            device = default_device(tensors)
        self.rank = rank
        self.layout = layout
        self.engine_stats: list[EngineStats] = []
        """Every engine worker's account of the last ``push(engines=...)``."""
        self.engine_replies: list[Any] = []
        """Every engine worker's reply to it, as the engines returned them."""
        self.last_stats: RefitStats | None = None
        """This rank's account of its last successful push."""
        self._engines_ready: set[int] = set()
        self.session = RefitSession(
            config,
            rank=rank,
            layout=layout,
            tensors=tensors,
            device=device,
            budget_bytes=budget_bytes,
            round_bytes=round_bytes,
            progress=progress,
        )

    def connect(self) -> None:
        """Join the refit group now (``push`` does it on first use)."""
        self.session.connect()

    def set_layout(self, layout: Layout, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Hold ``tensors`` laid out as ``layout`` from the next push on (a
        sender built from a module does this itself at every push). Returns
        whether the layout changed; then every rank of the next refit reads
        it again and plans anew (or reuses the plan cached for these layouts)."""
        changed = self.session.set_layout(layout, tensors)
        if changed:
            self.layout = layout
            log.info("reshard sender rank %d: its layout changed; the next refit replans", self.rank)
        return changed

    def cancel(self, reason: str | None) -> None:
        """Make this rank's refit in progress (or its next one) fail at once,
        and abort it for every joined rank; ``None`` clears it. Call it from
        another thread, e.g. when the engines this rank drives failed before
        they joined the refit."""
        self.session.cancel(reason)

    def push(
        self,
        refit: int,
        *,
        method: str = "reshard",
        after_round: Callable[[int], None] | None = None,
        engines: Engines | None = None,
    ) -> RefitStats:
        """Send refit number ``refit`` (collective with every refit rank).

        ``method``: ``reshard``, or ``gather_broadcast`` (the baseline; every
        rank must pick the same). ``after_round(i)`` runs after each round.
        ``engines`` (on one trainer rank, usually rank 0): the engines to
        drive, e.g. ``VllmEngines(["http://host:8000"])``; they are set up
        on first use and told to pull this refit while this rank pushes, so
        this one call does the whole update. The engines' per-worker stats
        are in ``self.engine_stats`` afterwards (typed :class:`EngineStats`;
        the raw replies in ``self.engine_replies``). With
        ``GroupConfig.min_replicas``, engine servers found down (the
        engines' ``unreachable``: replica -> why) are named in the stats'
        ``missing_replicas``."""
        if method not in ("reshard", "gather_broadcast"):
            raise ValueError(f"unknown refit method {method!r}; use 'reshard' or 'gather_broadcast'")
        if self._describe is not None:
            # Local shards are re-read each time: a trainer may have replaced
            # them, or resharded them (then every rank replans).
            pieces, grids, tensors = self._describe()
            self.set_layout(build_layout(self.rank, pieces, grids), tensors)
        if engines is None:
            return self._done(self._push(refit, method, after_round), method)
        if id(engines) not in self._engines_ready:
            engines.init(self.session.config)
            self._engines_ready.add(id(engines))
        self.engine_stats = []
        self.engine_replies = []
        stats, replies = push_beside(
            lambda: self._push(refit, method, after_round),
            lambda _pushed: engines.refit(refit, method=method),
            cancel=self.cancel,
        )
        self.engine_replies = list(replies)
        self.engine_stats = [EngineStats.of(r) for r in self.engine_replies]
        # Elastic groups: servers the engines found down, by replica (their
        # URL and error), beside what the group saw of them.
        down: dict[int, str] = dict(getattr(engines, "unreachable", None) or {})
        if down:
            seen = stats.missing_replicas
            stats.missing_replicas = {
                **seen,
                **{i: f"{why}; {seen[i]}" if i in seen else why for i, why in down.items()},
            }
        return self._done(stats, method)

    def _done(self, stats: RefitStats, method: str) -> RefitStats:
        self.last_stats = stats
        if log.isEnabledFor(logging.INFO):
            line = f"{stats.summary()} [{method}]"
            paused = [w.paused_seconds for w in self.engine_stats if w.paused_seconds is not None]
            if paused and len(paused) == len(self.engine_stats):
                line += f"; engines paused generation for up to {max(paused):.3f} s"
            log.info(line)
        return stats

    def _push(self, refit: int, method: str, after_round: Callable[[int], None] | None) -> RefitStats:
        if method == "gather_broadcast":
            return self.session.refit_baseline(refit)
        tensors = self.session.tensors
        return self.session.refit(refit, into=_AfterRound(tensors, after_round) if after_round else None)

    @property
    def delta_snapshot_bytes(self) -> int:
        """With ``GroupConfig.delta``: the bytes of this rank's snapshot (what
        it sent last, kept to encode the next refit's changes)."""
        snaps = self.session.delta.snapshots
        return snaps.nbytes if snaps is not None else 0

    def close(self) -> None:
        self.session.close()


def default_device(tensors: Mapping[str, torch.Tensor] | LocalTensors) -> torch.device | str:
    """The device a trainer rank refits from: its tensors' (a mapping that
    computes its tensors says where they live); for tensors in host memory
    on a rank whose default process group is NCCL (parameters offloaded by
    FSDP2's ``CPUOffloadPolicy``, FSDP1's ``CPUOffload``, DeepSpeed's
    offload), its current CUDA device: the engines it feeds are on GPUs, and
    a gloo rank in an NCCL group is refused at join. Its host tensors are
    staged through the device (:func:`reshard.transport.posting.off_device_locals`)."""
    device = local_tensors(tensors).device or "cpu"
    if str(device).split(":")[0] != "cpu":
        return device
    try:
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
            return torch.device("cuda", torch.cuda.current_device())
    except (ImportError, RuntimeError, ValueError):
        pass
    return device


def default_rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover
        pass
    return 0


class _AfterRound(LocalTensors):
    """A sender's tensors, and ``after_round(i)`` once each of its rounds completed."""

    def __init__(self, tensors: LocalTensors, after_round: Callable[[int], None]) -> None:
        self.tensors = tensors
        self.after_round = after_round
        self.lazy, self.private = tensors.lazy, tensors.private

    @property
    def device(self) -> torch.device | None:
        return self.tensors.device

    def begin(self, plan) -> None:
        self.tensors.begin(plan)

    def resolve(self, name: str) -> torch.Tensor:
        return self.tensors.resolve(name)

    def landed(self, index: int, changed: frozenset[str] | None) -> None:
        self.tensors.landed(index, changed)
        self.after_round(index)

    def finish(self) -> None:
        self.tensors.finish()

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)
