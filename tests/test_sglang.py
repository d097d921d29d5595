"""SGLang: layouts learned from SGLang's loaders, the in-worker hook, and real
SGLang 0.5.23 servers (CPU, their own venv with torch 2.14.1) refitted over
HTTP from FSDP2 trainer ranks of this venv (torch 2.13), over gloo.

The first tests need no SGLang: they run the layout recorder and the hook on
toy models with SGLang-style loaders. The engine tests need the SGLang venv
(``make sglang-setup``; ``$RESHARD_SGLANG_VENV`` points elsewhere); without
it they fail, unless ``RESHARD_SKIP_SGLANG=1`` says to skip them.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import msgspec
import pytest
import torch

from reshard.adapters.sglang import protocol
from reshard.adapters.sglang.layout import learn_layout
from reshard.errors import RefitError, ReshardError
from reshard.plan.box import Box
from reshard.plan.layout import TensorMeta

from . import procs
from .support import HANG_S, group_config

# -- toy models with SGLang-style loaders (no SGLang needed) ---------------------------

CKPT = {
    "q.weight": (8, 4),
    "k.weight": (4, 4),
    "v.weight": (4, 4),
    "embed.weight": (5, 4),
}
METAS = [TensorMeta(n, s, "float32") for n, s in CKPT.items()]


class Toy(torch.nn.Module):
    """TP rank 1 of 2 as SGLang's loaders lay it out: q/k/v rows stacked in
    one ``qkv`` parameter, the vocabulary (5) padded to 8 and split in two."""

    def __init__(self, *, mode: str = "") -> None:
        """``mode``: ``compute``, the loader doubles its shard of ``k``;
        ``constant``, it writes zeros, which no checkpoint tensor determines."""
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.full((8, 4), -1.0))
        self.embed = torch.nn.Parameter(torch.full((4, 4), -1.0))
        self.mode = mode

    def load_weights(self, weights) -> None:
        for name, w in weights:
            if name == "q.weight":
                self.qkv.data[0:4].copy_(w.narrow(0, 4, 4))
            elif name == "k.weight":
                k = w.narrow(0, 2, 2)
                if self.mode == "compute":
                    k = k * 2
                elif self.mode == "constant":
                    k = torch.zeros_like(k)
                self.qkv.data[4:6].copy_(k)
            elif name == "v.weight":
                self.qkv.data[6:8].copy_(w.narrow(0, 2, 2))
            elif name == "embed.weight":
                shard = w.narrow(0, 4, 1)
                self.embed[: shard.shape[0]].data.copy_(shard)
                self.embed[shard.shape[0] :].data.fill_(0)


def _checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in CKPT.items()}


def test_learned_layout_follows_the_loaders_and_writes_nothing():
    model = Toy()
    learned = learn_layout(model, METAS)
    assert not learned.unsupported and not learned.uncovered
    got = {(p.tensor.name, p.local): (p.box, p.offset) for p in learned.pieces}
    assert got == {
        ("q.weight", "qkv"): (Box((4, 0), (4, 4)), (0, 0)),
        ("k.weight", "qkv"): (Box((2, 0), (2, 4)), (4, 0)),
        ("v.weight", "qkv"): (Box((2, 0), (2, 4)), (6, 0)),
        ("embed.weight", "embed"): (Box((4, 0), (1, 4)), (0, 0)),
    }
    assert learned.zero_fill == {"embed": [Box((1, 0), (3, 4))]}
    # A dry run: the live parameters are untouched.
    assert torch.all(model.qkv == -1) and torch.all(model.embed == -1)


def test_a_loader_that_computes_goes_through_sglangs_loader():
    """The shard of ``k`` the loader doubles is fetched (that shard only) and
    handed to the model's own ``load_weights``; the rest stays plain."""
    learned = learn_layout(Toy(mode="compute"), METAS)
    assert not learned.problems()
    assert list(learned.via_loader) == ["k.weight"]
    via = learned.via_loader["k.weight"]
    assert via.params == ("qkv",) and via.region == Box((2, 0), (2, 4))
    assert {p.tensor.name for p in learned.pieces if p.local == "qkv"} == {"q.weight", "v.weight"}


def test_a_loader_no_checkpoint_tensor_determines_is_refused():
    from reshard.adapters.sglang.receiver import learn_checked

    learned = learn_layout(Toy(mode="constant"), METAS)
    assert any("qkv: written from a tensor no checkpoint tensor determines" in u for u in learned.unsupported)
    with pytest.raises(ReshardError, match="incomplete"):
        learn_checked(Toy(mode="constant"), METAS, rank=3)


def _hook_run(rank: int, address: str, mode: str, junk: bool) -> dict[str, Any]:
    """Rank 0: a trainer holding the checkpoint. Rank 1: an SGLang worker
    (TP rank 0 of 1) whose loader is called through the hook."""
    from reshard import Sender

    cfg = group_config(address, 1, 1)
    ckpt = _checkpoint(5)
    if rank == 0:
        sender = Sender(ckpt, config=cfg, rank=0)
        try:
            sender.push(1)
            return {"ok": True}
        except RefitError as e:
            return {"ok": False, "step": e.step, "error": str(e), "agreed": e.agreed}
        finally:
            sender.close()
    from reshard.adapters.core.spec import GroupSpec
    from reshard.adapters.sglang import hook
    from reshard.adapters.sglang import receiver as receiver_mod
    from reshard.adapters.sglang.driver import SglangEngine

    hook._parallel = lambda: (0, 1, 1)  # what SGLang's runtime context says in a TP=1 worker
    receiver_mod.canonical_tensors_of = lambda model: METAS
    model = Toy(mode=mode)
    if junk:
        hook.load(model, [("model.layers.0.whatever", torch.empty(0))])  # must not raise
    cmd = protocol.Command(op="pull", id="t1", group=GroupSpec.of(cfg), refit=1)
    hook.load(model, [(protocol.encode_command(cmd), torch.empty(0))])  # must not raise either way
    replies = SglangEngine("http://unused", tp_size=1)._replies(cmd, 1, wait_s=5)
    ref = Toy(mode=mode)
    ref.load_weights(ckpt.items())
    return {
        "replies": [msgspec.structs.asdict(r) for r in replies],
        "equal": torch.equal(model.qkv, ref.qkv) and torch.equal(model.embed, ref.embed),
    }


@pytest.mark.parametrize("mode", ["", "compute"], ids=["plain", "computing-loader"])
def test_hook_pulls_into_live_parameters_equal_to_the_loaders(mode):
    server = procs.StoreServer()
    trainer, engine = procs.check(procs.run(_hook_run, 2, server.address, mode, True, timeout=HANG_S))
    assert trainer["ok"], trainer
    [reply] = engine["replies"]
    assert reply["ok"] and reply["rank"] == 1, reply
    assert reply["stats"]["bytes_received"] == reply["stats"]["kept_bytes"] == (4 + 2 + 2 + 1) * 4 * 4
    assert reply["stats"]["loader_tensors"] == (1 if mode else 0)
    assert engine["equal"]


def test_hook_with_an_unlearnable_model_fails_the_plan_at_once_and_never_raises():
    server = procs.StoreServer()
    trainer, engine = procs.check(procs.run(_hook_run, 2, server.address, "constant", False, timeout=HANG_S))
    assert not trainer["ok"] and trainer["step"] == "plan", trainer
    # The trainer learns it from the worker's verdict at the plan step, not
    # from the group timeout: every rank reported.
    assert trainer["agreed"], trainer
    assert "cannot refit" in trainer["error"] and "incomplete" in trainer["error"]
    [reply] = engine["replies"]
    assert not reply["ok"] and "incomplete" in reply["error"] and not reply["mixed"]


def test_command_round_trip():
    from reshard import GroupConfig
    from reshard.adapters.core.spec import GroupSpec
    from reshard.adapters.sglang.driver import command_payload

    trainer_side = GroupConfig(
        address="h:1", num_sources=2, num_destinations=4, generation=3, domain="rack-7", token="secret"
    )
    group = GroupSpec.of(trainer_side, engine_offset=2)
    # Per-rank fields and the job token stay behind.
    assert (group.address, group.num_sources, group.generation, group.engine_offset) == ("h:1", 2, 3, 2)
    assert (group.domain, group.token) == (None, None)
    cmd = protocol.Command(op="pull", id="x", group=group)
    assert protocol.decode_command(protocol.encode_command(cmd)) == cmd
    worker_side = group.config()
    assert (worker_side.generation, worker_side.host_store, worker_side.domain) == (3, False, None)
    assert command_payload(cmd)  # base64 text
    with pytest.raises(ValueError, match="not a reshard command"):
        protocol.decode_command("model.embed_tokens.weight")


class FakeSglang:
    """SGLang's weight-update HTTP routes, with workers that reply as told:
    checks the driver's call sequence and its pause / resume decisions."""

    def __init__(self, tp: int, outcome: str) -> None:
        import http.server

        self.calls: list[str] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, code: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                self._send(200, {"tp_size": tp, "pp_size": 1, "dp_size": 1})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                fake.calls.append(self.path.strip("/"))
                if self.path == "/update_weights_from_tensor":
                    assert body["load_format"] == "reshard.adapters.sglang.hook.load"
                    assert len(body["serialized_named_tensors"]) == tp
                    fake.workers(body["serialized_named_tensors"])
                self._send(200, {"success": True, "message": "Success"})

        self.tp = tp
        self.outcome = outcome
        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def workers(self, payloads: list[str]) -> None:
        import base64
        import pickle

        from reshard.adapters.core.replies import WorkerReply
        from reshard.adapters.sglang import hook

        for tp_rank, payload in enumerate(payloads):
            if self.outcome == "silent" and tp_rank == 1:
                continue  # a worker that died
            [(name, _)] = pickle.loads(base64.b64decode(payload))  # test-only: our own payload
            cmd = protocol.decode_command(name)
            rank = cmd.group.rank_of(tp_rank)
            ok = self.outcome in ("ok", "silent")
            reply = WorkerReply(
                id=cmd.id,
                rank=rank,
                tp_rank=tp_rank,
                ok=ok,
                error="" if ok else "boom",
                step=None if ok else ("plan" if self.outcome == "plan" else "transfer"),
                errors=None if ok else {rank: "boom"},
                mixed=self.outcome == "mixed",
            )
            hook._post(cmd.group, reply)

    def close(self) -> None:
        self.http.shutdown()


@pytest.mark.parametrize("outcome", ["ok", "plan", "mixed", "silent"])
def test_driver_sequence_and_pause_decisions(outcome):
    from reshard import GroupConfig
    from reshard.adapters.sglang import MixedWeightsError, SglangEngine, SglangEngines
    from reshard.sender.engines import Engines

    assert isinstance(SglangEngines("http://x"), Engines)

    store = procs.StoreServer()
    fake = FakeSglang(2, outcome)
    cfg = GroupConfig(address=store.address, num_sources=2, num_destinations=2, host_store=False, timeout_s=10)
    engine = SglangEngine(fake.url)
    try:
        if outcome == "ok":
            replies = engine.refit(1, cfg)
            assert [r.tp_rank for r in replies] == [0, 1] and all(r.ok for r in replies)
        elif outcome == "plan":
            with pytest.raises(RefitError) as e:
                engine.refit(1, cfg)
            assert not isinstance(e.value, MixedWeightsError) and e.value.step == "plan"
        else:
            with pytest.raises(MixedWeightsError) as e:
                engine.refit(1, cfg)
            assert e.value.paused and engine.paused
            assert fake.calls[-1] == "end_weight_update"
            engine.resume()
        done = ["pause_generation", "begin_weight_update", "update_weights_from_tensor", "end_weight_update"]
        assert fake.calls == [*done, "continue_generation"]
        assert not engine.paused
    finally:
        fake.close()


# -- real SGLang servers ------------------------------------------------------------------

CONFIGS = [("qwen2", 1), ("qwen2", 2), ("llama", 1)]
"""qwen2: GQA (2 KV heads), qkv bias, vocabulary 500 padded to 512, untied.
llama: one KV head, tied embeddings (TP=1 only: SGLang on CPU needs TP to
divide the KV heads)."""
FULL = ("qwen2", 1)
"""The configuration that also runs the mismatch and live-traffic checks."""


LIVE = 300
"""Tokens of the request in flight during a refit."""


def _frozen_mid_generation(server, prompt: list[int]) -> tuple[threading.Thread, dict[str, Any]]:
    """A streamed request of LIVE tokens, frozen mid-generation: once its
    first tokens arrived the server is paused in place (nothing runs,
    nothing is retracted) and its scheduler must still count it running. A
    refit's own pause then retracts it, and the refit's resume lets it
    finish. Whether it was still generating is read from the server, not
    guessed from timings: a request that finished first (a busy machine) is
    simply sent again."""
    for _ in range(30):
        started, out = threading.Event(), {}
        streaming = threading.Thread(target=server.stream, args=(prompt, LIVE, started, out), daemon=True)
        streaming.start()
        assert started.wait(timeout=HANG_S)
        server.pause("in_place")
        if server.running() == 1:
            return streaming, out
        server.resume()
        streaming.join(timeout=HANG_S)
    raise AssertionError("a streamed request finished before the server could be paused, 30 times")


def _scenario(server, trainers, kind: str, tp: int, v1, v2) -> dict[str, Any]:
    from .sglang_support import refit_with_trainers

    out: dict[str, Any] = {"tp": tp}
    out["before"] = server.generate()
    out["cs_v1"] = server.checksums()
    if (kind, tp) == FULL:
        # A request in flight when the refit starts (provably: frozen
        # mid-generation), retracted by its pause, finished after it.
        streaming, live = _frozen_mid_generation(server, [7, 8, 9])
    store = procs.StoreServer()
    out["refit"] = refit_with_trainers(server, trainers, store.address, v2, refit=1, generation=0)
    if (kind, tp) == FULL:
        streaming.join(timeout=HANG_S)
        out["live"] = live
    out["after"] = server.generate()
    out["cs_refit"] = server.checksums()
    if (kind, tp) == FULL:
        for gen, mutate in ((1, "shape"), (2, "missing")):
            m = refit_with_trainers(server, trainers, store.address, v2, refit=2, generation=gen, mutate=mutate)
            m["after"] = server.generate()
            m["cs"] = server.checksums()
            out[f"mismatch_{mutate}"] = m
    # Back to v1, in one call on trainer rank 0: Sender.push(engines=SglangEngines([url])).
    out["back"] = refit_with_trainers(server, trainers, store.address, v1, refit=2, generation=3, trainer_drives=True)
    out["back_tokens"] = server.generate()
    out["cs_back"] = server.checksums()
    server.load_from_disk(v2)
    out["cs_disk_v2"] = server.checksums()
    out["disk_v2_tokens"] = server.generate()
    return out


@pytest.fixture(scope="module")
def runs(sglang_python, tmp_path_factory) -> dict[tuple[str, int], dict[str, Any]]:
    """Every configuration's scenario; at most two servers alive at a time
    (the next one starts while the current one is being refitted)."""
    from reshard.testing.tiny import build_tiny_model

    from .sglang_support import Server, Trainers

    root = tmp_path_factory.mktemp("sglang")
    models = {}
    for kind in sorted({k for k, _ in CONFIGS}):
        models[kind] = tuple(build_tiny_model(root / kind / v, kind, seed=seed) for v, seed in (("v1", 0), ("v2", 7)))

    def start(i: int) -> Server:
        kind, tp = CONFIGS[i]
        return Server(sglang_python, models[kind][0], tp=tp, port=procs.free_port(), log=root / f"{kind}-tp{tp}.log")

    trainers = Trainers(2)
    servers: dict[int, Server] = {0: start(0), 1: start(1)}
    out: dict[tuple[str, int], dict[str, Any]] = {}
    try:
        for i, (kind, tp) in enumerate(CONFIGS):
            server = servers[i]
            server.wait_ready()
            try:
                out[(kind, tp)] = _scenario(server, trainers, kind, tp, *models[kind])
            except Exception as e:
                raise AssertionError(f"{kind} tp={tp}: {e}\n--- server log ---\n{server.log_tail()}") from e
            server.stop()
            if i + 2 < len(CONFIGS):
                servers[i + 2] = start(i + 2)
    finally:
        for s in servers.values():
            s.stop()
        trainers.close()
    return out


@pytest.fixture(params=CONFIGS, ids=[f"{k}-tp{t}" for k, t in CONFIGS])
def run(request, runs):
    return runs[request.param]


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.sglang
def test_refit_from_fsdp2_equals_sglangs_own_load_weights(run):
    r = run["refit"]
    assert r["error"] is None, r["error"]
    assert all(t["ok"] for t in r["trainers"]), r["trainers"]
    assert not r["paused"]
    # Every parameter of every TP rank, by SGLang's own checksum, equals what
    # SGLang's load_weights makes of the same checkpoint.
    assert run["cs_refit"] == run["cs_disk_v2"]
    assert run["cs_refit"] != run["cs_v1"]
    assert len(run["cs_refit"]) == run["tp"]
    # ... and after the refit back (driven by trainer rank 0), what a fresh engine loaded at startup.
    assert run["back"]["error"] is None, run["back"]["error"]
    assert [r["tp_rank"] for r in run["back"]["replies"]] == list(range(run["tp"]))
    assert run["cs_back"] == run["cs_v1"]


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.sglang
def test_greedy_tokens_equal_a_fresh_engines(run):
    assert run["before"] != run["after"], "the two checkpoints must generate differently"
    # Refitted back to v1 from FSDP2: the tokens of the fresh engine on v1.
    assert run["back_tokens"] == run["before"]
    # Refitted to v2: the tokens of SGLang's own reload of v2.
    assert run["after"] == run["disk_v2_tokens"]


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.sglang
def test_each_engine_rank_receives_only_what_it_keeps(run):
    replies = run["refit"]["replies"]
    assert [r["tp_rank"] for r in replies] == list(range(run["tp"]))
    for r in replies:
        assert r["stats"]["bytes_received"] == r["stats"]["kept_bytes"] > 0
    total = sum(t["sent"] for t in run["refit"]["trainers"])
    if run["tp"] == 2:
        assert all(r["stats"]["bytes_received"] < 0.6 * total for r in replies)
    else:
        assert replies[0]["stats"]["bytes_received"] == total


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.parametrize("mutate", ["shape", "missing"])
def test_mismatched_trainer_fails_before_any_byte_moves_and_old_weights_stay(runs, mutate):
    run = runs[FULL]
    m = run[f"mismatch_{mutate}"]
    assert isinstance(m["error"], RefitError), m["error"]
    assert m["error"].step == "plan"
    for t in m["trainers"]:
        assert not t["ok"] and t["step"] == "plan", t
    needle = "model.norm.weight" if mutate == "shape" else "published by no source"
    assert needle in str(m["error"])
    assert not m["paused"], "a refit refused before any byte moved resumes generation"
    assert m["cs"] == run["cs_refit"]
    assert m["after"] == run["after"]


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.sglang
def test_requests_in_flight_are_retracted_and_finish(runs):
    run = runs[FULL]
    assert run["refit"]["error"] is None
    live = run["live"]
    assert "error" not in live, live
    assert len(live["tokens"]) == LIVE
    # SGLang's own count: the refit's pause retracted the request it froze.
    assert live["meta_info"]["num_retractions"] >= 1, live["meta_info"]
