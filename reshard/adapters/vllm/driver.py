"""Driving the worker extension from an RL driver (``LLM`` or anything with
``collective_rpc``), raising one clear error when any worker failed."""

from __future__ import annotations

import json
from typing import Any

from reshard.errors import RefitError, ReshardError

__all__ = ["init_workers", "pull_workers"]


def _check(replies: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
    bad = [r for r in replies if not r.get("ok")]
    if not bad:
        return replies
    first = bad[0]
    if first.get("step") and first.get("errors"):
        errors: dict[int, str] = {}
        for r in bad:
            errors.update({int(k): v for k, v in (r.get("errors") or {}).items()})
        raise RefitError(first["step"], errors)
    raise ReshardError(f"{what} failed on {len(bad)} worker(s): " + "; ".join(r["error"] for r in bad))


def init_workers(engine, config: dict[str, Any]) -> list[dict[str, Any]]:
    """``reshard_init`` on every worker of ``engine``; returns their summaries."""
    return _check(engine.collective_rpc("reshard_init", args=(json.dumps(config),)), "reshard_init")


def pull_workers(engine, refit: int, *, method: str = "reshard") -> list[dict[str, Any]]:
    """``reshard_pull`` on every worker (trainer ranks push at the same time)."""
    return _check(engine.collective_rpc("reshard_pull", args=(refit, method)), "reshard_pull")
