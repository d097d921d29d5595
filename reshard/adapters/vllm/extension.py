"""A vLLM worker extension: ``--worker-extension-cls reshard.adapters.vllm.ReshardWorkerExtension``.

An RL driver calls these methods on every worker with ``collective_rpc``
(offline ``LLM.collective_rpc`` or the dev-mode ``POST /collective_rpc``).
Arguments are JSON strings or plain values, because the HTTP route passes
strings only:

- ``reshard_init(config)``: learn this worker's layout from vLLM's loaders;
  ``config`` holds the refit group (``address``, ``num_sources``,
  ``num_destinations``, optional ``job``, ``generation``, ``timeout_s``,
  ``domain``, any other :class:`reshard.GroupConfig` field) and worker
  options (``engine_offset``, ``budget_bytes``, ``atomic``). The worker's refit rank is
  ``num_sources + engine_offset + worker rank``. Returns a summary.
- ``reshard_pull(refit, method="reshard", atomic=None)``: receive refit
  number ``refit`` (trainer ranks call ``Sender.push(refit)`` at the same
  time). Returns this worker's stats, and ``mixed``: whether a failed refit
  left this worker with some layers new and some old (see
  :meth:`reshard.adapters.vllm.receiver.VllmReceiver.pull`; ``atomic``
  overrides the ``atomic`` init option for this refit).
- ``reshard_status()``, ``reshard_stats()``, ``reshard_close()``.

These methods never raise: they return ``{"ok": False, "error": ..., "step":
...}`` instead. vLLM 0.32's multiprocess executor stops reading worker
replies at the first worker that raised, so the next ``collective_rpc``
would get a stale reply; :mod:`reshard.adapters.vllm.driver` turns the
replies back into one :class:`reshard.RefitError`.

After a pull, reset the prefix cache (``LLM.reset_prefix_cache()`` or
``POST /reset_prefix_cache``): cached prefixes were computed with the old
weights. In a server, pause generation around it (``POST /pause?mode=keep``,
then ``POST /resume``).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["ReshardWorkerExtension", "config_from"]


def _reply(fn, *args) -> dict[str, Any]:
    """Run ``fn`` and return its result as ``{"ok": True, ...}``, or the error."""
    try:
        return {"ok": True, **fn(*args)}
    except BaseException as e:
        step = getattr(e, "step", None)
        errors = getattr(e, "errors", None)
        return {
            "ok": False,
            "error": str(e),
            "type": type(e).__name__,
            "step": step,
            "errors": {int(k): v for k, v in errors.items()} if errors else None,
        }


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


def config_from(config: str | dict) -> tuple[Any, dict]:
    """(GroupConfig, extra options) from a JSON string or dict."""
    from dataclasses import fields

    from reshard.transport.group import GroupConfig

    d = json.loads(config) if isinstance(config, str) else dict(config)
    extra = {k: d.pop(k) for k in ("engine_offset", "budget_bytes", "atomic") if k in d}
    known = {f.name for f in fields(GroupConfig)} - {"host_store"}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown reshard config keys {sorted(unknown)}; known: {sorted(known | set(extra))}")
    d.setdefault("host_store", False)
    return GroupConfig(**d), extra


class ReshardWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    # Provided by vLLM's worker, which this class is mixed into.
    rank: int
    model_runner: Any
    vllm_config: Any
    device: Any
    _reshard: Any

    def reshard_init(self, config: str | dict) -> dict[str, Any]:
        return _reply(self._reshard_init, config)

    def reshard_pull(
        self, refit: int | str, method: str = "reshard", atomic: bool | str | None = None
    ) -> dict[str, Any]:
        out = _reply(self._reshard_pull, refit, method, _flag(atomic))
        r = getattr(self, "_reshard", None)
        out["mixed"] = bool(r is not None and r.mixed)
        return out

    def reshard_status(self) -> dict[str, Any]:
        """``{"ready": joined, "mixed": a failed refit left old and new weights, "refit": last good refit}``."""
        r = getattr(self, "_reshard", None)
        if r is None:
            return {"ready": False, "mixed": False, "refit": 0}
        return {"ready": True, "mixed": r.mixed, "refit": r.receiver.session.last_refit}

    def _reshard_init(self, config: str | dict) -> dict[str, Any]:
        from reshard.adapters.vllm.receiver import VllmReceiver

        cfg, extra = config_from(config)
        old = getattr(self, "_reshard", None)
        if old is not None:
            old.close()
        rank = cfg.num_sources + int(extra.get("engine_offset", 0)) + int(self.rank)
        self._reshard = VllmReceiver(
            self.model_runner.model,
            self.vllm_config.model_config,
            config=cfg,
            rank=rank,
            device=self.device,
            budget_bytes=int(extra.get("budget_bytes", 256 << 20)),
            atomic=bool(_flag(extra.get("atomic", False))),
            vllm_config=self.vllm_config,
        )
        r = self._reshard
        return {
            "rank": rank,
            "pieces": len(r.learned.pieces),
            "params": len(r.learned.local_shapes),
            "kept_bytes": r.kept_bytes,
            "learn_seconds": r.learn_seconds,
        }

    def _reshard_pull(self, refit: int | str, method: str = "reshard", atomic: bool | None = None) -> dict[str, Any]:
        r = getattr(self, "_reshard", None)
        if r is None:
            raise RuntimeError("call reshard_init before reshard_pull")
        return r.pull(int(refit), method=method, atomic=atomic)

    def reshard_stats(self) -> dict[str, Any]:
        r = getattr(self, "_reshard", None)
        return dict(r.last_stats) if r is not None else {}

    def reshard_close(self) -> None:
        r = getattr(self, "_reshard", None)
        if r is not None:
            r.close()
            self._reshard = None
