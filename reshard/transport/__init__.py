"""The transport: the refit group, plan execution over it, delta refits,
colocated links, the per-rank session and the gather-and-broadcast baseline.

Its modules are imported by name (``reshard.transport.group``,
``reshard.transport.session``, ...); this package re-exports nothing, so
importing one does not import torch.distributed through the others.
"""
