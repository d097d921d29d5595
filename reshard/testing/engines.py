"""Small offline vLLM engines on a CPU, as the tests, the examples and the
demo start them, and greedy tokens to compare engines by."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["MAX_TOKENS", "PROMPTS", "engine_env", "greedy", "offline_llm", "shutdown"]

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13, 4, 200, 31]]
MAX_TOKENS = 12


def engine_env(tp: int) -> None:
    """Environment for an offline engine of ``tp`` workers started from this
    process (read when the engine starts, so one process can host engines of
    several sizes in turn). The engine core runs in this process (10 s less
    per start than a process of its own); TP>1 workers are processes of their
    own, each bound to one core."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if tp == 1:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))


def offline_llm(
    path: str,
    tp: int,
    *,
    extension: str | None = "reshard.adapters.vllm.ReshardWorkerExtension",
    dtype: str = "float32",
    max_model_len: int = 128,
    core_process: bool = False,
    **kwargs: Any,
):
    """An offline ``LLM`` on ``path``: eager, a small KV cache, deterministic.
    ``core_process``: the engine core runs in a process of its own and steps
    on its own, as a server's does (a thread of this process streams its
    outputs while another calls into it: benchmarks measure its stalls)."""
    engine_env(tp)
    if core_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    from vllm import LLM

    return LLM(
        model=str(path),
        dtype=dtype,  # type: ignore[arg-type]
        enforce_eager=True,
        max_model_len=max_model_len,
        block_size=32,
        max_num_seqs=4,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        worker_extension_cls=extension or "",
        seed=0,
        **kwargs,
    )


def greedy(
    llm, prompts: list[list[int]] = PROMPTS, max_tokens: int = MAX_TOKENS, *, lora_request: Any = None
) -> list[list[int]]:
    """Greedy tokens of ``llm`` for ``prompts`` (with a LoRA adapter: ``lora_request``)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, lora_request=lora_request)
    return [list(o.outputs[0].token_ids) for o in outs]


def shutdown(llm) -> None:
    """Stop the engine now. A spawned process exits without running atexit
    handlers, so an engine still referenced would outlive it and hold its
    memory."""
    llm.llm_engine.engine_core.shutdown()
