#!/usr/bin/env bash
# One-GPU check of the transport (see benchmarks/gpu_check.py): plans' pack
# and unpack against a device copy, the NCCL calls, and a colocated refit by
# CUDA IPC (four processes on the GPU). Needs a Python with a CUDA build of
# torch; uses .venv if present, else python3. reshard's own dependencies
# (msgspec, numpy) are installed into a scratch directory when missing: from
# wheels in $RESHARD_WHEELS (default ./wheels, for machines without PyPI),
# else from PyPI. `--cpu-colocated` runs the colocated case over shared
# memory instead, to check the script on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import msgspec, numpy" 2>/dev/null; then
    SITE="${TMPDIR:-/tmp}/reshard-gpu-check-site"
    WHEELS="${RESHARD_WHEELS:-wheels}"
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        "$PY" -m pip install --quiet --no-index --target "$SITE" "$WHEELS"/*.whl
    else
        "$PY" -m pip install --quiet --target "$SITE" "msgspec>=0.18" "numpy>=1.26"
    fi
    export PYTHONPATH="$PYTHONPATH:$SITE"
fi
exec "$PY" benchmarks/gpu_check.py "$@"
