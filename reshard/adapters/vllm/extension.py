"""A vLLM worker extension: ``--worker-extension-cls reshard.adapters.vllm.ReshardWorkerExtension``.

An RL driver calls these methods on every worker with ``collective_rpc``
(offline ``LLM.collective_rpc`` or the dev-mode ``POST /collective_rpc``).
Arguments are JSON strings or plain values, because the HTTP route passes
strings only:

- ``reshard_init(spec)``: learn this worker's layout from vLLM's loaders;
  ``spec`` is a :class:`reshard.adapters.core.spec.GroupSpec` as JSON (the
  refit group and the worker options ``engine_offset``, ``budget_bytes``,
  ``atomic``). The worker's refit rank is ``num_sources + engine_offset +
  worker rank``.
- ``reshard_pull(refit, method="reshard", atomic=None)``: receive refit
  number ``refit`` (trainer ranks call ``Sender.push(refit)`` at the same
  time); ``atomic`` overrides the spec's for this refit (see
  :meth:`reshard.adapters.vllm.receiver.VllmReceiver.pull`).
- two-phase refits: ``reshard_stage(refit, method="reshard")`` starts
  receiving refit ``refit`` into staging buffers in a thread of the worker
  and returns at once (the engine keeps serving its live weights);
  ``reshard_staged(refit)`` says whether it is done (``stats["staged"]``)
  or failed (the live weights are untouched); ``reshard_commit(refit)``
  applies it, with generation paused (see
  :meth:`reshard.adapters.vllm.receiver.VllmReceiver.stage`).
- adapter-only refits (``enable_lora=True``; :mod:`reshard.adapters.vllm.lora`):
  ``reshard_lora_init(spec, name, adapter)`` learns the slices of adapter
  ``name`` (``adapter``: an :class:`reshard.sender.lora_adapter.AdapterSpec`
  as JSON) this worker's LoRA layers keep, in refit group ``spec``;
  ``reshard_lora_retire(name, keep)`` drops the versions not in ``keep``
  (JSON list of paths) that no request names, which the engine core reports
  by appending an argument (:mod:`reshard.adapters.vllm.lora_versions`);
  ``reshard_lora_stage(name, refit, lora_id, method, max_versions, keep)``
  retires so, then starts receiving refit ``refit`` of the adapter in a
  thread of the worker and returns at once (the engine keeps generating; a
  worker that holds ``max_versions`` versions refuses the refit on every
  rank); ``reshard_lora_staged(name, refit)`` says whether it is done, and
  once it is, keeps it as a version vLLM loads from
  ``reshard://<name>/<refit>``.
- ``reshard_status()``, ``reshard_stats()``, ``reshard_close()``.
- ``reshard_state(probe=True)``: a digest of every tensor the model's
  forward pass may read (parameters, buffers, tensors derived at load time
  such as repacked kernel weights, absorbed MLA matrices, each linear
  layer's output on a fixed input), by module path: compare it with a fresh
  engine's on the same weights (:func:`reshard.adapters.core.state.compare_states`)
  to prove a refit left nothing stale.

Every method returns a :class:`reshard.adapters.core.replies.WorkerReply`
as a dict and never raises: vLLM 0.32's multiprocess executor stops reading
worker replies at the first worker that raised, so the next
``collective_rpc`` would get a stale reply;
:mod:`reshard.adapters.vllm.driver` turns the replies back into one error.
A reply's ``mixed`` says whether a failed refit left this worker with some
layers new and some old.

After a pull, reset the prefix cache (``LLM.reset_prefix_cache()`` or
``POST /reset_prefix_cache``): cached prefixes were computed with the old
weights. In a server, pause generation around it (``POST /pause?mode=wait``,
then ``POST /resume``); :class:`reshard.adapters.vllm.driver.VllmEngines`
does all of it.
"""

from __future__ import annotations

from typing import Any

from reshard.adapters.core.replies import WorkerReply, failure
from reshard.adapters.core.spec import GroupSpec
from reshard.transport.stats import EngineStats

__all__ = ["ReshardWorkerExtension"]


def _flag(v: bool | str | None) -> bool | None:
    """A boolean that may arrive as a string (the HTTP route passes strings)."""
    if v is None or isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in ("", "none", "null"):
        return None
    if text in ("1", "true", "yes"):
        return True
    if text in ("0", "false", "no"):
        return False
    raise ValueError(f"not a boolean: {v!r}")


class ReshardWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    # Provided by vLLM's worker, which this class is mixed into.
    rank: int
    model_runner: Any
    vllm_config: Any
    device: Any
    _reshard: Any

    def _reshard_rank(self) -> int:
        r = getattr(self, "_reshard", None)
        return r.rank if r is not None else -1

    def reshard_init(self, spec: str | dict) -> dict[str, Any]:
        try:
            return self._reshard_init(GroupSpec.parse(spec)).to_builtins()
        except BaseException as e:
            return failure(e).to_builtins()

    def reshard_pull(
        self, refit: int | str, method: str = "reshard", atomic: bool | str | None = None
    ) -> dict[str, Any]:
        return self._reshard_call(lambda r: self._updated(r.pull(int(refit), method=method, atomic=_flag(atomic))))

    def reshard_stage(self, refit: int | str, method: str = "reshard") -> dict[str, Any]:
        return self._reshard_call(lambda r: r.stage(int(refit), method=method) or {"staging": int(refit)})

    def reshard_staged(self, refit: int | str) -> dict[str, Any]:
        return self._reshard_call(lambda r: {"staged": r.staging_state(int(refit))})

    def reshard_commit(self, refit: int | str) -> dict[str, Any]:
        return self._reshard_call(lambda r: self._updated(r.commit(int(refit))))

    def _updated(self, stats: EngineStats) -> dict[str, Any]:
        """After the live weights changed: refresh what vLLM's own
        ``finish_weight_update`` refreshes (``model_runner.reset_lora_state``:
        LoRA adapters computed against the old weights, and in vLLM 0.33
        quantized draft heads of speculative decoding), where it exists.
        Returns the worker's account as its reply carries it."""
        reset = getattr(self.model_runner, "reset_lora_state", None)
        if reset is not None:
            reset()
        return stats.to_builtins()

    def _reshard_call(self, fn) -> dict[str, Any]:
        """``fn(receiver)``'s stats as a reply (a failure reply if it raised)."""
        r = getattr(self, "_reshard", None)
        try:
            if r is None:
                raise RuntimeError("call reshard_init first")
            reply = WorkerReply(ok=True, rank=r.rank, stats=fn(r))
        except BaseException as e:
            reply = failure(e, rank=self._reshard_rank(), mixed=bool(r is not None and r.mixed))
        return reply.to_builtins()

    def _reshard_model(self):
        """The model vLLM runs, unwrapped (on GPU the runner may hold it in a
        CUDA-graph wrapper; ``get_model()`` is what vLLM's own loaders use)."""
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def reshard_state(self, probe: bool | str = True) -> dict[str, str]:
        """The target's state and its drafter's (under ``drafter:``)."""
        from reshard.adapters.core.state import engine_model_state
        from reshard.adapters.vllm.drafter import find_drafter

        drafter = find_drafter(self)
        return engine_model_state(
            self._reshard_model(), drafter.model if drafter is not None else None, probe=bool(_flag(probe))
        )

    def reshard_status(self) -> dict[str, Any]:
        """``stats``: ``{"ready": joined, "refit": last good refit}``; ``mixed``:
        a failed refit left old and new weights."""
        r = getattr(self, "_reshard", None)
        if r is None:
            return WorkerReply(ok=True, stats={"ready": False, "refit": 0}).to_builtins()
        stats = {"ready": True, "refit": r.receiver.last_refit}
        return WorkerReply(ok=True, rank=r.rank, mixed=r.mixed, stats=stats).to_builtins()

    def _reshard_init(self, spec: GroupSpec) -> WorkerReply:
        from reshard.adapters.vllm.drafter import find_drafter
        from reshard.adapters.vllm.receiver import VllmReceiver

        old = getattr(self, "_reshard", None)
        self._reshard = None
        if old is not None:
            old.close()
        rank = spec.rank_of(int(self.rank))
        self._reshard = r = VllmReceiver(
            self._reshard_model(),
            self.vllm_config.model_config,
            config=spec.config(),
            rank=rank,
            device=self.device,
            budget_bytes=spec.budget_bytes,
            atomic=spec.atomic,
            vllm_config=self.vllm_config,
            drafter=find_drafter(self),
            draft=spec.draft,
        )
        stats = {
            "pieces": len(r.learned.pieces),
            "params": len(r.learned.local_shapes),
            "kept_bytes": r.kept_bytes,
            "learn_seconds": r.learn_seconds,
            "drafter": r.draft_mode,
            "drafter_kept_bytes": r.drafter_kept_bytes,
        }
        return WorkerReply(ok=True, rank=rank, stats=stats)

    # -- adapter-only refits --------------------------------------------------

    def _reshard_loras(self):
        from reshard.adapters.vllm.lora_versions import WorkerAdapters

        loras = getattr(self, "_reshard_adapters", None)
        if loras is None:
            loras = self._reshard_adapters = WorkerAdapters(self.model_runner)
        return loras

    def reshard_lora_init(self, spec: str | dict, name: str, adapter: str | dict) -> dict[str, Any]:
        try:
            from reshard.adapters.vllm.lora import AdapterReceiver
            from reshard.adapters.vllm.receiver import canonical_tensors_of
            from reshard.sender.lora_adapter import AdapterSpec

            group = GroupSpec.parse(spec)
            loras = self._reshard_loras()
            old = loras.receivers.pop(name, None)
            if old is not None:
                old.close()
            rank = group.rank_of(int(self.rank))
            receiver = loras.receivers[name] = AdapterReceiver(
                loras,
                name,
                AdapterSpec.parse(adapter),
                tensors=canonical_tensors_of(self.vllm_config.model_config, self.vllm_config),
                config=group.config(),
                rank=rank,
                device=self.device,
                budget_bytes=group.budget_bytes,
            )
            stats = {"kept_bytes": receiver.kept_bytes, "slices": len(receiver.buffers)}
            return WorkerReply(ok=True, rank=rank, stats=stats).to_builtins()
        except BaseException as e:
            return failure(e).to_builtins()

    def _lora_call(self, name: str, fn) -> dict[str, Any]:
        """``fn(adapter receiver of name)``'s stats as a reply (a failure reply if it raised)."""
        loras = getattr(self, "_reshard_adapters", None)
        receiver = loras.receivers.get(name) if loras is not None else None
        try:
            if receiver is None:
                raise RuntimeError(f"call reshard_lora_init for adapter {name!r} first")
            return WorkerReply(ok=True, rank=receiver.rank, stats=fn(receiver)).to_builtins()
        except BaseException as e:
            return failure(e, rank=receiver.rank if receiver is not None else -1).to_builtins()

    def reshard_lora_stage(
        self,
        name: str,
        refit: int | str,
        lora_id: int | str,
        method: str = "reshard",
        max_versions: int | str = 4,
        keep: str | list[str] = "[]",
        users: str | None = None,
    ) -> dict[str, Any]:
        """Retire (as :meth:`reshard_lora_retire`), then start receiving."""

        def stage(r: Any) -> dict[str, Any]:
            retired = _retire(r, name, keep, users)
            return {**r.stage(int(refit), int(lora_id), method=method, max_versions=int(max_versions)), **retired}

        return self._lora_call(name, stage)

    def reshard_lora_staged(self, name: str, refit: int | str) -> dict[str, Any]:
        return self._lora_call(name, lambda r: r.staged(int(refit)))

    def reshard_lora_retire(self, name: str, keep: str | list[str], users: str | None = None) -> dict[str, Any]:
        """``users``: appended by the engine core (its scheduler's requests by
        LoRA path, JSON); without it nothing is dropped."""
        return self._lora_call(name, lambda r: _retire(r, name, keep, users))

    def reshard_stats(self) -> dict[str, Any]:
        r = getattr(self, "_reshard", None)
        return r.last_stats.to_builtins() if r is not None else {}

    def reshard_close(self) -> None:
        r = getattr(self, "_reshard", None)
        if r is not None:
            r.close()
            self._reshard = None
        loras = getattr(self, "_reshard_adapters", None)
        if loras is not None:
            loras.close()


def _retire(receiver: Any, name: str, keep: str | list[str], users: str | None) -> dict[str, Any]:
    import json

    listed = json.loads(keep) if isinstance(keep, str) else list(keep)
    report = json.loads(users) if users is not None else None
    return {**receiver.owner.retire(name, [str(p) for p in listed], report), "kept_bytes": receiver.kept_bytes}
