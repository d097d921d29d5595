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
4. ``post_load_weights()`` runs if the model has one, as SGLang does for
   loaders that bypass ``model.load_weights`` (derived weights, such as
   MLA's absorbed projections, are recomputed); ``end_weight_update`` then
   runs SGLang's own post-processing (quantized layers).

A failure after step 2 leaves the parameters mixing old and new values:
:attr:`SglangReceiver.mixed` says so, and the driver keeps the engine paused.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from reshard.adapters.core.recording import LearnedLayout
from reshard.adapters.sglang.layout import canonical_tensors_of, learn_layout
from reshard.errors import ReshardError
from reshard.plan.items import RankPlan
from reshard.plan.layout import TensorMeta, dtype_size
from reshard.plan.specs import build_layout
from reshard.receiver import Receiver
from reshard.transport.group import GroupConfig
from reshard.transport.session import DEFAULT_BUDGET_BYTES

if TYPE_CHECKING:
    import torch

__all__ = ["SglangReceiver", "learn_checked"]


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


class SglangReceiver:
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
        named: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        named.update(model.named_buffers(remove_duplicate=False))
        self.params: dict[str, torch.Tensor] = {n: named[n].data for n in self.learned.local_shapes}
        if device is None:
            device = next(iter(self.params.values())).device
        self.layout = build_layout(rank, self.learned.pieces)
        self.receiver = Receiver(
            self.params,
            config=config,
            rank=rank,
            layout=self.layout,
            device=device,
            budget_bytes=budget_bytes,
        )
        self.mixed = False
        self.last_stats: dict[str, Any] = {}

    @property
    def kept_bytes(self) -> int:
        return sum(p.box.numel * dtype_size(p.tensor.dtype) for p in self.learned.pieces)

    def _zero_padding(self, plan: RankPlan | None = None) -> None:
        import torch

        self.mixed = True
        with torch.no_grad():
            for name, boxes in self.learned.zero_fill.items():
                t = self.params[name]
                for b in boxes:
                    t[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes, strict=True))].zero_()

    def pull(self, refit: int, *, method: str = "reshard") -> dict[str, Any]:
        """Receive refit ``refit`` (collective with every refit rank)."""
        self.mixed = False
        t0 = time.perf_counter()
        if method != "reshard":
            # The baseline writes from its first broadcast on.
            self._zero_padding()
        stats = self.receiver.pull(refit, method=method, before_transfer=self._zero_padding)
        t1 = time.perf_counter()
        post = getattr(self.model, "post_load_weights", None)
        if callable(post):
            post()
        self.mixed = False
        self.last_stats = {
            **stats.as_dict(),
            "post_load_seconds": time.perf_counter() - t1,
            "refit_seconds": time.perf_counter() - t0,
            "kept_bytes": self.kept_bytes,
            "learn_seconds": self.learn_seconds,
            "pieces": len(self.learned.pieces),
        }
        return self.last_stats

    def close(self) -> None:
        self.receiver.close()
