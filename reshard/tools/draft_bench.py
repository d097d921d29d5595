"""``reshard bench --engine vllm --draft``: a speculative engine across
refits, its drafter refit with the policy vs left stale, in one run.

A Llama-style policy of a settable size is written to ``/dev/shm`` in two
versions; the drafter is a separate draft model equal to the policy (a
copy: the one drafter whose acceptance means something with random
weights; a real drafter is smaller, so its bytes are a fraction of these).
One real vLLM engine (offline ``LLM`` on CPU, ``method="draft_model"``,
``--spec-tokens`` draft tokens, TP ``--tp``) starts on version 1 with its
drafter in step, and one trainer rank in this process (``Sender(policy,
draft=drafter)``) alternates the versions. Each rep does two refits to the
other version:

- ``stale``: the policy only, the drafter declared frozen (what a refit
  that ignores the drafter does);
- ``refit``: policy and drafter together, sliced, in one refit.

After each, greedy generation of a batch of prompts is timed and vLLM's
acceptance counters (``vllm:spec_decode_num_draft_tokens``,
``_num_accepted_tokens``) give the share of draft tokens accepted. Reported:
acceptance and decode tokens/s per state (the start, after each refit), the
refit's seconds and the bytes each worker received, the drafter's apart.
Greedy tokens stay the same either way (speculative decoding is lossless).
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

__all__ = ["format_draft_result", "run_draft_bench"]

_COUNTERS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def _sizes(size_mb: float) -> dict[str, Any]:
    """A Llama config of at least ``size_mb`` MB in float32 (4 layers, hidden 256 and up)."""
    hidden = 256
    while 4 * (12 * hidden * hidden) * 4 / 2**20 < size_mb and hidden < 4096:
        hidden *= 2
    return dict(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        head_dim=64,
        num_hidden_layers=4,
        vocab_size=2048,
        tie_word_embeddings=False,
    )


def _measure(llm, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams

    def counters() -> tuple[int, int]:
        got = {m.name: m.value for m in llm.get_metrics() if m.name in _COUNTERS}
        return int(got.get(_COUNTERS[0], 0)), int(got.get(_COUNTERS[1], 0))

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    d0, a0 = counters()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    d1, a1 = counters()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {
        "acceptance": (a1 - a0) / max(d1 - d0, 1),
        "tokens_per_s": sum(len(t) for t in tokens) / seconds,
        "tokens": tokens,
    }


def run_draft_bench(
    *,
    size_mb: float = 64,
    tp: int = 1,
    reps: int = 2,
    spec_tokens: int = 3,
    max_tokens: int = 64,
    workdir: str | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from reshard import GroupConfig, Sender
    from reshard.adapters.vllm.driver import VllmEngines
    from reshard.testing.drafters import speculative_config
    from reshard.testing.engines import offline_llm, shutdown
    from reshard.testing.ports import free_port
    from reshard.testing.tiny import build_tiny_model

    root = workdir or tempfile.mkdtemp(prefix="reshard-draft-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    cfg = _sizes(size_mb)
    paths = [str(build_tiny_model(os.path.join(root, f"v{i}"), "llama", seed=7 * i, **cfg)) for i in (1, 2)]
    drafts = []
    for i, p in enumerate(paths):
        d = os.path.join(root, f"draft{i + 1}")
        if not os.path.exists(d):
            shutil.copytree(p, d)
        drafts.append(d)
    models = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in paths]
    policy_bytes = sum(t.nbytes for t in models[0].state_dict().values())
    say(f"policy {policy_bytes / 2**20:.1f} MiB (hidden {cfg['hidden_size']}), draft = a copy of it, TP={tp}")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, cfg["vocab_size"], (16,), generator=g).tolist() for _ in range(4)]
    llm = offline_llm(
        paths[0],
        tp,
        speculative_config=speculative_config("draft_model", drafts[0], tokens=spec_tokens),
        disable_log_stats=False,
        max_model_len=256,
    )
    out: dict[str, Any] = {"tp": tp, "policy_bytes": policy_bytes, "spec_tokens": spec_tokens, "rows": []}
    try:
        _measure(llm, prompts[:1], 8)  # warm-up
        out["rows"].append({"state": "start", **_measure(llm, prompts, max_tokens)})
        current = 0
        for rep in range(reps):
            target = 1 - current
            for mode in ("stale", "refit"):
                # A stale refit moves the policy only; a refit both, from the same trainer.
                draft = models[target] if mode == "refit" else None
                group = GroupConfig(address=f"127.0.0.1:{free_port()}", num_sources=1, num_destinations=tp)
                sender = Sender(models[target], config=group, draft=draft)
                try:
                    engines = VllmEngines([llm], draft="refit" if mode == "refit" else "frozen")
                    st = sender.push(2 * rep + (mode == "refit") + 1, engines=engines)
                    stats = list(sender.engine_stats)
                finally:
                    sender.close()
                row = {
                    "state": f"{mode} (rep {rep})",
                    "refit_seconds": st.total_seconds,
                    "received": [s.bytes_received for s in stats],
                    "drafter_bytes": [s.drafter_kept_bytes for s in stats],
                    **_measure(llm, prompts, max_tokens),
                }
                say(
                    f"{row['state']:>16}: acceptance {row['acceptance']:.2f}, {row['tokens_per_s']:.1f} tok/s, "
                    f"refit {row['refit_seconds']:.2f} s, {sum(row['received']) / 2**20:.1f} MiB received "
                    f"({sum(row['drafter_bytes']) / 2**20:.1f} MiB drafter)"
                )
                out["rows"].append(row)
            current = target
    finally:
        shutdown(llm)
        del llm
        gc.collect()
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    stale = [r for r in out["rows"] if r["state"].startswith("stale")]
    fresh = [r for r in out["rows"] if r["state"].startswith("refit")]
    out["summary"] = {
        "stale_acceptance": statistics.mean(r["acceptance"] for r in stale),
        "refit_acceptance": statistics.mean(r["acceptance"] for r in fresh),
        "stale_tokens_per_s": statistics.median(r["tokens_per_s"] for r in stale),
        "refit_tokens_per_s": statistics.median(r["tokens_per_s"] for r in fresh),
        "stale_refit_seconds": statistics.median(r["refit_seconds"] for r in stale),
        "refit_refit_seconds": statistics.median(r["refit_seconds"] for r in fresh),
        "stale_bytes": statistics.median(sum(r["received"]) for r in stale),
        "refit_bytes": statistics.median(sum(r["received"]) for r in fresh),
        "drafter_bytes": statistics.median(sum(r["drafter_bytes"]) for r in fresh),
    }
    for r in out["rows"]:
        r.pop("tokens", None)
    return out


def format_draft_result(res: dict[str, Any]) -> str:
    s = res["summary"]
    lines = [
        f"speculative engine (draft_model = a copy of the policy, {res['spec_tokens']} draft tokens, "
        f"TP={res['tp']}), policy {res['policy_bytes'] / 2**20:.1f} MiB",
        f"{'state':>16}  {'acceptance':>10}  {'tok/s':>8}  {'refit s':>8}  {'MiB in':>8}  {'drafter MiB':>11}",
    ]
    for r in res["rows"]:
        lines.append(
            f"{r['state']:>16}  {r['acceptance']:>10.2f}  {r['tokens_per_s']:>8.1f}  "
            f"{r.get('refit_seconds', 0.0):>8.2f}  {sum(r.get('received', [0])) / 2**20:>8.1f}  "
            f"{sum(r.get('drafter_bytes', [0])) / 2**20:>11.1f}"
        )
    lines.append(
        f"drafter refit vs stale: acceptance {s['refit_acceptance']:.2f} vs {s['stale_acceptance']:.2f}, "
        f"decode {s['refit_tokens_per_s'] / s['stale_tokens_per_s']:.2f}x tokens/s, "
        f"refit {s['refit_refit_seconds'] / s['stale_refit_seconds']:.2f}x seconds for "
        f"{s['refit_bytes'] / max(s['stale_bytes'], 1):.2f}x bytes (drafter {s['drafter_bytes'] / 2**20:.1f} MiB "
        f"beside the policy's {s['stale_bytes'] / 2**20:.1f} MiB)"
    )
    return "\n".join(lines)
