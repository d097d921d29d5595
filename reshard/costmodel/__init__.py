"""Cost estimation for ``reshard plan``: how trainers and engines shard a
model (rules), clusters and where ranks run on them, the cost of a plan and
of gather-and-broadcast, and the report. Builds on the pure planner; nothing
at run time depends on it.
"""

from reshard.costmodel.cluster import Cluster, Deployment, place

__all__ = ["Cluster", "Deployment", "place"]
