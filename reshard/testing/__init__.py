"""Helpers for tests, examples and the demo: tiny models built locally (no
model hub), with weights that make a refit visible in the tokens."""

from reshard.testing.tiny import NONDETERMINISTIC, TINY, build_tiny_model, perturb, tiny_config

__all__ = ["NONDETERMINISTIC", "TINY", "build_tiny_model", "perturb", "tiny_config"]
