"""Helpers for the OpenRLHF test.

The fake, where OpenRLHF needs a GPU: :func:`flash_attn_stub` writes a
``flash_attn`` package whose functions raise. OpenRLHF imports flash-attn
(CUDA only) at module level in ``openrlhf.models.ring_attn_utils``, which
its trainer modules (``ActorPPOTrainer`` and the CLI) import; nothing the
test runs calls it (ring attention and padding-free packing are off).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["flash_attn_stub"]

_RAISES = 'def _gpu(*args, **kwargs):\n    raise RuntimeError("flash-attn stub: CUDA only")\n\n\n'


def flash_attn_stub(directory: Path) -> Path:
    """A folder to put on ``sys.path`` that holds the stub package."""
    pkg = directory / "flash_attn"
    (pkg / "utils").mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "utils" / "__init__.py").write_text("")
    (pkg / "bert_padding.py").write_text(_RAISES + "index_first_axis = pad_input = rearrange = unpad_input = _gpu\n")
    (pkg / "utils" / "distributed.py").write_text(_RAISES + "all_gather = _gpu\n")
    return directory


def fresh_greedy_bf16(rank: int, paths: list[str]) -> list[list[list[int]]]:
    """Greedy tokens of a fresh bfloat16 TP=1 engine (OpenRLHF's engines are
    bfloat16) on each of ``paths``, one after the other."""
    from tests.vllm_support import greedy, make_llm, shutdown

    out = []
    for path in paths:
        llm = make_llm(path, 1, extension="reshard.adapters.vllm.ReshardWorkerExtension", dtype="bfloat16")
        try:
            out.append(greedy(llm))
        finally:
            shutdown(llm)
    return out
