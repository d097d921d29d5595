#!/usr/bin/env bash
# Build the SGLang 0.5.23 venv the SGLang tests run their servers in (CPU only).
#
#   scripts/sglang_setup.sh [VENV]    (default: .venv-sglang next to this repo's .venv)
#
# SGLang pins torch 2.14.1, the main venv has torch 2.13: they are separate
# venvs whose processes meet over gloo. Every version is pinned (a pip freeze
# of the verified venv); sglang itself is installed with --no-deps plus the
# subset of its requirements needed to import it and serve on CPU (no
# sgl-kernel, flashinfer, flash-attn, deep-gemm, cutlass, tilelang ...).
# About 2 minutes and 6.1 GB (nvidia-* 3.2 GB: the torch 2.14.1 wheel here is
# the CUDA 13 build, which does not import without them).
#
# Idempotent: a complete venv (stamp file matching this script) is left alone;
# an incomplete one is rebuilt. reshard is installed editable (--no-deps), so
# SGLang's scheduler processes import the hook from this checkout.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-$REPO/.venv-sglang}
# Absolute: the smoke test below runs from another directory.
mkdir -p "$(dirname "$VENV")"
VENV="$(cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")"
PY=${PYTHON:-python3}
STAMP="$VENV/.reshard-sglang-setup"
WANT=$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "SGLang venv $VENV is up to date"
  exit 0
fi
rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check --no-input --quiet"
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT

# Exact versions of everything besides sglang.
cat > "$TMP/constraints.txt" <<'LOCK'
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiosignal==1.4.0
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
apache-tvm-ffi==0.1.11
asttokens==3.0.2
attrs==26.1.0
certifi==2026.10.19.post1
cffi==2.1.1
charset-normalizer==3.5.3
click==8.5.1
compressed-tensors==0.18.0
cuda-bindings==13.5.0
cuda-pathfinder==1.9.1
cuda-toolkit==13.0.3.0
dill==0.4.1
distro==1.9.0
einops==0.8.2
executing==2.3.0
fastapi==0.165.0
filelock==4.3.1
frozenlist==1.8.0
fsspec==2026.9.0
gguf==0.19.0
h11==0.16.0
hf-xet==1.8.0
hypothesis==6.170.17
httpcore==1.0.9
httpx==0.29.0
huggingface_hub==1.33.0
idna==3.20
iniconfig==2.3.1
interegular==0.3.3
ipython==9.18.1
ipython_pygments_lexers==1.1.1
jedi==0.20.1
Jinja2==3.1.6
jiter==0.19.0
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
loguru==0.7.3
markdown-it-py==4.3.0
MarkupSafe==3.0.4
matplotlib-inline==0.2.2
mdurl==0.1.2
mpmath==1.3.0
msgspec==0.23.0
multidict==7.2.1
networkx==3.6.1
numpy==2.4.6
nvidia-cublas==13.1.1.3
nvidia-cuda-cupti==13.0.85
nvidia-cuda-nvrtc==13.0.88
nvidia-cuda-runtime==13.0.96
nvidia-cudnn-cu13==9.24.0.43
nvidia-cufft==12.0.0.61
nvidia-cufile==1.15.1.6
nvidia-curand==10.4.0.35
nvidia-cusolver==12.0.4.66
nvidia-cusparse==12.6.3.3
nvidia-cusparselt-cu13==0.8.1
nvidia-nccl-cu13==2.30.7
nvidia-nvjitlink==13.5.37
nvidia-nvshmem-cu13==3.4.5
nvidia-nvtx==13.0.85
openai==2.8.0
opentelemetry-api==1.45.2
orjson==3.13.0
packaging==26.4
parso==0.8.7
partial-json-parser==0.2.1.1.post7
pexpect==4.9.0
pillow==13.0.0
pluggy==1.7.0
prometheus_client==0.26.0
prompt_toolkit==3.0.53
propcache==0.5.4
psutil==7.2.2
ptyprocess==0.7.0
pure_eval==0.2.4
pybase64==1.5.1
pycparser==3.12
pydantic==2.14.4
pydantic_core==2.50.5
Pygments==2.21.0
pytest==9.2.0
python-dateutil==2.9.0.post0
python-multipart==0.0.34
PyYAML==6.0.4
pyzmq==27.3.0
referencing==0.37.0
regex==2026.11.19
requests==2.34.2
rich==15.0.0
rpds-py==2026.9.1
safetensors==0.8.0
sentencepiece==0.2.1
setproctitle==1.3.8
shellingham==1.5.4
six==1.17.0
sortedcontainers==2.4.0
sniffio==1.3.1
soundfile==0.13.1
stack-data==0.6.3
starlette==1.10.0
sympy==1.14.0
tokenizers==0.23.2
torch==2.14.1
torchvision==0.29.1
tqdm==4.70.1
traitlets==5.16.1
transformers==5.19.0
triton==3.8.0
typer==0.29.2
typing-inspection==0.4.5
typing_extensions==4.16.0
urllib3==2.8.0
uvicorn==0.55.0
uvloop==0.23.0
wcwidth==0.9.4
xgrammar==0.2.7
xxhash==4.1.0
yarl==1.25.1
zstandard==0.25.0
LOCK

# 1. torch 2.14.1 (its nvidia-* / triton deps come along) and torchvision
$PIP install -c "$TMP/constraints.txt" torch==2.14.1 torchvision==0.29.1
# 2. sglang itself, without its CUDA-heavy declared requirements
$PIP install --no-deps sglang==0.5.23
# 3. what importing sglang.srt and serving on CPU needs
$PIP install -c "$TMP/constraints.txt" \
  aiohttp fastapi uvicorn uvloop orjson pyzmq psutil requests tqdm \
  transformers==5.19.0 tokenizers==0.23.2 pydantic numpy pybase64 msgspec setproctitle \
  prometheus-client python-multipart partial_json_parser interegular einops xxhash zstandard \
  packaging regex pillow python-dateutil distro ipython dill apache-tvm-ffi==0.1.11 \
  sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf openai==2.8.0 jsonschema \
  xgrammar==0.2.7 soundfile==0.13.1
# 3b. the test runner: make test runs reshard's planner, transport, sender
#     and shared-memory tests under this venv's torch 2.14.1 too
$PIP install -c "$TMP/constraints.txt" pytest==9.2.0 hypothesis==6.170.17
# 4. A stub for `from vllm._custom_ops import rotary_embedding`, which SGLang
#    imports (never calls) on a non-CUDA host unless SGLANG_USE_CPU_ENGINE=1
#    (sglang/srt/layers/rotary_embedding/base.py); that flag needs sgl-kernel.
SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$SP/vllm"
: > "$SP/vllm/__init__.py"
printf 'def rotary_embedding(*args, **kwargs):\n    raise NotImplementedError("vllm._custom_ops stub")\n' > "$SP/vllm/_custom_ops.py"
# 5. reshard from this checkout (its hook runs inside SGLang's workers)
$PIP install --no-deps -e "$REPO"
# 6. smoke test
(cd / && "$VENV/bin/python" -W ignore -c "
import sglang, torch, sglang.srt.entrypoints.http_server
import reshard.adapters.sglang.hook
print('sglang', sglang.__version__, 'torch', torch.__version__)")
echo "$WANT" > "$STAMP"
du -sh "$VENV"
