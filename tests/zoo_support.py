"""The zoo: every tiny architecture refit into a real bf16 vLLM engine at
TP=2 (some at TP=1 too, see :data:`TP`) from FSDP2 trainer ranks, driven
from the test process.

Two long-lived process pools do the work (imports and process starts are
paid once): the trainer (2 FSDP2 ranks) and an engine host (offline
engines, one at a time, TP=1 in-process, TP=2 with two worker processes).

One configuration (architecture, TP):

1. the engine starts on checkpoint v2: its tokens and its whole state
   (:func:`reshard.adapters.core.state.model_state`: every tensor its
   forward pass may read, derived ones included) are a fresh engine's on v2;
2. vLLM's own reload moves it to v1 (its tokens must now differ);
3. a refit moves it back to v2, every parameter captured as it lands
   (before vLLM repacks it); its tokens and its whole state must equal the
   fresh engine's;
4. vLLM's own reload of v2, captured the same way: every parameter must
   equal what the refit wrote (a parameter the refit never wrote would still
   hold v1's bytes, or miss from the capture);
5. the worker's learned layout, for the plan-rule check;
   For the configurations in ``SHARED_MEMORY``, that refit is colocated:
   trainer ranks and engine workers on this host move every byte through
   shared memory (``GroupConfig(shared_memory=True)`` on every rank), through
   channels or read straight from the trainers' exported FSDP2 shards
   (``export_sources=True`` on the trainer ranks);
6. for the configurations in ``TWO_PHASE``: back to v1 by vLLM's reload,
   then a two-phase refit to v2 (staged while the engine could serve, then
   committed), captured the same way: it must land what the in-place refit
   and vLLM's reload did.

The refit checks bytes: every worker receives exactly what it keeps, the
trainers send exactly what the workers receive.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from reshard.testing.tiny import TINY, build_tiny_model

from .support import group_config

ZOO = sorted(TINY)
TWO_PHASE = {("qwen2_moe", 2), ("llama", 1)}
"""Configurations refit a second time with a two-phase refit (stage, then
commit): MoE experts repacked on CPU at TP=2, tied embeddings at TP=1."""

SHARED_MEMORY = {("qwen2", 2): "export", ("qwen3_moe", 1): "channels"}
"""Configurations whose refit is colocated: every byte through shared memory
(channels, or read from the trainers' exported tensors)."""

TP: dict[str, tuple[int, ...]] = {
    "deepseek_v3_g1": (1,),
    "gemma": (1,),
    "mistral": (1,),
    "llama": (1, 2),
    "qwen3_moe": (1, 2),
}
"""Tensor-parallel sizes per architecture. Default TP=2 only: each
architecture's loader is the same at TP=1 and TP=2, and TP=2 also splits
its tensors, replicates KV heads fewer than TP and pads partitions. TP=1 (whole tensors
gathered from the two trainer ranks' shards) for Llama (tied embeddings, a
two-phase refit), Qwen3-MoE (colocated, over shared memory) and the variants
of architectures the zoo runs at TP=2 (Gemma 1, Mistral, DeepSeek-V3 on the
reference MLA backend)."""

ENGINE_ARGS: dict[str, dict[str, Any]] = {"deepseek_v3_g1": {"attention_backend": "CPU_MLA"}}
"""Engine arguments per architecture: MLA on vLLM's reference CPU backend
(the others take the backend the machine picks: AMX where it has AMX)."""

CONFIGS = [(kind, tp) for kind in ZOO for tp in TP.get(kind, (2,))]

_state: dict[str, Any] = {}
"""Per pool process: the engine being tested, the trainer's default group."""


def build_zoo(root: str, kinds: Iterable[str] = ZOO) -> dict[str, tuple[str, str]]:
    """v1 and v2 (another seed) of every architecture (or of ``kinds``), in bfloat16."""
    out = {}
    for kind in kinds:
        v1 = build_tiny_model(os.path.join(root, kind, "v1"), kind, seed=0, torch_dtype="bfloat16")
        v2 = build_tiny_model(os.path.join(root, kind, "v2"), kind, seed=7, torch_dtype="bfloat16")
        out[kind] = (str(v1), str(v2))
    return out


# -- trainer ranks -----------------------------------------------------------------


def trainer_push(
    rank: int,
    world: int,
    pg_port: int,
    path: str,
    address: str,
    num_destinations: int,
    generation: int,
    refit: int,
    shared_memory: str = "",
) -> dict[str, Any]:
    """One FSDP2 trainer rank: ``path`` in bf16, each decoder layer and the
    root ``fully_shard``-ed over ``world`` ranks, pushed as refit ``refit``."""
    from reshard import Sender
    from tests.trainers import fsdp2_model

    model = fsdp2_model(rank, world, pg_port, path, dtype="bfloat16")
    cfg = group_config(
        address,
        world,
        num_destinations,
        generation=generation,
        shared_memory=bool(shared_memory),
        export_sources=shared_memory == "export",
    )
    sender = Sender(model, config=cfg)
    try:
        st = sender.push(refit)
        return {
            "sent": st.exec.bytes_sent,
            "casts": st.exec.casts,
            "links": st.exec.send_by_link,
            "direct": st.exec.direct_bytes,
        }
    finally:
        sender.close()


# -- the engine host -----------------------------------------------------------------


def engine_start(rank: int, path: str, tp: int, args: dict[str, Any] | None = None) -> dict[str, Any]:
    """Start the engine under test on ``path``: its greedy tokens and every
    worker's state."""
    from tests.vllm_support import make_llm

    engine_stop(rank)
    llm = make_llm(path, tp, dtype="bfloat16", **(args or {}))
    _state["llm"] = llm
    return engine_greedy(rank)


def engine_greedy(rank: int) -> dict[str, Any]:
    """The engine's greedy tokens, and every worker's state (see :func:`reshard.adapters.core.state.model_state`)."""
    from reshard.adapters.vllm.driver import engine_state
    from tests.vllm_support import greedy

    llm = _state["llm"]
    return {"tokens": greedy(llm), "state": engine_state(llm)}


def engine_pull(
    rank: int, config: dict[str, Any], refit: int, capture: bool, two_phase: bool = False
) -> dict[str, Any]:
    """Join the refit group ``config`` and pull refit ``refit`` on every
    worker; ``two_phase``: stage it, then commit it."""
    from reshard.adapters.vllm.driver import (
        commit_workers,
        flush_prefix_cache,
        init_workers,
        pull_workers,
        stage_workers,
    )
    from tests.vllm_support import flat

    llm = _state["llm"]
    init = flat(init_workers(llm, config))
    if capture:
        llm.collective_rpc("capture_begin")
    try:
        if two_phase:
            stage_workers(llm, refit)
            stats = flat(commit_workers(llm, refit))
        else:
            stats = flat(pull_workers(llm, refit))
        error = None
    except Exception as e:
        stats, error = None, str(e)
    digests = llm.collective_rpc("capture_end") if capture else None
    flush_prefix_cache(llm)
    return {"init": init, "stats": stats, "error": error, "digests": digests}


def engine_load(rank: int, path: str) -> list[list[int]]:
    """vLLM's own reload from ``path``; greedy tokens afterwards."""
    from reshard.adapters.vllm.driver import flush_prefix_cache
    from tests.vllm_support import greedy

    llm = _state["llm"]
    llm.collective_rpc("reload_from", args=(path,))
    flush_prefix_cache(llm)
    return greedy(llm)


def engine_reload(rank: int, path: str) -> list[dict[str, str]]:
    """vLLM's own reload from ``path``, every parameter captured as it lands."""
    llm = _state["llm"]
    llm.collective_rpc("capture_begin")
    llm.collective_rpc("reload_from", args=(path,))
    return llm.collective_rpc("capture_end")


def engine_learned(rank: int) -> list[list[tuple]]:
    return _state["llm"].collective_rpc("learned_pieces")


def engine_stop(rank: int) -> None:
    from tests.vllm_support import shutdown

    llm = _state.pop("llm", None)
    if llm is not None:
        shutdown(llm)
        del llm
        import gc

        gc.collect()


# -- the driver (test process) ----------------------------------------------------------


class Zoo:
    """Runs configurations on the two pools; results by ``(kind, tp)``."""

    def __init__(self, models: dict[str, tuple[str, str]], *, trainers: int = 2) -> None:
        from tests import procs

        self.models = models
        self.world = trainers
        self.store = procs.StoreServer()
        self.pg_port = procs.free_port()
        self.trainers = procs.Pool(trainers)
        self.host = procs.Pool(1, daemon=False)
        self.generation = 0

    def close(self) -> None:
        try:
            self.host.call(engine_stop, timeout=120)
        finally:
            self.host.close()
            self.trainers.close()

    def _refit(
        self, path: str, tp: int, refit: int, capture: bool, two_phase: bool = False, shm: str = ""
    ) -> dict[str, Any]:
        from tests import procs

        self.generation += 1
        config = {
            "address": self.store.address,
            "num_sources": self.world,
            "num_destinations": tp,
            "timeout_s": 120,
            "generation": self.generation,
            "shared_memory": bool(shm),
        }
        self.host.submit(engine_pull, config, refit, capture, two_phase)
        self.trainers.submit(
            trainer_push, self.world, self.pg_port, path, self.store.address, tp, self.generation, refit, shm
        )
        trainers = self.trainers.wait(timeout=600)
        (engine,) = procs.check(self.host.wait(timeout=600))
        engine["trainers"] = [o.value if o.ok else {"error": o.error} for o in trainers]
        return engine

    def run(self, kind: str, tp: int, args: dict[str, Any] | None = None) -> dict[str, Any]:
        """One configuration (see the module docstring); never raises, the
        error lands in the result. ``args``: engine arguments beside the
        architecture's own (:data:`ENGINE_ARGS`), e.g. a quantization."""
        v1, v2 = self.models[kind]
        out: dict[str, Any] = {"kind": kind, "tp": tp}
        engine_args = {**(ENGINE_ARGS.get(kind) or {}), **(args or {})}
        try:
            fresh = self.host.call(engine_start, v2, tp, engine_args, timeout=600)[0]
            out["fresh_v2"], out["fresh_state"] = fresh["tokens"], fresh["state"]
            out["before"] = self.host.call(engine_load, v1)[0]
            out["refit"] = self._refit(v2, tp, 1, capture=True, shm=SHARED_MEMORY.get((kind, tp), ""))
            after = self.host.call(engine_greedy)[0]
            out["after"], out["after_state"] = after["tokens"], after["state"]
            out["learned"] = self.host.call(engine_learned)[0]
            out["reference"] = self.host.call(engine_reload, v2)[0]
            if (kind, tp) in TWO_PHASE:
                # The same again, two-phase: back to v1 by vLLM's reload, then
                # stage v2 and commit it, every parameter captured as it lands.
                self.host.call(engine_load, v1)
                out["staged"] = self._refit(v2, tp, 2, capture=True, two_phase=True)
                after = self.host.call(engine_greedy)[0]
                out["after_staged"], out["staged_state"] = after["tokens"], after["state"]
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
        finally:
            try:
                self.host.call(engine_stop, timeout=120)
            except Exception as e:
                out.setdefault("error", f"stopping the engine: {e}")
        return out


def run_configs(root: str, configs: list[tuple[str, int]], args: dict[str, Any] | None = None) -> dict:
    """Every configuration ``(kind, tp)`` on one pair of pools, the engine
    started with ``args`` beside each architecture's own: results by
    configuration."""
    z = Zoo(build_zoo(root, kinds=sorted({k for k, _ in configs})))
    results: dict = {}
    try:
        for kind, tp in configs:
            results[(kind, tp)] = z.run(kind, tp, args)
    finally:
        z.close()
    return results


def completed(r: dict[str, Any]) -> dict[str, Any]:
    """A configuration's result, once its engine ran and its refit and
    every trainer reported no error."""
    assert "error" not in r, r["error"]
    assert r["refit"]["error"] is None, r["refit"]["error"]
    assert all("error" not in t for t in r["refit"]["trainers"]), r["refit"]["trainers"]
    return r


def assert_matches_reload(r: dict[str, Any]) -> None:
    """Every parameter as the refit landed it equals vLLM's own reload of the
    same checkpoint, on every worker. A tied lm_head is processed again by
    reshard (vLLM's reload leaves its CPU-packed copy stale); it is the
    embedding's own tensor."""
    ours, ref = r["refit"]["digests"], r["reference"]
    assert len(ours) == len(ref) == r["tp"]
    for worker_ours, worker_ref in zip(ours, ref, strict=True):
        extra = worker_ours.keys() - worker_ref.keys()
        assert extra <= {"lm_head.weight"}, extra
        assert worker_ref.keys() <= worker_ours.keys(), worker_ref.keys() - worker_ours.keys()
        differ = sorted(k for k in worker_ref if worker_ours[k] != worker_ref[k])
        assert not differ, differ
