#!/usr/bin/env bash
# GPU check of the SGLang adapter: a TP=2 SGLang 0.5.23 server (GPUs 0-1)
# refitted by reshard from FSDP2 trainer ranks (GPUs 2-3) over NCCL, for a
# GQA model (qwen2, 2 KV heads) and a one-KV-head tied model (llama: KV heads
# replicated across TP ranks, a layout SGLang cannot build on CPU). Checks,
# per model: every parameter of both TP ranks equals SGLang's own
# load_weights of the same checkpoint (/weights_checker checksums after
# /update_weights_from_disk), greedy tokens equal, and each rank received
# exactly the bytes it keeps.
#
# Needs 4 CUDA GPUs and network access to PyPI (full sglang with its CUDA
# kernels). Not run on the CPU CI machine; see docs/sglang.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(nvidia-smi -L | wc -l)" -ge 4 ] || { echo "needs 4 GPUs" >&2; exit 2; }
VENV=${SGLANG_GPU_VENV:-.venv-sglang-gpu}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "sglang==0.5.23"
  "$VENV/bin/pip" install --quiet --no-deps -e .
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# A file, not stdin: the trainer ranks are spawned, and spawn re-imports __main__.
CHECK=$(mktemp --suffix .py); trap 'rm -f "$CHECK"' EXIT
cat > "$CHECK" <<'PY'
import json, os, signal, subprocess, sys, tempfile, time, urllib.request
import torch.multiprocessing as mp
from reshard import GroupConfig
from reshard.adapters.sglang import HOOK, SglangEngine
from reshard.testing.tiny import build_tiny_model
from tests.procs import StoreServer, free_port

def http(url, body=None):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())

def trainer(rank, path, address, pg_port):
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from reshard import Sender
    torch.cuda.set_device(2 + rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(pg_port))
    dist.init_process_group("nccl", rank=rank, world_size=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    mesh = init_device_mesh("cuda", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    cfg = GroupConfig(address=address, num_sources=2, num_destinations=2, host_store=False, timeout_s=120)
    Sender(model, config=cfg).push(1)
    dist.destroy_process_group()

def check(kind, root):
    v1, v2 = (build_tiny_model(f"{root}/{kind}/{v}", kind, seed=s) for v, s in (("v1", 0), ("v2", 7)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0,1")
    server = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", str(v1),
        "--tp-size", "2", "--dtype", "float32", "--attention-backend", "torch_native", "--disable-cuda-graph",
        "--mem-fraction-static", "0.2", "--skip-server-warmup", "--port", str(port),
        "--custom-weight-loader", HOOK], env=env, start_new_session=True)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health_generate", timeout=10); break
            except Exception:
                time.sleep(1)
        gen = lambda: [o["output_ids"] for o in http(url + "/generate", {"input_ids": [[5, 6, 7, 8, 9], [11, 12, 13]],
            "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}})]
        sums = lambda: [r["checksums"] for r in http(url + "/weights_checker", {"action": "checksum"})["ranks"]]
        before = gen()
        store = StoreServer()
        ctx = mp.get_context("spawn")
        pg_port = free_port()
        ps = [ctx.Process(target=trainer, args=(r, str(v2), store.address, pg_port)) for r in range(2)]
        for p in ps: p.start()
        cfg = GroupConfig(address=store.address, num_sources=2, num_destinations=2, host_store=False, timeout_s=120)
        replies = SglangEngine(url).refit(1, cfg)
        for p in ps: p.join()
        after, cs = gen(), sums()
        http(url + "/update_weights_from_disk", {"model_path": str(v2)})
        ok = {"params equal load_weights": cs == sums(), "tokens equal": after == gen(), "tokens changed": after != before,
              "received == kept": all(r.stats["bytes_received"] == r.stats["kept_bytes"] for r in replies)}
        print(kind, "tp=2", {r.tp_rank: int(r.stats["kept_bytes"]) for r in replies}, ok, flush=True)
        return all(ok.values())
    finally:
        os.killpg(server.pid, signal.SIGTERM); server.wait()

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as root:
        results = [check(kind, root) for kind in ("qwen2", "llama")]
    print("PASS" if all(results) else "FAIL")
    sys.exit(0 if all(results) else 1)
PY
"$VENV/bin/python" "$CHECK" "$@"
