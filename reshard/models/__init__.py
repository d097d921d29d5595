"""Checkpoint naming and model presets.

- :mod:`reshard.models.names`: checkpoint names of transformers parameters
  (fused modeling tensors split back into checkpoint tensors);
- :mod:`reshard.models.canonical`: a model's canonical tensors from its config;
- :mod:`reshard.models.presets`: the configs ``reshard plan`` knows by name.
"""

from reshard.models.canonical import canonical_tensors
from reshard.models.names import CheckpointNames, CheckpointPiece
from reshard.models.presets import PRESETS, ModelSpec, load_model

__all__ = ["PRESETS", "CheckpointNames", "CheckpointPiece", "ModelSpec", "canonical_tensors", "load_model"]
