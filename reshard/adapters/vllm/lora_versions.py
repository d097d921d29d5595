"""How long a version of an adapter refit by reshard lives on a vLLM worker.

Each refit of adapter ``name`` is a version, ``reshard://<name>/<refit>``
(:mod:`reshard.adapters.vllm.lora`). vLLM knows a version only by that path:
its worker's LoRA manager loads it from this worker's store
(:class:`WorkerAdapters`) whenever a step needs it and its LRU cache does not
hold it (``max_cpu_loras``; vLLM's own ``remove_lora`` or a LoRA reset after a
base-weight refit empties that cache too). A version missing from the store
when a step needs it kills the engine (vLLM 0.32 raises
``LoRAAdapterNotFoundError`` inside the step), so the store is what keeps a
version alive, and a version leaves it only when no request names it.

Who names it is the scheduler's to say, not the worker's (a waiting request
has never reached a worker): the engine core appends the LoRA path of every
request it holds, waiting, running or preempted, to reshard's calls that
retire versions (:data:`REPORTED`; :func:`install_core_report`, a patch of
the engine core's ``collective_rpc``), which it runs between two steps, so
no step runs between the report and the drop. A worker that gets no report
drops nothing.

Versions kept are bounded: a refit that would leave a worker more than
``max_versions`` versions of one adapter is refused on every rank before
any byte moves (:meth:`WorkerAdapters.room`), naming the requests that hold
the old ones. What each worker holds is reported (:meth:`WorkerAdapters.report`).
"""

from __future__ import annotations

import json
import sys
import weakref
from typing import Any

from reshard.errors import ReshardError

__all__ = [
    "REPORTED",
    "RETIRE",
    "SCHEME",
    "STAGE",
    "WorkerAdapters",
    "install_core_report",
    "lora_path",
    "presliced",
    "requests_by_version",
    "version_name",
]

SCHEME = "reshard://"

RETIRE = "reshard_lora_retire"
STAGE = "reshard_lora_stage"
REPORTED = frozenset({RETIRE, STAGE})
"""The worker methods (each retires versions first) the engine core appends
its requests' LoRA paths to."""


def lora_path(name: str, version: int) -> str:
    """The path vLLM knows version ``version`` of adapter ``name`` by."""
    return f"{SCHEME}{name}/{version}"


def version_name(name: str, version: int) -> str:
    """The LoRA name of a version (one per version: vLLM 0.32 batches LoRA
    requests by name, and two ids under one name in a batch kill the engine)."""
    return f"{name}@{version}"


def _split(path: str) -> tuple[str, int]:
    """``reshard://name/7`` -> ``("name", 7)``."""
    name, _, refit = path.removeprefix(SCHEME).rpartition("/")
    return name, int(refit)


# -- the engine core's report ---------------------------------------------------------


def requests_by_version(scheduler: Any) -> dict[str, list[str]]:
    """For every ``reshard://`` path a request held by ``scheduler`` (a vLLM
    v1 scheduler: ``requests`` holds every request not yet freed, waiting,
    running or preempted) names, the ids of those requests."""
    out: dict[str, list[str]] = {}
    for req_id, req in list(getattr(scheduler, "requests", {}).items()):
        lora = getattr(req, "lora_request", None)
        path = str(getattr(lora, "lora_path", "") or "")
        if path.startswith(SCHEME):
            out.setdefault(path, []).append(str(req_id))
    return out


def install_core_report() -> bool:
    """Make vLLM's engine core (this process's ``EngineCore`` class) append
    its scheduler's :func:`requests_by_version`, as JSON, to the arguments of
    every call of a :data:`REPORTED` method it passes to its workers.

    The defect it answers: vLLM 0.32 tells nobody which adapters live
    requests use (``remove_lora`` removes an adapter a request still runs
    on; harmless for a directory, which the next step reloads, fatal for a
    version that no longer exists). The engine core runs utility calls
    between steps, so the report holds until the workers answer. Called by
    reshard's vLLM plugin in every process (it acts where the engine core
    is loaded) and by the driver for engines in its own process; returns
    whether the patch is in place."""
    core = sys.modules.get("vllm.v1.engine.core")
    cls = getattr(core, "EngineCore", None)
    if cls is None:
        return False
    if getattr(cls.collective_rpc, "reshard_reports_loras", False):
        return True
    original = cls.collective_rpc

    def collective_rpc(self: Any, method: Any, timeout: float | None = None, args: Any = (), kwargs: Any = None):
        if method in REPORTED and getattr(self, "scheduler", None) is not None:
            args = (*args, json.dumps(requests_by_version(self.scheduler)))
        return original(self, method, timeout, args, kwargs)

    collective_rpc.reshard_reports_loras = True  # type: ignore[attr-defined]
    collective_rpc.__doc__ = original.__doc__
    cls.collective_rpc = collective_rpc
    return True


# -- the worker's store ---------------------------------------------------------------


class WorkerAdapters:
    """One vLLM worker's adapters refit by reshard: the store of versions its
    LoRA manager loads ``reshard://`` paths from, a receiver per adapter, and
    what the engine core last reported about who uses which version."""

    def __init__(self, runner: Any) -> None:
        wm = getattr(runner, "lora_manager", None)
        if wm is None or not hasattr(wm, "_adapter_manager"):
            raise ReshardError("this vLLM engine runs without LoRA: start it with enable_lora=True (--enable-lora)")
        self.wm = wm
        self.mgr = wm._adapter_manager
        self.store: dict[str, Any] = {}
        self.receivers: dict[str, Any] = {}
        """Per adapter, its receiver on this worker (``lora.AdapterReceiver``,
        which builds on this module: not imported here)."""
        self.loads = 0
        """Versions vLLM loaded from the store (a version evicted and used again loads again)."""
        self.ids: dict[str, set[int]] = {}
        """The vLLM ids each version was loaded under (a server numbers its own)."""
        self.users: dict[str, list[str]] | None = None
        """The engine core's last report: path -> ids of the requests naming it."""
        self.kept: dict[str, list[str]] = {}
        """Per adapter, the versions its driver hands out (never retired)."""
        self._alive: dict[str, weakref.ref] = {}
        self._install()

    def _install(self) -> None:
        """Patch this worker's LoRA manager (its instance only, once)."""
        if getattr(self.wm, "_reshard_adapters", None) is not None:
            self.wm._reshard_adapters = self
            return
        wm, mgr = self.wm, self.mgr
        original_load = wm._load_adapter
        original_activate = mgr.activate_adapter

        def load_adapter(request: Any) -> Any:
            path = str(getattr(request, "lora_path", "") or "")
            if not path.startswith(SCHEME):
                return original_load(request)
            owner = wm._reshard_adapters
            model = owner.store.get(path)
            if model is None:
                from vllm.exceptions import LoRAAdapterNotFoundError

                raise LoRAAdapterNotFoundError(request.lora_name, path)
            owner.loads += 1
            owner.ids.setdefault(path, set()).add(int(request.lora_int_id))
            return model if model.id == request.lora_int_id else model.clone(request.lora_int_id)

        def activate_adapter(lora_id: int) -> bool:
            model = mgr._registered_adapters.cache.get(lora_id)
            if not isinstance(model, presliced()):
                return original_activate(lora_id)
            # Its tensors are this worker's slices already: set_lora must not cut them again.
            for m in mgr.modules.values():
                m.slice_lora_a = _same
                m.slice_lora_b = _same
            try:
                return original_activate(lora_id)
            finally:
                for m in mgr.modules.values():
                    del m.slice_lora_a
                    del m.slice_lora_b

        wm._load_adapter = load_adapter
        mgr.activate_adapter = activate_adapter
        wm._reshard_adapters = self

    def add(self, path: str, model: Any) -> None:
        """Keep version ``path`` (a built ``LoRAModel``) loadable."""
        self.store[path] = model
        self.ids.setdefault(path, set()).add(int(model.id))
        first = next(iter(_tensors(model)), None)
        if first is not None:
            self._alive[path] = weakref.ref(first)

    def versions(self, name: str) -> list[str]:
        """The paths of adapter ``name``'s versions in the store, oldest first."""
        return sorted((p for p in self.store if _split(p)[0] == name), key=lambda p: _split(p)[1])

    def retire(self, name: str, keep: list[str], users: dict[str, list[str]] | None) -> dict[str, Any]:
        """Drop every version of adapter ``name`` that is not in ``keep`` and
        that no request names (``users``: the engine core's report, taken
        between the same two steps as this call; ``None``: no report, so
        nothing is dropped), from the store and from vLLM's LoRA cache, so
        nothing holds its tensors any more. Returns :meth:`report`, with the
        versions dropped."""
        self.kept[name] = list(keep)
        dropped: list[str] = []
        if users is not None:
            self.users = {str(p): [str(i) for i in ids] for p, ids in users.items()}
            for path in self.versions(name):
                if path in keep or path in self.users:
                    continue
                self.store.pop(path)
                for lora_id in sorted(self.ids.pop(path, ())):
                    self.wm.remove_adapter(lora_id)
                dropped.append(version_name(*_split(path)))
        return {"dropped": dropped, "reported": users is not None, **self.report(name)}

    def report(self, name: str) -> dict[str, Any]:
        """What this worker holds of adapter ``name``: its versions, their
        bytes, the requests that hold versions its driver no longer hands
        out, and every version whose tensors are still alive in this process
        (held by the store, vLLM's cache or anything else)."""
        paths = self.versions(name)
        users = self.users or {}
        keep = self.kept.get(name, [])
        for path, ref in list(self._alive.items()):
            if ref() is None:
                del self._alive[path]
        return {
            "versions": [version_name(*_split(p)) for p in paths],
            "versions_bytes": sum(_nbytes(self.store[p]) for p in paths),
            "held": {version_name(*_split(p)): users[p] for p in paths if p not in keep and p in users},
            "alive": [version_name(*_split(p)) for p in sorted(self._alive, key=_sort_key) if _split(p)[0] == name],
        }

    def room(self, name: str, max_versions: int, refit: int) -> str | None:
        """Why this worker cannot take version ``refit`` of adapter ``name``
        without holding more than ``max_versions`` versions of it (``None``:
        it can)."""
        paths = self.versions(name)
        if len(paths) < max_versions:
            return None
        keep = self.kept.get(name, [])
        users = self.users
        held = []
        for p in paths:
            ids = (users or {}).get(p, [])
            if p in keep:
                why = f"one of the {len(keep)} newest, handed out to new requests (keep={len(keep)})"
            elif ids:
                shown = ", ".join(repr(i) for i in ids[:4]) + (f" and {len(ids) - 4} more" if len(ids) > 4 else "")
                why = f"named by request(s) {shown}"
            elif users is None:
                why = "the engine core never reported which requests use it (is reshard's vLLM plugin loaded there?)"
            else:
                why = "no request named it at the last retire; freed at the next one"
            held.append(f"{version_name(*_split(p))} ({why})")
        each = _nbytes(self.store[paths[-1]])
        return (
            f"adapter {name!r} holds {len(paths)} versions on this worker, at most max_versions={max_versions}: "
            + "; ".join(held)
            + f". Version {version_name(name, refit)} would exceed that, so nothing was received and "
            f"{version_name(*_split(paths[-1]))} keeps serving. Retry once those requests finish (or abort "
            f"them), or raise max_versions (a version takes {each} bytes here)"
        )

    def close(self) -> None:
        for r in self.receivers.values():
            r.close()
        self.receivers.clear()


def _sort_key(path: str) -> tuple[str, int]:
    return _split(path)


def _same(x: Any) -> Any:
    return x


def _tensors(model: Any) -> list[Any]:
    """Every factor tensor of a vLLM ``LoRAModel`` (packed layers hold lists)."""
    out: list[Any] = []
    for lora in model.loras.values():
        for t in (lora.lora_a, lora.lora_b):
            out.extend(x for x in (t if isinstance(t, list | tuple) else [t]) if x is not None)
    return out


def _nbytes(model: Any) -> int:
    return sum(t.nbytes for t in _tensors(model))


_PRESLICED: list[type] = []


def presliced() -> type:
    """vLLM's ``LoRAModel``, marked as holding one worker's slices."""
    if not _PRESLICED:
        from vllm.lora.lora_model import LoRAModel

        class PreslicedLoRAModel(LoRAModel):
            """A LoRA model whose tensors are already this worker's slices."""

        _PRESLICED.append(PreslicedLoRAModel)
    return _PRESLICED[0]
