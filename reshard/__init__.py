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

__version__ = "0.1.0"

__all__ = [
    "Box",
    "Grid",
    "Layout",
    "LayoutSet",
    "LocalTensor",
    "Mesh",
    "Piece",
    "PlanError",
    "Planner",
    "Problem",
    "RankPlan",
    "RefitError",
    "ReshardError",
    "TensorMeta",
    "Transfer",
    "__version__",
]
