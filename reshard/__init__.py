"""reshard: move updated model weights from RL trainers straight into running
inference engines, each byte from a rank that holds it to the ranks that keep it.

The curated surface is re-exported here; engine adapters live in
``reshard.adapters`` and are imported on demand.
"""

from reshard.errors import PlanError, Problem, RefitError, ReshardError
from reshard.plan import (
    Box,
    Grid,
    Layout,
    LayoutSet,
    LocalTensor,
    Mesh,
    Piece,
    Planner,
    RankPlan,
    TensorMeta,
    Transfer,
)
from reshard.plan.specs import GridSpec, PieceSpec
from reshard.receiver import LocalTensors, Receiver, Tensors
from reshard.sender import Sender
from reshard.sender.engines import EngineStats
from reshard.transport.group import GroupConfig
from reshard.transport.session import RefitStats

__version__ = "0.1.0"

__all__ = [
    "Box",
    "EngineStats",
    "Grid",
    "GridSpec",
    "GroupConfig",
    "Layout",
    "LayoutSet",
    "LocalTensor",
    "LocalTensors",
    "Mesh",
    "Piece",
    "PieceSpec",
    "PlanError",
    "Planner",
    "Problem",
    "RankPlan",
    "Receiver",
    "RefitError",
    "RefitStats",
    "ReshardError",
    "Sender",
    "TensorMeta",
    "Tensors",
    "Transfer",
    "__version__",
]
