"""What the engine adapters share: the typed group spec workers receive
(:mod:`~reshard.adapters.core.spec`), the typed replies they give
(:mod:`~reshard.adapters.core.replies`), layouts learned by recording the
engines' own loaders (:mod:`~reshard.adapters.core.recording`), and several
engines driven as one (:mod:`~reshard.adapters.core.fanout`). Nothing here
imports an engine."""

from reshard.adapters.core.fanout import fan_out
from reshard.adapters.core.recording import LearnedLayout, record_loads
from reshard.adapters.core.replies import WorkerReply, failure, raise_for_replies
from reshard.adapters.core.spec import GroupSpec

__all__ = ["GroupSpec", "LearnedLayout", "WorkerReply", "failure", "fan_out", "raise_for_replies", "record_loads"]
