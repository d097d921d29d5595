#!/usr/bin/env bash
# One-GPU check of the transport's GPU path (benchmarks/gpu_check.py, cases in
# benchmarks/gpu_cases.py): each case in a process of its own under a timeout,
# one PASS/FAIL line per case in <out>/gpu_check.txt. Needs a Python with a
# CUDA build of torch; uses .venv if present, else python3.
#
#   bash benchmarks/gpu_check.sh --fetch     # on a machine with PyPI: the wheels reshard needs
#                                            # beside torch and numpy (msgspec, xxhash), for the
#                                            # GPU machine's Python ($GPU_PYTHON_VERSION, default
#                                            # 3.12), into ./wheels (ignored by git)
#   bash benchmarks/gpu_check.sh [--out DIR] # on the GPU, offline: installs ./wheels into a scratch
#                                            # directory when msgspec is missing, runs every case
#   bash benchmarks/gpu_check.sh --dry-run   # on a CPU: the cases a CPU allows
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="${RESHARD_WHEELS:-wheels}"
if [ "${1:-}" = "--fetch" ]; then
    PY=python3
    [ -x .venv/bin/python ] && PY=.venv/bin/python
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$WHEELS" \
        --python-version "${GPU_PYTHON_VERSION:-3.12}" --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 "msgspec==0.23.0" "xxhash==4.1.0"
    ls -l "$WHEELS"
    exit 0
fi
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import msgspec" 2>/dev/null; then
    SITE="${TMPDIR:-/tmp}/reshard-gpu-check-site"
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        "$PY" -m pip install --quiet --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
    else
        "$PY" -m pip install --quiet --target "$SITE" "msgspec>=0.18" "xxhash>=3.0"
    fi
    export PYTHONPATH="$PYTHONPATH:$SITE"
fi
exec "$PY" benchmarks/gpu_check.py "$@"
