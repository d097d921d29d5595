"""Runs inside the SGLang venv: ``python -m tests.sglang_serve <launch_server args>``.

The same as ``python -m sglang.launch_server``, plus, when
``RESHARD_SGLANG_CPU_TP=1``, the test-harness patch that lets SGLang 0.5.23
run TP > 1 on CPU: its model-parallel groups are built without PyNccl
(``PyNcclCommunicator`` needs a CUDA device). SGLang starts its scheduler
processes with ``spawn``, which re-imports this ``__main__`` module in every
child as ``__mp_main__``, so the patch below reaches every TP worker. This
is a test harness only; real TP > 1 deployments run on GPUs.
"""

from __future__ import annotations

import os
import sys


def _cpu_tp_patch() -> None:
    import sglang.srt.distributed.parallel_state as ps

    orig = ps.init_model_parallel_group
    if getattr(orig, "_reshard_cpu_tp", False):
        return

    def init_model_parallel_group(*args, **kwargs):
        kwargs["use_pynccl"] = False
        return orig(*args, **kwargs)

    init_model_parallel_group._reshard_cpu_tp = True  # type: ignore[attr-defined]
    ps.init_model_parallel_group = init_model_parallel_group


if os.environ.get("RESHARD_SGLANG_CPU_TP") == "1":
    _cpu_tp_patch()


def main(argv: list[str]) -> None:
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
