"""``reshard bench --engine vllm --lora``: refitting a LoRA policy into a real
engine, four ways from one run.

A Qwen2-style base of a settable size is written to ``/dev/shm``; a real
vLLM engine (offline ``LLM``, TP=2 by default, on CPU, LoRA enabled, its
engine core in a process of its own that steps on its own, as a server's
does) serves it; two FSDP2 trainer ranks hold a PEFT LoRA policy on the
same base (rank 16 on every linear layer by default, seeded factors). After
a warm-up the methods alternate, each timed from a barrier of every process
to the engine ready to generate with the new policy, while a request streams
tokens from the engine (the base model, greedy):

- ``merged``: ``Sender(policy)``: each trainer rank sends the merged
  weights' boxes it holds (merged on the fly), each worker pulls what it
  keeps into its base weights, in one call into the engine;
- ``adapter``: ``Sender(LoraAdapter(policy))`` into the engine's LoRA slots
  (:mod:`reshard.adapters.vllm.lora`): only the factors' slices move, each
  worker receives them in a thread of its own while the engine keeps
  generating, and the engine stops only to register the version;
- ``gather_broadcast``: TRL's way, merged weights gathered whole and
  broadcast to every worker (the same interface's baseline);
- ``adapter_file``: the adapter gathered on trainer rank 0, written to
  ``/dev/shm`` with PEFT's ``save_pretrained`` and loaded by path
  (``LoRARequest``), what an adapter-only sync through files costs.

The methods share one engine: the adapters apply on top of whatever base the
merged refits left, which changes no timing; the token check compares the
adapter-only version with the same factors loaded from their file, on the
same base.

Reported per method: median seconds, bytes that moved (into the engine, or
written and read back), the engine's stall: the longest gap between two
tokens of the streaming request that overlaps the refit (measured for every
method; a gap between two tokens with no refit is printed beside it), and
whether greedy tokens match between the adapter-only version and the same
factors loaded from their file.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from reshard.testing.ports import free_port
from reshard.tools.engine_bench import (
    barrier,
    bench_store,
    collect,
    join_all,
    model_config,
    schedule,
    scratch,
    spawn_ranks,
)

__all__ = ["LORA_METHODS", "format_lora_result", "run_lora_bench"]

LORA_METHODS = ("merged", "adapter", "gather_broadcast", "adapter_file")


def _policy(path: str, dtype: str, rank: int, lora_rank: int, world: int, pg_port: int) -> Any:
    """Trainer rank ``rank``'s PEFT policy under FSDP2 (decoder layers, then the whole model)."""
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(pg_port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    cfg = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules="all-linear", lora_dropout=0.0)
    policy = get_peft_model(base, cfg, autocast_adapter_dtype=False)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.02)
    mesh = init_device_mesh("cpu", (world,))
    inner: Any = policy.get_base_model()
    layers: Any = inner.model.layers
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    return policy


def _trainer(rank: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from reshard import Sender
    from reshard.sender.lora_adapter import LoraAdapter

    torch.set_num_threads(1)
    world = cfg["trainers"]
    store = bench_store(cfg["bench_address"])
    policy = _policy(cfg["base"], cfg["dtype"], rank, cfg["lora_rank"], world, cfg["pg_port"])
    merged = Sender(policy, config=_group(cfg["merged_address"], world, cfg["tp"]))
    adapter = Sender(LoraAdapter(policy), config=_group(cfg["adapter_address"], world, cfg["tp"]))
    if rank == 0:
        store.set("bench/spec", LoraAdapter(policy).spec().to_json())
    out: list[dict[str, Any]] = []
    refits = {"merged": 0, "adapter": 0}
    try:
        for step, (_, method) in enumerate(schedule(cfg["warmup"], cfg["reps"], LORA_METHODS)):
            barrier(store, step, cfg["parties"])
            t0 = time.perf_counter()
            if method in ("merged", "gather_broadcast"):
                refits["merged"] += 1
                st = merged.push(refits["merged"], method="reshard" if method == "merged" else "gather_broadcast")
                out.append({"step": step, "method": method, "sent": st.exec.bytes_sent})
            elif method == "adapter":
                refits["adapter"] += 1
                st = adapter.push(refits["adapter"])
                out.append({"step": step, "method": method, "sent": st.exec.bytes_sent})
            else:
                # What a file-based adapter sync does: gather the factors
                # (PEFT's own state dict under FSDP2), rank 0 writes them.
                from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

                full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                if rank == 0:
                    lora = {k: v for k, v in full.items() if ".lora_" in k}
                    where = os.path.join(cfg["work"], f"adapter-{step}")
                    policy.save_pretrained(where, state_dict=lora)
                    size = sum(f.stat().st_size for f in Path(where).iterdir())
                    store.set(f"bench/file/{step}", json.dumps({"path": where, "bytes": size}))
                out.append({"step": step, "method": method, "seconds": time.perf_counter() - t0})
    finally:
        merged.close()
        adapter.close()
        dist.destroy_process_group()
    return out


def run_lora_bench(
    *,
    size_mb: float = 256,
    tp: int = 2,
    trainers: int = 2,
    lora_rank: int = 16,
    reps: int = 3,
    warmup: int = 1,
    dtype: str = "float32",
    workdir: str | None = None,
    say=print,
) -> dict[str, Any]:
    """``workdir``: where the base and the adapter files go (default: a
    folder in /dev/shm, removed afterwards)."""
    with scratch(workdir, "reshard-lora-bench-") as work:
        return _run(work, size_mb, tp, trainers, lora_rank, reps, warmup, dtype, say)


def _run(
    work: Path, size_mb: float, tp: int, trainers: int, lora_rank: int, reps: int, warmup: int, dtype: str, say
) -> dict[str, Any]:
    import torch
    from vllm.lora.request import LoRARequest

    from reshard.adapters.core.spec import GroupSpec
    from reshard.adapters.vllm.adapters import VllmAdapters
    from reshard.adapters.vllm.driver import init_workers, pull_workers
    from reshard.sender.lora_adapter import AdapterSpec
    from reshard.testing.engines import greedy, offline_llm, shutdown
    from reshard.testing.tiny import build_tiny_model

    say(f"building a {size_mb:.0f} MB {dtype} base in {work} ...")
    # Positions enough for a request that streams through every refit.
    dims = dict(model_config(size_mb, dtype), max_position_embeddings=_STREAM_LEN + 16)
    base = build_tiny_model(work / "base", "qwen2", seed=0, **dims)
    bench_address = f"127.0.0.1:{free_port()}"
    store = bench_store(bench_address, host=True)
    cfg = {
        "trainers": trainers,
        "tp": tp,
        "reps": reps,
        "warmup": warmup,
        "dtype": dtype,
        "lora_rank": lora_rank,
        "base": str(base),
        "work": str(work),
        "bench_address": bench_address,
        "merged_address": f"127.0.0.1:{free_port()}",
        "adapter_address": f"127.0.0.1:{free_port()}",
        "pg_port": free_port(),
        "parties": 1 + trainers,
    }
    say(f"starting vLLM (TP={tp}, CPU, LoRA rank {lora_rank}) ...")
    llm = offline_llm(
        str(base),
        tp,
        dtype=dtype,
        enable_lora=True,
        max_lora_rank=lora_rank,
        max_loras=2,
        max_cpu_loras=4,
        max_model_len=_STREAM_LEN + 16,
        core_process=True,
    )
    torch.set_num_threads(1)
    q, procs = spawn_ranks((_trainer, r, (cfg,)) for r in range(trainers))
    rows: list[dict[str, Any]] = []
    tokens: dict[str, list] = {}
    try:
        merged_group = _group(str(cfg["merged_address"]), trainers, tp)
        kept = [int(r.stats["kept_bytes"]) for r in init_workers(llm, GroupSpec.of(merged_group, with_token=True))]
        spec = AdapterSpec.parse(store.get("bench/spec").decode())
        adapters = VllmAdapters([llm], "policy", spec)
        adapters.init(_group(str(cfg["adapter_address"]), trainers, tp))
        refits = {"merged": 0, "adapter": 0}
        file_id = 1 << 24
        steps = schedule(warmup, reps, LORA_METHODS)
        say(f"{len(steps)} timed steps ({warmup} warm-up round(s), then {reps}), methods alternating ...")
        for step, (rep, method) in enumerate(steps):
            row: dict[str, Any] = {"step": step, "rep": rep, "method": method, "warmup": rep < warmup}
            request = None
            with _Stream(llm, f"stream-{step}") as stream:
                barrier(store, step, 1 + trainers)
                t0 = time.perf_counter()
                if method in ("merged", "gather_broadcast"):
                    refits["merged"] += 1
                    replies = pull_workers(llm, refits["merged"], method="reshard" if method == "merged" else method)
                    row["moved"] = sum(int(r.stats.get("bytes_received", 0)) for r in replies)
                elif method == "adapter":
                    refits["adapter"] += 1
                    replies = adapters.refit(refits["adapter"])
                    row["moved"] = sum(int(r.stats.get("bytes_received", 0)) for r in replies)
                    row["version_bytes"] = max(int(r.stats["kept_bytes"]) for r in replies)
                    row["versions_bytes"] = max(int(r.stats["versions_bytes"]) for r in replies)
                    request = adapters.request()
                else:
                    meta = json.loads(_wait_key(store, f"bench/file/{step}"))
                    file_id += 1
                    request = LoRARequest(f"file-{step}", file_id, meta["path"])
                    t_load = time.perf_counter()
                    llm.llm_engine.add_lora(request)
                    row["moved"] = 2 * int(meta["bytes"])  # written, then read back
                    row["load_seconds"] = time.perf_counter() - t_load
                t1 = time.perf_counter()
                row["seconds"] = t1 - t0
            row.update(stream.stall(t0, t1))
            if method == "adapter":
                # Where the adapter-only stall is: receiving, or registering the version.
                t_reg = t1 - max(float(r.stats["register_seconds"]) for r in replies)
                row["stall_receiving"] = stream.stall(t0, t_reg)["paused_seconds"]
                row["stall_registering"] = stream.stall(t_reg, t1)["paused_seconds"]
            # Prefixes cached before a merged refit were computed with the old
            # weights (with the stream running, vLLM would not drop them).
            if not llm.reset_prefix_cache():
                raise RuntimeError("the engine did not reset its prefix cache with no request running")
            rows.append(row)
            if rep == warmup + reps - 1:
                tokens[method] = greedy(llm, lora_request=request)
        results = collect(q, procs, timeout=600, what="LoRA bench")
    finally:
        join_all(procs)
        shutdown(llm)
    for _name, _rank, value in results:
        for r in value:
            rows[r["step"]].setdefault("trainers", []).append(r)
    for row in rows:
        if row["method"] == "adapter_file":
            # The trainer's gather and write come before the engine's load.
            row["seconds"] += max(r.get("seconds", 0.0) for r in row.get("trainers", []))
    return _summary(rows, tokens, kept, size_mb, tp, trainers, lora_rank, dtype, reps, warmup)


_STREAM_LEN = 4000
"""Tokens the streaming request may generate: more than any refit here lasts."""


class _Stream:
    """A greedy request on the base model, its tokens read in a thread of
    this process as the engine core (a process of its own) makes them; the
    arrival time of each is kept. Entering starts it and returns once it
    streams; leaving stops reading at the first token after that and aborts
    it. Meanwhile the caller's calls into the engine are the only ones that
    send (the engine core client is not thread-safe for sending)."""

    def __init__(self, llm: Any, rid: str) -> None:
        self.engine = llm.llm_engine
        self.rid = rid
        self.times: list[float] = []
        self.ended = False
        self._stop = threading.Event()
        self._stopped_at = 0.0
        self._streaming = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, name="lora-bench-stream", daemon=True)

    def __enter__(self) -> _Stream:
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=_STREAM_LEN, temperature=0, ignore_eos=True)
        self.engine.add_request(self.rid, {"prompt_token_ids": [5, 6, 7, 8, 9]}, sp)
        self._thread.start()
        # A few tokens first: the gaps between them are the engine's pace with no refit.
        if not self._streaming.wait(timeout=600) or self._error is not None:
            raise RuntimeError(f"the streaming request never streamed: {self._error}")
        return self

    def _read(self) -> None:
        seen = 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id != self.rid:
                        continue
                    n = len(out.outputs[0].token_ids)
                    now = time.perf_counter()
                    self.times.extend([now] * (n - seen))
                    seen = n
                    if out.finished:
                        self.ended = True
                        return
                if len(self.times) >= 8:
                    self._streaming.set()
                    # Stop at the first token after the caller's work: it closes the last gap.
                    if self._stop.is_set() and self.times[-1] > self._stopped_at:
                        return
        except BaseException as e:  # raised by stall()
            self._error = e
        finally:
            self._streaming.set()

    def __exit__(self, *exc: Any) -> None:
        self._stopped_at = time.perf_counter()
        self._stop.set()
        self._thread.join(timeout=600)
        if self._thread.is_alive():
            raise RuntimeError("the streaming request made no token after the refit")
        if not self.ended:
            self.engine.abort_request([self.rid])

    def stall(self, t0: float, t1: float) -> dict[str, Any]:
        """The longest gap between two tokens that overlaps ``[t0, t1]``, and
        the median gap before ``t0``."""
        if self._error is not None:
            raise RuntimeError(f"the streaming request failed: {self._error}") from self._error
        ts = self.times
        gaps = [b - a for a, b in itertools.pairwise(ts) if b >= t0 and a <= t1]
        before = [b - a for a, b in itertools.pairwise(ts) if b < t0]
        return {
            "paused_seconds": max(gaps, default=float("nan")),
            "token_gap_seconds": statistics.median(before) if before else float("nan"),
            # A stream that ended before t1 measured a part of the refit only.
            "stream_covered": bool(ts) and ts[-1] > t1,
        }


def _group(address: str, sources: int, destinations: int) -> Any:
    from reshard.transport.group import GroupConfig

    return GroupConfig(address=address, num_sources=sources, num_destinations=destinations, timeout_s=600)


def _wait_key(store: Any, key: str) -> str:
    store.wait([key])
    return store.get(key).decode()


def _summary(rows, tokens, kept, size_mb, tp, trainers, lora_rank, dtype, reps, warmup) -> dict[str, Any]:
    timed = [r for r in rows if not r["warmup"]]
    out: dict[str, Any] = {
        "case": f"LoRA policy (rank {lora_rank}, every linear layer) on a {size_mb:.0f} MB {dtype} base: "
        f"trainer fsdp={trainers} -> vllm tp={tp} (CPU, offline LLM, LoRA enabled)",
        "kept_bytes": kept,
        "reps": reps,
        "warmup": warmup,
        "methods": {},
    }
    for m in LORA_METHODS:
        rs = [r for r in timed if r["method"] == m]
        out["methods"][m] = {
            "median_seconds": statistics.median(r["seconds"] for r in rs),
            "moved_bytes": statistics.median(r["moved"] for r in rs),
            "paused_seconds": statistics.median(r["paused_seconds"] for r in rs),
            "token_gap_seconds": statistics.median(r["token_gap_seconds"] for r in rs),
        }
    out["stream_covered"] = all(r["stream_covered"] for r in timed)
    held = [r for r in timed if r["method"] == "adapter"]
    out["version_bytes"] = max(r["version_bytes"] for r in held)
    for k in ("stall_receiving", "stall_registering"):
        out["methods"]["adapter"][k] = statistics.median(r[k] for r in held)
    out["versions_bytes"] = max(r["versions_bytes"] for r in held)
    out["adapter_tokens_equal_file_tokens"] = tokens.get("adapter") == tokens.get("adapter_file")
    out["rows"] = rows
    return out


def format_lora_result(res: dict[str, Any]) -> str:
    lines = [res["case"], f"{'method':<18}{'median s':>10}{'MB moved':>10}{'stall s':>10}{'gap s':>8}"]
    for m, r in res["methods"].items():
        lines.append(
            f"{m:<18}{r['median_seconds']:>10.3f}{r['moved_bytes'] / 1e6:>10.2f}{r['paused_seconds']:>10.3f}"
            f"{r['token_gap_seconds']:>8.3f}"
        )
    lines.append(
        "stall: the longest gap between two tokens of a request streaming during the refit (median of the reps); "
        "gap: the median gap between its tokens before the refit"
        + ("" if res.get("stream_covered", True) else "; WARNING: a stream ended before its refit did")
    )
    ms = res["methods"]
    a = ms["adapter"]["median_seconds"]
    lines.append(
        f"adapter-only takes {ms['merged']['median_seconds'] / a:.1f}x less time than a merged refit, "
        f"{ms['gather_broadcast']['median_seconds'] / a:.1f}x less than TRL's merge-gather-broadcast, "
        f"{ms['adapter_file']['median_seconds'] / a:.1f}x less than writing and loading the adapter file; "
        f"it moves {ms['adapter']['moved_bytes'] / max(ms['merged']['moved_bytes'], 1):.4f}x the merged refit's "
        f"bytes and stalls the engine {ms['merged']['paused_seconds'] / ms['adapter']['paused_seconds']:.1f}x less"
    )
    ad = ms["adapter"]
    lines.append(
        f"adapter-only stall: {ad['stall_receiving']:.3f} s while the workers receive (the engine generating), "
        f"{ad['stall_registering']:.3f} s while the version is registered"
    )
    lines.append(
        f"adapter-only: a version takes {res['version_bytes'] / 1e6:.2f} MB on each worker; the versions kept "
        f"took {res['versions_bytes'] / 1e6:.2f} MB on the busiest one"
    )
    equal = res["adapter_tokens_equal_file_tokens"]
    lines.append(f"greedy tokens, adapter-only vs the same adapter loaded from its file: equal {equal}")
    return "\n".join(lines)
