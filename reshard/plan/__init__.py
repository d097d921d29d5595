"""Planning: pure Python over layouts (no process group, no engine, no torch).

- :mod:`~reshard.plan.box`: boxes and the splitting rules (the overlap math);
- :mod:`~reshard.plan.layout`: the wire types of a rank's layout;
- :mod:`~reshard.plan.specs`: building a layout from pieces and grid rules;
- :mod:`~reshard.plan.checks`: local tensors checked against a layout;
- :mod:`~reshard.plan.index`: one side's layouts indexed by tensor;
- :mod:`~reshard.plan.items`: transfers, rounds, a rank's plan;
- :mod:`~reshard.plan.rounds`: the round table every rank shares;
- :mod:`~reshard.plan.traffic`: bytes per rank pair of a whole plan;
- :mod:`~reshard.plan.planner`: the planner.
"""

from reshard.plan.box import Box, chunk_range, merge_boxes
from reshard.plan.index import LayoutSet
from reshard.plan.items import RankPlan, Round, Transfer, TransferKind
from reshard.plan.layout import Grid, Layout, LocalTensor, Mesh, Piece, Slot, TensorMeta
from reshard.plan.planner import Planner
from reshard.plan.specs import GridSpec, PieceSpec, build_layout
from reshard.plan.traffic import Traffic

__all__ = [
    "Box",
    "Grid",
    "GridSpec",
    "Layout",
    "LayoutSet",
    "LocalTensor",
    "Mesh",
    "Piece",
    "PieceSpec",
    "Planner",
    "RankPlan",
    "Round",
    "Slot",
    "TensorMeta",
    "Traffic",
    "Transfer",
    "TransferKind",
    "build_layout",
    "chunk_range",
    "merge_boxes",
]
