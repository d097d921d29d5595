"""Drop-ins for the RL frameworks users run: TRL, verl, OpenRLHF.

Each framework hard-codes a weight sync that gathers full tensors; each
module here replaces that sync with a reshard refit through the framework's
own hook, so the trainer never gathers and every engine worker receives only
what it keeps:

- :mod:`reshard.integrations.trl`: ``ReshardGRPOTrainer`` (and
  :func:`~reshard.integrations.trl.with_reshard` for TRL's other trainers
  that generate with vLLM), server and colocate modes.
- :mod:`reshard.integrations.verl`: a checkpoint-engine backend registered
  with verl's own registry that keeps slices sliced.
- :mod:`reshard.integrations.openrlhf`: ``broadcast_to_vllm`` replaced by a
  reshard refit.

This layer sits between the adapters and the tools. The frameworks (and
vLLM) are imported lazily, inside functions, so ``import
reshard.integrations`` works without any of them; each module checks the
framework version it was written against and names it when another is
installed, and builds its subclasses of the framework's classes on first
use, both through :mod:`reshard.integrations.framework`. See
``docs/integrations.md``.
"""

__all__: list[str] = []
