"""verl's ``custom_backend_module`` for reshard: importing it registers the
``reshard`` checkpoint-engine backend in verl's ``CheckpointEngineRegistry``
(verl imports it in every worker before it builds a backend)::

    actor_rollout_ref.rollout.checkpoint_engine.backend=reshard
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=reshard.integrations.verl_backend

See :mod:`reshard.integrations.verl`.
"""

from __future__ import annotations

from reshard.integrations.verl import register

__all__: list[str] = []

register()
