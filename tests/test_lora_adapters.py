"""Adapter-only refits into a real vLLM engine's LoRA slots (``enable_lora``),
TP=1 and TP=2, bfloat16.

One trainer process holds two PEFT policies on the same base (adapters
``alpha`` and ``beta``: r=8 on every linear layer, different seeds), each
with a ``Sender(LoraAdapter(model))`` in a refit group of its own; one
process owns the engine and drives a ``VllmAdapters`` per adapter. The
adapters are refit in turn (alpha 1, beta 1, alpha 2, beta 2), the trainer
changing its factors between refits and saving each version with PEFT's
``save_pretrained``. After every refit:

- the new version's ``LoRARequest`` generates the tokens the same engine
  generates with that version loaded from PEFT's files (vLLM's own loader),
  and every tensor of its LoRA slot (each stacked A, B) on every worker
  equals the slot vLLM's loader filled from those files;
- every worker received exactly the slices its LoRA layers keep (bytes
  landed == bytes kept; at TP=2 a worker keeps less than the whole adapter),
  and no file was written on the engine side;
- the previous version still generates its own tokens (requests that started
  before a swap keep their version), each version under its own name, so
  vLLM's prefix cache (keyed by name and path) never serves another
  version's KV: each version's tokens are taken after the previous version
  generated for the same prompts, with prefix caching on.

Then, in the same engine, a third adapter (``held``, ``keep=2``,
``max_versions=4``) is refit five times while two long requests stream on
its first two versions (the test steps the engine itself, so which request
runs when is fixed, never a race): the request on version 1 runs across
three refits and the one on version 2 across two, both finish with their
version's tokens (those of the same engine with that version loaded from
PEFT's files), each refit's new requests get the newest version, and the
engine keeps generating while a refit is received (a trainer that waits
for the engine's word before it pushes: the engine steps in between). A
fifth version would take a fifth slot: the refit is refused on every rank
before any byte moves, naming both requests, and the fourth keeps serving;
once they finished, the refit goes through and every older version's
tensors are released on every worker.

And on a server, requests keep running while versions are refit in: every
answer is the version it named, as the same server answers with that
version loaded from its files.
"""

from __future__ import annotations

import os

import pytest

from . import procs
from .support import group_config, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.slow]

LORA = dict(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
NAMES = ("alpha", "beta")


def _policy(path: str, seed: int):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), LoraConfig(**LORA))
    _train(model, seed)
    return model


def _train(model, seed: int) -> None:
    """A stand-in for an optimizer step: new seeded values in every factor."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * (0.05 if ".lora_B." in n else 0.3))


LONG = 100
"""Tokens of the requests that stream across refits (the test takes about 60 steps with them)."""


def _store(address: str):
    import datetime

    from torch.distributed import TCPStore

    host, port = address.rsplit(":", 1)
    return TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=procs.GROUP_TIMEOUT_S))


def _trainer(address: str, path: str, root: str, tp: int) -> dict:
    from reshard import Sender
    from reshard.errors import RefitError
    from reshard.sender.lora_adapter import LoraAdapter

    policies = {name: _policy(path, seed) for seed, name in enumerate(NAMES)}
    senders = {
        name: Sender(LoraAdapter(model), config=group_config(address, 1, tp, job=name), rank=0)
        for name, model in policies.items()
    }
    sent = []
    for step in (1, 2):
        for i, name in enumerate(NAMES):
            if step > 1:
                _train(policies[name], 100 * step + i)
            policies[name].save_pretrained(os.path.join(root, f"{name}-{step}"))
            sent.append(senders[name].push(step).exec.bytes_sent)
    published = {name: sorted(t.name for t in s.layout.tensors) for name, s in senders.items()}
    for s in senders.values():
        s.close()
    # The held adapter: versions 1-5; 3 only once the engine says so; 5 is refused once.
    policy = _policy(path, 7)
    sender = Sender(LoraAdapter(policy), config=group_config(address, 1, tp, job="held"), rank=0)
    refused = None
    for v in range(1, 6):
        if v > 1:
            _train(policy, 700 + v)
        policy.save_pretrained(os.path.join(root, f"held-{v}"))
        if v == 3:
            _store(address).wait(["held/push/3"])
        if v == 5:
            try:
                sender.push(v)
            except RefitError as e:
                refused = {"step": e.step, "error": str(e)}
        sender.push(v)
    sender.close()
    return {"sent": sent, "published": published, "refused": refused}


def _engine(address: str, path: str, root: str, tp: int) -> dict:
    from vllm.lora.request import LoRARequest

    from reshard.adapters.vllm.adapters import VllmAdapters
    from reshard.sender.lora_adapter import AdapterSpec
    from reshard.testing.engines import greedy, offline_llm, shutdown

    from .vllm_support import lora_slot_digests

    # Three slots: two requests on old versions of ``held`` beside one on its newest.
    llm = offline_llm(path, tp, dtype="bfloat16", enable_lora=True, max_loras=3, max_lora_rank=8, max_cpu_loras=3)
    out: dict = {"refits": []}
    try:
        specs = {name: AdapterSpec.parse(_spec(path)) for name in NAMES}
        drivers = {name: VllmAdapters([llm], name, specs[name]) for name in NAMES}
        for name, d in drivers.items():
            d.init(group_config(address, 1, tp, job=name))
        disk_id = 900
        for step in (1, 2):
            for name in NAMES:
                d = drivers[name]
                replies = d.refit(step)
                disk_id += 1
                disk = LoRARequest(f"disk-{name}-{step}", disk_id, os.path.join(root, f"{name}-{step}"))
                row = {
                    "name": name,
                    "step": step,
                    "ours": greedy(llm, lora_request=d.request()),
                    "disk": greedy(llm, lora_request=disk),
                    "received": [int(r.stats["bytes_received"]) for r in replies],
                    "landed": [int(r.stats["bytes_landed"]) for r in replies],
                    "kept": [int(r.stats["kept_bytes"]) for r in replies],
                    "lora_name": d.request().lora_name,
                }
                # Both versions sit in LoRA slots now: what each
                # worker holds for ours, tensor by tensor, against the files' one.
                slots = llm.collective_rpc(lora_slot_digests, args=([d.request().lora_int_id, disk_id],))
                row["slots"] = [(s[d.request().lora_int_id], s[disk_id]) for s in slots]
                if step > 1:
                    prev = LoRARequest(f"{name}@{step - 1}", d.versions[0][1], f"reshard://{name}/{step - 1}")
                    row["previous"] = greedy(llm, lora_request=prev)
                out["refits"].append(row)
        out["base"] = greedy(llm)
        out["held"] = _held(llm, address, path, root, tp)
        out["engine_files"] = sorted(os.listdir(root))
    finally:
        shutdown(llm)
    return out


class _Steps:
    """Requests the test steps the engine for itself (``LLM.generate`` would
    run every request in the engine to its end)."""

    def __init__(self, llm) -> None:
        self.engine = llm.llm_engine
        self.tokens: dict[str, list[int]] = {}
        self.done: set[str] = set()
        self.steps = 0

    def add(self, rid: str, prompt: list[int], lora, max_tokens: int = 12) -> None:
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.engine.add_request(rid, {"prompt_token_ids": prompt}, sp, lora_request=lora)
        self.tokens[rid] = []

    def step(self) -> None:
        self.steps += 1
        for o in self.engine.step():
            self.tokens[o.request_id] = list(o.outputs[0].token_ids)
            if o.finished:
                self.done.add(o.request_id)

    def finish(self, *rids: str) -> None:
        """Step until ``rids`` finished (each step moves every running request on)."""
        while not self.done.issuperset(rids):
            assert self.steps < 2000, f"{rids} never finished"
            self.step()


def _held(llm, address: str, path: str, root: str, tp: int) -> dict:
    """Adapter ``held`` refit while requests stream on its old versions (see
    the module docstring)."""
    from vllm.lora.request import LoRARequest

    from reshard.adapters.vllm.adapters import VllmAdapters
    from reshard.errors import RefitError
    from reshard.sender.lora_adapter import AdapterSpec
    from reshard.testing.engines import PROMPTS, greedy

    long_prompt, short = [3, 14, 15, 92, 65, 35], PROMPTS[1]
    d = VllmAdapters([llm], "held", AdapterSpec.parse(_spec(path)), keep=2)
    d.init(group_config(address, 1, tp, job="held"))
    s = _Steps(llm)
    out: dict = {"served": {}}

    def serve(tag: str) -> None:
        """A request on the newest version, run to its end beside the long ones."""
        s.add(tag, short, d.request())
        s.finish(tag)
        out["served"][tag] = (d.request().lora_name, s.tokens[tag])

    d.refit(1)
    s.add("R1", long_prompt, d.request(), LONG)
    s.step()
    assert s.tokens["R1"], "R1 made no token in its first step"
    d.refit(2)
    s.add("R2", long_prompt, d.request(), LONG)
    serve("S2")
    # Refit 3 is received while the engine generates: the trainer pushes only
    # once the engine stepped with the workers already in the refit.
    d.stage(3)
    before = len(s.tokens["R1"])
    for _ in range(3):
        s.step()
    out["stepped_while_staging"] = len(s.tokens["R1"]) - before
    out["staged_before_push"] = d.staged(3)
    _store(address).set("held/push/3", "go")
    wait_for(lambda: d.staged(3), procs.GROUP_TIMEOUT_S, "refit 3 received")
    d.commit(3)
    serve("S3")
    d.refit(4)
    serve("S4")
    out["versions_after_4"] = [r.stats["versions"] for r in d.retire()]
    out["held_after_4"] = {k: sorted(v) for k, v in d.held.items()}
    # A fifth version would make five: refused, and the fourth keeps serving.
    try:
        d.refit(5)
    except RefitError as e:
        out["refused"] = {"step": e.step, "error": str(e)}
    serve("S4-after-refusal")
    out["long_unfinished_at_refusal"] = not {"R1", "R2"} & s.done
    s.finish("R1", "R2")
    d.refit(5)
    serve("S5")
    # The 3rd left the two newest at refit 5: freed at the next retire.
    out["after"] = [
        {k: r.stats[k] for k in ("versions", "alive", "held", "versions_bytes")} | {"kept": r.stats.get("kept_bytes")}
        for r in d.retire()
    ]
    out["long"] = {rid: s.tokens[rid] for rid in ("R1", "R2")}
    # What each version generates loaded from PEFT's files, alone in the engine.
    out["disk_long"] = {}
    out["disk_short"] = {}
    for v in range(1, 6):
        disk = LoRARequest(f"disk-held-{v}", 950 + v, os.path.join(root, f"held-{v}"))
        out["disk_long"][v] = greedy(llm, [long_prompt], LONG, lora_request=disk)[0]
        out["disk_short"][v] = greedy(llm, [short], lora_request=disk)[0]
    return out


def _spec(path: str) -> str:
    """The adapter spec the trainer's ``LoraAdapter(model).spec()`` makes
    (both policies share config and modules)."""
    from reshard.sender.lora_adapter import LoraAdapter

    return LoraAdapter(_policy(path, 0)).spec().to_json()


def _run(rank: int, address: str, path: str, root: str, tp: int) -> dict:
    return (_trainer if rank == 0 else _engine)(address, path, root, tp)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    from reshard.testing.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("lora") / "base", "qwen2", seed=0, torch_dtype="bfloat16"))


@pytest.mark.parametrize("tp", [1, 2])
def test_adapters_refit_into_lora_slots_slice_by_slice(tp, base, tmp_path):
    server = procs.StoreServer()
    trainer, engine = procs.check(
        procs.run(_run, 2, server.address, base, str(tmp_path), tp, timeout=1200, daemon=False)
    )
    rows = engine["refits"]
    assert [(r["name"], r["step"]) for r in rows] == [("alpha", 1), ("beta", 1), ("alpha", 2), ("beta", 2)]
    for r in rows:
        assert r["ours"] == r["disk"], f"tp={tp} {r['name']}@{r['step']}: tokens differ from the files' adapter"
        # Every tensor of the adapter's slot, on every worker, equals what
        # vLLM's own loader put in the slot of the same version from its files.
        assert len(r["slots"]) == tp
        for worker, (ours, disk) in enumerate(r["slots"]):
            assert ours and ours.keys() == disk.keys(), (worker, sorted(ours)[:5], sorted(disk)[:5])
            differ = sorted(k for k in disk if ours[k] != disk[k])
            assert not differ, f"tp={tp} {r['name']}@{r['step']} worker {worker}: slot tensors differ: {differ[:5]}"
        assert r["ours"] != engine["base"], "the adapter changed nothing"
        assert r["lora_name"] == f"{r['name']}@{r['step']}"
        # Each worker took exactly the slices its LoRA layers keep (received in
        # the trainer's float32, landed in the engine's bfloat16).
        assert r["landed"] == r["kept"]
        assert r["received"] == [2 * k for k in r["kept"]]
    by = {(r["name"], r["step"]): r for r in rows}
    for name in ("alpha", "beta"):
        assert by[(name, 2)]["previous"] == by[(name, 1)]["ours"], "the previous version no longer serves"
        assert by[(name, 1)]["ours"] != by[(name, 2)]["ours"]
    assert by[("alpha", 1)]["ours"] != by[("beta", 1)]["ours"]
    # Only LoRA factors were published, under PEFT's names; nothing but the
    # trainer's own save_pretrained wrote files.
    for names in trainer["published"].values():
        assert names and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in names)
        assert all(n.startswith("base_model.model.") for n in names)
    assert engine["engine_files"] == sorted(
        [f"{n}-{s}" for s in (1, 2) for n in ("alpha", "beta")] + [f"held-{v}" for v in range(1, 6)]
    )
    if tp == 2:
        # The sharded factors split between the workers: each receives less than
        # the trainer sent in all (a full copy).
        assert all(got < trainer["sent"][0] for got in rows[0]["received"])
    _check_held(engine["held"], trainer["refused"], tp)


def _check_held(held: dict, refused: dict | None, tp: int) -> None:
    """Adapter ``held`` (see the module docstring)."""
    # Each long request finished on its own version, three and two refits later.
    assert held["long"]["R1"] == held["disk_long"][1], "R1 is not version 1's"
    assert held["long"]["R2"] == held["disk_long"][2], "R2 is not version 2's"
    assert held["disk_long"][1] != held["disk_long"][2]
    # Every request after a refit got the newest version, and the fourth
    # served on after the fifth was refused.
    expect = {"S2": 2, "S3": 3, "S4": 4, "S4-after-refusal": 4, "S5": 5}
    for tag, v in expect.items():
        name, tokens = held["served"][tag]
        assert name == f"held@{v}" and tokens == held["disk_short"][v], (tag, name)
    # The engine generated while refit 3 was received (the trainer had not pushed).
    assert held["stepped_while_staging"] == 3 and held["staged_before_push"] is False
    after4 = held["held_after_4"]
    assert sorted(after4) == ["held@1", "held@2"] and [len(v) for v in after4.values()] == [1, 1], after4
    assert after4["held@1"][0].startswith("R1-") and after4["held@2"][0].startswith("R2-"), after4
    assert held["versions_after_4"] == [["held@1", "held@2", "held@3", "held@4"]] * tp
    # Refused on every rank before any byte moved, naming both requests.
    assert held["long_unfinished_at_refusal"]
    for err in (held["refused"], refused):
        assert err is not None and err["step"] == "enter", err
        assert "max_versions=4" in err["error"] and "held@5" in err["error"], err["error"]
        assert "request(s) 'R1-" in err["error"] and "request(s) 'R2-" in err["error"], err["error"]
    # Once they finished, only the two newest are held, and nothing else is alive.
    for w in held["after"]:
        assert w["versions"] == ["held@4", "held@5"] and w["alive"] == ["held@4", "held@5"], w
        assert w["held"] == {} and w["versions_bytes"] == 2 * w["kept"], w


def _server_trainer(rank: int, address: str, path: str, root: str, versions: int) -> list[int]:
    from reshard import Sender
    from reshard.sender.lora_adapter import LoraAdapter

    policy = _policy(path, 0)
    sender = Sender(LoraAdapter(policy), config=group_config(address, 1, 1, job="served"), rank=0)
    sent = []
    for v in range(1, versions + 1):
        if v > 1:
            _train(policy, 200 + v)
        policy.save_pretrained(os.path.join(root, f"v{v}"))
        sent.append(sender.push(v).exec.bytes_sent)
    sender.close()
    return sent


def test_requests_running_through_refits_on_a_server_each_see_one_version(base, tmp_path):
    """A server (``--enable-lora``) keeps answering requests while adapter
    versions are refit into it: every answer is one version's, the one the
    request named, as the same server answers with that version loaded
    from PEFT's files; a request started before a swap finishes on its
    version; and its engine core reports who uses which version, so the
    version that left the two newest is freed once no request names it."""
    import threading

    from reshard.adapters.vllm.adapters import VllmAdapters
    from reshard.adapters.vllm.driver import HttpEngine
    from reshard.sender.lora_adapter import AdapterSpec

    from .vllm_support import PROMPTS, VllmServer, server_greedy

    versions = 3
    srv = VllmServer(
        base,
        tp=1,
        log=str(tmp_path / "server.log"),
        args=[
            "--worker-extension-cls", "reshard.adapters.vllm.ReshardWorkerExtension",
            "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
        ],
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )  # fmt: skip
    store = procs.StoreServer()
    answers: list[tuple[str, list[list[int]]]] = []
    stop = threading.Event()
    try:
        engine = HttpEngine(srv.url)
        # keep=2: a name taken before a refit is good for one more; each refit
        # starts once an answer taken after the previous one arrived.
        adapters = VllmAdapters([engine], "alpha", AdapterSpec.parse(_spec(base)), keep=2)
        trainer = procs.spawn(_server_trainer, 0, store.address, base, str(tmp_path), versions)
        adapters.init(group_config(store.address, 1, 1, job="served"))
        adapters.refit(1)

        def ask() -> None:
            while not stop.is_set():
                name = adapters.model()
                answers.append((name, server_greedy(srv.url, PROMPTS[:2], model=name)))

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        for v in range(2, versions + 1):
            # Each refit starts once a request of the previous version is answered.
            seen = len(answers)
            while len(answers) == seen and asker.is_alive():
                asker.join(timeout=0.05)
            adapters.refit(v)
        seen = len(answers)
        while len(answers) == seen and asker.is_alive():
            asker.join(timeout=0.05)
        stop.set()
        asker.join(timeout=procs.GROUP_TIMEOUT_S)
        procs.check([trainer.outcome(procs.GROUP_TIMEOUT_S)])
        # The server's engine core (a process of its own) reports its requests:
        # with none running, the version that left the two newest is freed.
        retired = [
            (r.stats["reported"], r.stats["versions"], r.stats["alive"], r.stats["dropped"]) for r in adapters.retire()
        ]
        reference = {}
        for v in range(1, versions + 1):
            engine.post_json("/v1/load_lora_adapter", {"lora_name": f"disk{v}", "lora_path": str(tmp_path / f"v{v}")})
            reference[f"alpha@{v}"] = server_greedy(srv.url, PROMPTS[:2], model=f"disk{v}")
    finally:
        stop.set()
        srv.close()
    assert {name for name, _ in answers} == set(reference), [n for n, _ in answers]
    for name, tokens in answers:
        assert tokens == reference[name], f"an answer of {name} is not that version's"
    assert len({tuple(map(tuple, t)) for t in reference.values()}) == versions
    assert retired == [(True, ["alpha@2", "alpha@3"], ["alpha@2", "alpha@3"], ["alpha@1"])]
