"""Planning: pure Python over layouts (no process group, no engine, no torch)."""

from reshard.plan.box import Box, chunk_range, merge_boxes
from reshard.plan.cluster import Cluster, Placement, place
from reshard.plan.layout import Grid, Layout, LocalTensor, Mesh, Piece, Slot, TensorMeta
from reshard.plan.planner import LayoutSet, Planner, RankPlan, Round, Traffic, Transfer

__all__ = [
    "Box",
    "Cluster",
    "Grid",
    "Layout",
    "LayoutSet",
    "LocalTensor",
    "Mesh",
    "Piece",
    "Placement",
    "Planner",
    "RankPlan",
    "Round",
    "Slot",
    "TensorMeta",
    "Traffic",
    "Transfer",
    "chunk_range",
    "merge_boxes",
    "place",
]
