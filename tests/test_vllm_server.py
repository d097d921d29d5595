"""Server mode: ``vllm serve`` with the worker extension, refit over HTTP by
the trainer (``Sender.push(n, engines=VllmEngines([url]))``), then a
completion on the new weights."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

from reshard import GroupConfig
from reshard.testing.tiny import build_tiny_model

from . import procs
from .support import HANG_S, group_config, wait_for
from .vllm_support import (
    MAX_TOKENS,
    PROMPTS,
    VllmServer,
    elastic_server_trainer,
    fresh_greedy_and_state,
    fsdp_trainer,
    plain_trainer,
    server_greedy,
    trainer_ready_key,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _complete(url: str, model: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    return server_greedy(url, [prompt], max_tokens)[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from reshard.adapters.vllm.driver import HttpEngine, engine_state

    root = tmp_path_factory.mktemp("server")
    v1 = build_tiny_model(root / "v1", "qwen2", seed=0)
    v2 = build_tiny_model(root / "v2", "qwen2", seed=7)
    srv = VllmServer(
        str(v1),
        tp=1,
        dtype="float32",
        log=str(root / "server.log"),
        # --enable-server-load-tracking: /load counts the requests the server
        # holds, so a test sees a request arrive while generation is paused.
        args=[
            "--worker-extension-cls",
            "reshard.adapters.vllm.ReshardWorkerExtension",
            "--enable-server-load-tracking",
        ],
    )
    try:
        # The server starts on v1: these are a fresh server's tokens on v1.
        tokens = {"v1": server_greedy(srv.url)}
        (state_v1,) = engine_state(HttpEngine(srv.url))
        yield {
            "url": srv.url,
            "model": str(v1),
            "v1": str(v1),
            "v2": str(v2),
            "tokens": tokens,
            "state_v1": state_v1,
        }
    finally:
        srv.close()


def test_http_refit_then_a_completion_on_the_new_weights(server):
    from reshard.adapters.core.state import compare_states
    from reshard.adapters.vllm.driver import HttpEngine, engine_state

    url, model = server["url"], server["model"]
    fresh = procs.check(procs.run(fresh_greedy_and_state, 1, server["v2"], timeout=300))[0]
    fresh_v2 = fresh["tokens"]
    before = [_complete(url, model, p) for p in PROMPTS]
    assert before != fresh_v2, "the two checkpoints must generate differently"

    store = procs.StoreServer()
    outs = procs.check(
        procs.run(fsdp_trainer, 2, store.address, procs.free_port(), server["v2"], 2, 1, 1, 0, "", url, timeout=300)
    )
    assert all(o["ok"] for o in outs), outs
    workers = outs[0]["engine_stats"]
    assert len(workers) == 1 and workers[0]["ok"]
    assert workers[0]["bytes_received"] == workers[0]["kept_bytes"]

    after = [_complete(url, model, p) for p in PROMPTS]
    assert after == fresh_v2
    # The server's whole state, read over HTTP, is a fresh engine's on v2.
    (ours,), (theirs,) = engine_state(HttpEngine(url)), fresh["state"]
    assert not compare_states(ours, theirs)


LONG = 100
STREAMED = 480


def _send_all(url: str, model: str, prompts: list[list[int]], done: dict, key: str) -> list[threading.Thread]:
    """Send each prompt from its own thread; results (or errors) land in ``done[key]``."""
    done[key] = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            done[key][i] = _complete(url, model, prompts[i], LONG)
        except Exception as e:
            done[key][i] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return threads


def _stream(url: str, model: str, prompt: list[int], max_tokens: int, started: threading.Event, out: dict) -> None:
    """A streamed completion: ``started`` is set at its first tokens, so the
    caller knows the request is generating; ``out`` gets all its tokens."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    req = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    tokens: list[int] = []
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    tokens.extend(choice.get("token_ids") or [])
                started.set()
        out["tokens"] = tokens
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        started.set()


def _running(url: str) -> int:
    """Requests the server's scheduler is running (its Prometheus gauge, as of
    its last step)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:num_requests_running"):
                return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError("the server publishes no vllm:num_requests_running gauge")


def _load(url: str) -> int:
    """Generation requests the server holds and has not answered (``/load``:
    counted from the moment its handler takes one until its answer is sent,
    whether or not the engine is paused)."""
    with urllib.request.urlopen(f"{url}/load", timeout=30) as r:
        return int(json.loads(r.read())["server_load"])


def _send_while_paused(url: str, model: str, prompt: list[int], done: dict, key: str) -> list[threading.Thread]:
    """Send ``prompt`` to a paused server and return once the server holds
    it: the server holds nothing else (``/load`` 0), then this one (1)."""
    assert _is_paused(url)
    wait_for(lambda: _load(url) == 0, HANG_S, "the server to answer every earlier request")
    threads = _send_all(url, model, [prompt], done, key)
    wait_for(lambda: _load(url) == 1, HANG_S, "the server to take the request")
    return threads


def _frozen_mid_generation(http, url: str, model: str, prompt: list[int]) -> tuple[threading.Thread, dict]:
    """A streamed request of STREAMED tokens, frozen mid-generation: once its
    first tokens arrived the server is paused in ``keep`` mode (caches kept,
    so nothing is preempted) and its scheduler must still run it. Whether it
    was still generating is read from the server, not guessed from timings:
    a request that finished first (a busy machine) is simply sent again."""
    for _ in range(30):
        started, out = threading.Event(), {}
        streaming = threading.Thread(target=_stream, args=(url, model, prompt, STREAMED, started, out), daemon=True)
        streaming.start()
        assert started.wait(timeout=HANG_S)
        http.pause("keep", clear_cache=False)
        if _running(url) == 1:
            return streaming, out
        http.resume()
        streaming.join(timeout=HANG_S)
    raise AssertionError("a streamed request finished before the server could be paused, 30 times")


def test_refit_while_requests_generate_pause_swap_resume(server):
    """vLLM 0.32 (the version run here; 0.33 rejects requests sent during a
    ``wait`` pause with HTTP 503, see docs/vllm.md "Versions"): a request
    generating when the refit starts finishes on the old weights (pause mode
    ``wait``); a request sent while paused waits, then runs on the new
    weights; none is dropped or corrupted."""
    from reshard.adapters.vllm.driver import HttpEngine, VllmEngines

    url, model = server["url"], server["model"]
    prompt, late_prompt = PROMPTS[0], PROMPTS[1]
    old = _complete(url, model, prompt, STREAMED)  # the weights the server has now (batch of one, as below)
    old_late = _complete(url, model, late_prompt, LONG)
    target = server["v1"]  # the first test left v2 in the server

    store = procs.StoreServer()
    cfg = group_config(store.address, 1, 1)
    engines = VllmEngines([url])
    engines.init(cfg)
    http = engines.engines[0]
    assert isinstance(http, HttpEngine)
    done: dict = {}
    trainer = threading.Thread(
        target=lambda: done.setdefault("trainer", procs.run(plain_trainer, 1, store.address, [target], 1, 1, 0)),
        daemon=True,
    )
    # Provably in flight when the refit begins: frozen mid-generation, then
    # released into a ``wait`` pause, which returns once it is done.
    streaming, early = _frozen_mid_generation(http, url, model, prompt)
    http.pause("wait")
    # Sent while paused: the server holds it, unanswered, until the refit resumes it.
    late = _send_while_paused(url, model, late_prompt, done, "late")
    assert done["late"] == [None], "requests must wait while the engine is paused"
    trainer.start()
    stats = engines.refit(1)  # pulls, resets the prefix cache, resumes
    for t in [*late, trainer, streaming]:
        t.join(timeout=HANG_S)
    assert procs.check(done["trainer"]) == [{"ok": True}]
    assert stats[0].ok

    assert "error" not in early, early
    assert early["tokens"] == old
    (late_tokens,) = done["late"]
    new = _complete(url, model, late_prompt, LONG)
    assert new != old_late
    assert late_tokens == new


def _is_paused(url: str) -> bool:
    with urllib.request.urlopen(f"{url}/is_paused", timeout=10) as r:
        return bool(json.loads(r.read())["is_paused"])


def test_a_server_left_with_mixed_weights_stays_paused_until_a_refit_succeeds(server):
    """Default mode, a trainer dies half way through: some layers already run
    on the new weights, so the driver leaves the server paused (requests wait,
    none is served on mixed weights) until the next refit succeeds."""
    from reshard.adapters.vllm.driver import VllmEngines
    from reshard.errors import MixedWeightsError

    url, model = server["url"], server["model"]
    store = procs.StoreServer()
    cfg = GroupConfig(address=store.address, num_sources=1, num_destinations=1, timeout_s=20, host_store=False)
    small = 64 << 10  # many rounds: the crash lands mid-transfer
    engines = VllmEngines([url], budget_bytes=small)
    engines.init(cfg)
    target = server["v2"]
    done: dict = {}
    crash = threading.Thread(
        target=lambda: done.setdefault(
            "crash", procs.run(plain_trainer, 1, store.address, [target], 1, 1, 0, small, 20, timeout=HANG_S)
        ),
        daemon=True,
    )
    crash.start()
    store.wait(trainer_ready_key(1, 0))
    with pytest.raises(MixedWeightsError, match="stays paused until a refit succeeds") as err:
        engines.refit(1)
    assert err.value.paused
    crash.join(timeout=HANG_S)
    assert done["crash"][0].exitcode == 3
    assert engines.mixed and _is_paused(url)

    # The server holds a request sent now, unanswered, until a refit succeeds.
    waiting = _send_while_paused(url, model, PROMPTS[0], done, "waiting")
    assert done["waiting"] == [None], "a paused server must not generate"

    # The next refit rebuilds the group by itself and resumes the server.
    good = threading.Thread(
        target=lambda: done.setdefault(
            "good", procs.run(plain_trainer, 1, store.address, [target], 1, 2, 0, small, timeout=HANG_S)
        ),
        daemon=True,
    )
    good.start()
    store.wait(trainer_ready_key(2, 0))
    engines.refit(2)
    good.join(timeout=HANG_S)
    assert procs.check(done["good"]) == [{"ok": True}]
    assert not engines.mixed and not _is_paused(url)
    for t in waiting:
        t.join(timeout=HANG_S)
    (result,) = done["waiting"]
    assert result == _complete(url, model, PROMPTS[0], LONG)


def _staging_started(http, refit: int) -> bool:
    """Whether every worker is staging ``refit`` (a worker that never started
    staging it answers with an error)."""
    from reshard.adapters.core.replies import WorkerReply

    replies = [WorkerReply.parse(r) for r in http.collective_rpc("reshard_staged", [str(refit)])]
    return all(r.ok for r in replies)


def test_two_phase_refit_serves_while_staging_and_pauses_only_to_apply(server):
    """Two-phase: while the workers receive (here, waiting for a trainer that
    has not started yet), the server is not paused and serves the old
    weights; a request streaming when the transfer ends finishes on the old
    weights; afterwards the server generates from the new ones."""
    from reshard.adapters.vllm.driver import VllmEngines

    url, model = server["url"], server["model"]
    prompt = PROMPTS[0]
    old = server_greedy(url)  # the previous test left v2 in the server
    server["tokens"]["v2"] = old
    old_streamed = _complete(url, model, prompt, STREAMED)
    store = procs.StoreServer()
    cfg = group_config(store.address, 1, 1)
    engines = VllmEngines([url], two_phase=True)
    engines.init(cfg)
    http = engines.engines[0]
    done: dict = {}

    def drive() -> None:
        try:
            done["replies"] = engines.refit(1)
        except Exception as e:
            done["error"] = e

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    wait_for(lambda: not driver.is_alive() or _staging_started(http, 1), HANG_S, "the workers to stage refit 1")
    assert driver.is_alive(), done
    assert not _is_paused(url)
    assert server_greedy(url) == old, "while staging, the server serves the old weights"

    started, streamed = threading.Event(), {}
    streaming = threading.Thread(target=_stream, args=(url, model, prompt, STREAMED, started, streamed), daemon=True)
    streaming.start()
    assert started.wait(timeout=HANG_S)
    trainer = threading.Thread(
        target=lambda: done.setdefault("trainer", procs.run(plain_trainer, 1, store.address, [server["v1"]], 1, 1, 0)),
        daemon=True,
    )
    trainer.start()
    for t in (driver, trainer, streaming):
        t.join(timeout=HANG_S)
    assert "error" not in done, done["error"]
    assert procs.check(done["trainer"]) == [{"ok": True}]
    (reply,) = done["replies"]
    assert reply.ok and reply.stats["staged"] and reply.stats["two_phase"]
    assert reply.stats["bytes_received"] == reply.stats["kept_bytes"]
    assert "error" not in streamed, streamed
    assert streamed["tokens"] == old_streamed, "a request in flight finishes on the old weights"
    assert not _is_paused(url)
    assert server_greedy(url) == server["tokens"]["v1"]


def test_a_failure_while_staging_leaves_the_serving_weights_untouched(server):
    """Two-phase: a trainer that dies mid-transfer fails the refit while the
    workers stage; the live weights were never touched, so the engine is not
    mixed, never paused, and keeps serving the old weights; the next refit
    works."""
    from reshard.adapters.vllm.driver import VllmEngines
    from reshard.errors import MixedWeightsError, RefitError

    url = server["url"]
    before = server_greedy(url)  # v1, from the previous test
    assert before == server["tokens"]["v1"]
    store = procs.StoreServer()
    cfg = GroupConfig(address=store.address, num_sources=1, num_destinations=1, timeout_s=20, host_store=False)
    small = 64 << 10  # many rounds: the crash lands mid-transfer
    engines = VllmEngines([url], budget_bytes=small, two_phase=True)
    engines.init(cfg)
    done: dict = {}
    crash = threading.Thread(
        target=lambda: done.setdefault(
            "crash", procs.run(plain_trainer, 1, store.address, [server["v2"]], 1, 1, 0, small, 20, timeout=HANG_S)
        ),
        daemon=True,
    )
    crash.start()
    store.wait(trainer_ready_key(1, 0))
    with pytest.raises(RefitError) as err:
        engines.refit(1)
    assert not isinstance(err.value, MixedWeightsError), err.value
    crash.join(timeout=HANG_S)
    assert done["crash"][0].exitcode == 3
    assert not engines.mixed and not _is_paused(url)
    assert server_greedy(url) == before

    good = threading.Thread(
        target=lambda: done.setdefault(
            "good", procs.run(plain_trainer, 1, store.address, [server["v2"]], 1, 2, 0, small, timeout=HANG_S)
        ),
        daemon=True,
    )
    good.start()
    store.wait(trainer_ready_key(2, 0))
    (reply,) = engines.refit(2)
    good.join(timeout=HANG_S)
    assert procs.check(done["good"]) == [{"ok": True}]
    assert reply.stats["staged"]
    assert server_greedy(url) == server["tokens"]["v2"]


def test_a_sleeping_server_wakes_its_weights_for_the_refit_and_serves_after_it(server):
    """A colocated engine sleeps while its trainer trains (vLLM's
    ``/sleep?level=1``): ``VllmEngines(sleeping=True)`` wakes its weights,
    refits them and wakes the KV cache, which resumes generation. On CPU,
    vLLM's worker keeps weights and cache resident through a sleep (only the
    engine's sleep state changes), so this checks the lifecycle and the
    tokens, not memory."""
    from reshard.adapters.vllm.driver import VllmEngines

    url = server["url"]
    store = procs.StoreServer()
    cfg = group_config(store.address, 1, 1)
    engines = VllmEngines([url], sleeping=True)
    engines.init(cfg)
    http = engines.engines[0]
    # Awake: a plain refit to v2.
    trainer = procs.spawn(plain_trainer, 0, store.address, [server["v2"], server["v1"]], 1, 1, 0)
    assert not http.is_sleeping()
    engines.refit(1)
    on_v2 = server_greedy(url)
    assert on_v2 != server["tokens"]["v1"]
    # Asleep during "training", then refit to v1 and woken.
    http.sleep(1)
    assert http.is_sleeping()
    stats = engines.refit(2)
    assert procs.check([trainer.outcome(HANG_S)]) == [{"ok": True}]
    assert stats[0].ok and stats[0].stats["bytes_received"] == stats[0].stats["kept_bytes"]
    assert not http.is_sleeping()
    assert server_greedy(url) == server["tokens"]["v1"]


DEAD_JOIN_S = 20.0
"""How long the first refit of an elastic group waits for a replica that
never joins (the dead server's): long enough for the live server's worker to
join on a busy machine, which it must do within it."""


def test_a_server_list_with_a_dead_url_refits_the_live_one_and_names_the_dead(server):
    """``VllmEngines([dead, live])`` in an elastic group (``min_replicas=1``):
    the URL nobody listens on does not fail the push; the live server (replica
    1: the dead one keeps replica 0's rank) is refit, twice, and ends equal to
    a fresh server on v1 in every tensor; each push names the dead URL in its
    ``missing_replicas``."""
    from reshard.adapters.core.state import compare_states
    from reshard.adapters.vllm.driver import HttpEngine, engine_state
    from reshard.testing.ports import free_port

    url, dead = server["url"], f"http://127.0.0.1:{free_port()}"
    store = procs.StoreServer()
    (pushes,) = procs.check(
        procs.run(
            elastic_server_trainer,
            1,
            store.address,
            [server["v2"], server["v1"]],
            [dead, url],
            DEAD_JOIN_S,
            timeout=HANG_S,
        )
    )
    assert len(pushes) == 2
    for push in pushes:
        assert push["replicas"] == [1], push
        assert list(push["missing"]) == [0], push
        assert f"engine server {dead} unreachable" in push["missing"][0]
        assert "Connection refused" in push["missing"][0]
        (worker,) = push["workers"]
        assert worker["ok"] and worker["rank"] == 2
        assert worker["bytes_received"] == worker["kept_bytes"] > 0
    assert "join_timeout_s" in pushes[0]["missing"][0]
    (ours,) = engine_state(HttpEngine(url))
    assert not compare_states(ours, server["state_v1"])
    assert server_greedy(url) == server["tokens"]["v1"]
