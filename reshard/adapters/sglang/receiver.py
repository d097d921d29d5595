"""The receiver inside one SGLang TP worker: learned layout, live parameters.

SGLang keeps its parameters in the checkpoint-loading layout of each rank
(fused ``qkv_proj`` / ``gate_up_proj`` rows, the padded vocabulary shard)
and, unquantized, computes straight from them, so bytes land directly in
the live parameters; nothing is staged. One refit (``SglangReceiver.pull``),
inside SGLang's ``begin_weight_update`` / ``end_weight_update`` session:

1. every rank agrees on the plan (problems raise on every rank; the model
   is untouched);
2. the regions SGLang's loaders clear (vocabulary padding) are zeroed;
3. the rounds write every kept byte into its parameter;
4. checkpoint tensors SGLang's loader transforms (Gemma adds 1 to its norm
   weights, in place, before copying them) are received into buffers of
   their own and handed to the model's ``load_weights``, so they land exactly
   as SGLang's own load writes them (see
   :mod:`reshard.adapters.core.recording`);
5. what SGLang derives from parameters is refreshed as its own direct
   loaders do (:func:`refresh_derived`: parameter aliases and derived
   buffers, then ``post_load_weights``, which recomputes MLA's absorbed
   projections); ``end_weight_update`` then runs SGLang's own
   post-processing (quantized layers).

Parameters are found by name at every refit: SGLang's post-processing may
replace a parameter object.

A failure after step 2 leaves the parameters mixing old and new values:
:attr:`SglangReceiver.mixed` says so, and the driver keeps the engine paused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from reshard.adapters.core.recording import LOADER_PREFIX, LearnedLayout
from reshard.adapters.sglang.layout import canonical_tensors_of, learn_layout
from reshard.errors import ReshardError
from reshard.plan.items import RankPlan
from reshard.plan.layout import TensorMeta, dtype_size
from reshard.plan.specs import build_layout
from reshard.receiver import EngineReceiver, Receiver
from reshard.transport.group import GroupConfig
from reshard.transport.locals import LocalTensors
from reshard.transport.session import DEFAULT_BUDGET_BYTES
from reshard.transport.stats import EngineStats

if TYPE_CHECKING:
    import torch

__all__ = ["SglangReceiver", "learn_checked", "refresh_derived"]


def learn_checked(model: torch.nn.Module, tensors: list[TensorMeta] | None = None, *, rank: int = -1) -> LearnedLayout:
    """:func:`learn_layout`, raising :class:`ReshardError` when the layout is
    incomplete (a refit would leave stale weights)."""
    metas = tensors if tensors is not None else canonical_tensors_of(model)
    learned = learn_layout(model, metas)
    problems = learned.problems()
    if not learned.pieces:
        problems.append("SGLang's load_weights wrote no checkpoint tensor into any parameter")
    if problems:
        raise ReshardError(
            f"engine rank {rank}: the layout learned from SGLang's loaders is incomplete, so refits would "
            "leave stale weights:\n  " + "\n  ".join(problems[:20])
        )
    return learned


def refresh_derived(model: torch.nn.Module) -> None:
    """What SGLang derives from parameters written in place, refreshed as its
    own loaders that write parameters directly do: aliases and derived
    buffers (``PreshardedModelLoader._rebind_parameter_aliases``: Gemma's
    ``gemma_weight``, linear-attention aliases), then the model's
    ``post_load_weights`` (DeepSeek's absorbed MLA matrices). SGLang's
    ``end_weight_update`` runs ``process_weights_after_loading`` on every
    module afterwards; it skips ``post_load_weights`` after a tensor update,
    so the receiver must call it."""
    try:
        from sglang.srt.model_loader.loader import PreshardedModelLoader
    except ImportError:  # an SGLang without it
        pass
    else:
        rebind = getattr(PreshardedModelLoader, "_rebind_parameter_aliases", None)
        if rebind is not None:
            rebind(model)
    post = getattr(model, "post_load_weights", None)
    if callable(post):
        post()


class SglangReceiver(EngineReceiver):
    """Pulls refits into one SGLang worker's live parameters (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        config: GroupConfig,
        rank: int,
        learned: LearnedLayout | None = None,
        tensors: list[TensorMeta] | None = None,
        device: torch.device | str | None = None,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> None:
        """``rank``: this worker's refit rank. ``learned``: a layout learned
        before (it depends on the model and the TP rank only)."""
        t0 = time.perf_counter()
        self.learned = learned if learned is not None else learn_checked(model, tensors, rank=rank)
        self.learn_seconds = time.perf_counter() - t0
        self.model = model
        self.rank = rank
        import torch

        self.params = self._live()
        if device is None:
            device = next(iter(self.params.values())).device
        # Loader tensors land in buffers of their own (zero outside the region
        # their loader reads), and SGLang's own loader runs on them.
        self.loader_buffers = {
            v.local: torch.zeros(v.tensor.shape, dtype=getattr(torch, v.tensor.dtype), device=device)
            for v in self.learned.via_loader.values()
            if not v.region.is_empty()
        }
        self.layout = build_layout(rank, self.learned.pieces)
        self.receiver = Receiver(
            {**self.params, **self.loader_buffers},
            config=config,
            rank=rank,
            layout=self.layout,
            device=device,
            budget_bytes=budget_bytes,
        )
        self.mixed = False
        self.last_stats = EngineStats()
        """This worker's account of its last refit."""

    def _live(self) -> dict[str, torch.Tensor]:
        """Every parameter a piece writes, found by name now: SGLang's
        post-processing may replace a parameter object (repacked, or rebound
        to another dtype), so none is kept from one refit to the next."""
        named: dict[str, torch.Tensor] = dict(self.model.named_parameters(remove_duplicate=False))
        named.update(self.model.named_buffers(remove_duplicate=False))
        return {n: named[n].data for n in self.learned.local_shapes if not n.startswith(LOADER_PREFIX)}

    @property
    def kept_bytes(self) -> int:
        return sum(p.box.numel * dtype_size(p.tensor.dtype) for p in self.learned.pieces)

    def pull(self, refit: int, *, method: str = "reshard") -> EngineStats:
        """Receive refit ``refit`` (collective with every refit rank)."""
        import torch

        self.mixed = False
        t0 = time.perf_counter()
        self.params = self._live()
        stats = self.receiver.pull(refit, method=method, into=_LiveParams(self))
        t1 = time.perf_counter()
        # With deltas only the loader tensors that changed go through the
        # loader again (a copy: SGLang's loaders may change what they read
        # in place, and the buffer is the base the next delta patches).
        touched = stats.touched
        vias = self.learned.via_loader.values()
        loaded = [
            (v.tensor.name, self.loader_buffers[v.local] if touched is None else self.loader_buffers[v.local].clone())
            for v in vias
            if v.local in self.loader_buffers and (touched is None or v.local in touched)
        ]
        try:
            with torch.no_grad():
                if loaded:
                    self.model.load_weights(loaded)  # type: ignore[operator]
                refresh_derived(self.model)
        except BaseException as e:
            self.receiver.forget_base(f"SGLang's loaders failed after refit {refit} ({type(e).__name__})")
            raise
        self.mixed = False
        self.last_stats = EngineStats.of_refit(
            stats,
            post_load_seconds=time.perf_counter() - t1,
            apply_seconds=time.perf_counter() - t1,
            refit_seconds=time.perf_counter() - t0,
            kept_bytes=self.kept_bytes,
            learn_seconds=self.learn_seconds,
            pieces=len(self.learned.pieces),
            loader_tensors=len(loaded),
            delta=self.receiver.config.delta,
        )
        return self.last_stats

    def close(self) -> None:
        self.receiver.close()


class _LiveParams(LocalTensors):
    """A refit's destination in an SGLang worker: its live parameters (found
    anew at every pull) and the loader tensors' buffers. Once every rank
    agreed to go ahead (``begin``), the regions no piece writes are zeroed
    (vocabulary padding, as SGLang's loader leaves it), and the worker counts
    as mixed until the pull and its loaders are done."""

    def __init__(self, owner: SglangReceiver) -> None:
        self.owner = owner
        self.tensors = {**owner.params, **owner.loader_buffers}

    def begin(self, plan: RankPlan | None) -> None:
        import torch

        owner = self.owner
        owner.mixed = True
        with torch.no_grad():
            for name, boxes in owner.learned.zero_fill.items():
                t = owner.params[name]
                for b in boxes:
                    t[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes, strict=True))].zero_()

    def resolve(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)
