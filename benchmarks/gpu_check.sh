#!/usr/bin/env bash
# One-GPU check of the transport (see benchmarks/gpu_check.py). Needs a Python
# with a CUDA build of torch; uses .venv if present, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" benchmarks/gpu_check.py "$@"
