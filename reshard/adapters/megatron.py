"""Megatron-Core trainers as senders: :func:`megatron_sender`.

The reader itself (Megatron's cuts, fused QKV and gated MLP, read from its
own parallel state) is a trainer reader, :mod:`reshard.sender.megatron`;
its public names are re-exported here, so code written against this module
keeps working. This adds the one call a Megatron trainer makes, a
:class:`reshard.Sender` over a :class:`MegatronSource`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reshard.sender import Sender
from reshard.sender.megatron import MegatronRanks, MegatronSource, checkpoint_recipe, megatron_pieces

if TYPE_CHECKING:
    from reshard.transport.group import GroupConfig

__all__ = ["MegatronRanks", "MegatronSource", "checkpoint_recipe", "megatron_pieces", "megatron_sender"]


def megatron_sender(
    model: Any,
    *,
    config: GroupConfig,
    hf_config: Any,
    rank: int | None = None,
    ranks: MegatronRanks | None = None,
    **kwargs: Any,
) -> Sender:
    """A :class:`reshard.Sender` for this rank's Megatron model chunk(s):
    ``Sender(MegatronSource(...), config=config, rank=rank, **kwargs)``.

    ``rank``: this rank's refit rank (default: its rank in the default
    process group, Megatron's global rank). Other keywords go to
    :class:`reshard.Sender` (``device``, ``budget_bytes``, ...). Every
    data-parallel replica publishes its slices; the planner picks which
    replica sends each byte. Call order: :mod:`reshard.sender.megatron`.
    """
    return Sender(MegatronSource(model=model, hf_config=hf_config, ranks=ranks), config=config, rank=rank, **kwargs)
