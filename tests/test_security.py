"""Security of the refit path: where the store listens, the job token, and no
pickle anywhere between ranks (see docs/security.md)."""

from __future__ import annotations

import ast
import datetime
import ipaddress
import pathlib
import threading

import msgspec
import pytest
import torch

from reshard.errors import MetadataError, RefitError
from reshard.plan.box import Box
from reshard.plan.layout import TensorMeta
from reshard.plan.specs import PieceSpec
from reshard.receiver import Receiver
from reshard.sender import Sender
from reshard.transport import wire
from reshard.transport.auth import job_keys
from reshard.transport.group import GroupConfig, RefitGroup, serve_store

from . import procs
from .support import HANG_S, group_config

ROOT = pathlib.Path(__file__).resolve().parents[1] / "reshard"
SECRET = TensorMeta("model.layers.0.secret_proj.weight", (8, 4), "float32")


def _listeners(port: int) -> list[str]:
    """Addresses something listens on at ``port`` on this machine (Linux)."""
    out = []
    for path, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in pathlib.Path(path).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state != "0A" or int(p, 16) != port:
                continue
            raw = bytes.fromhex(addr)
            if v6:
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                out.append(str(ipaddress.IPv6Address(raw)))
            else:
                out.append(str(ipaddress.IPv4Address(raw[::-1])))
    return sorted(out)


def test_the_hosted_store_listens_on_the_configured_address_only():
    port = procs.free_port()
    store = serve_store(GroupConfig(address=f"127.0.0.1:{port}", num_sources=1, num_destinations=1))
    assert _listeners(port) == ["127.0.0.1"]
    store.set("k", "v")  # and it serves
    # Every interface only when asked for.
    port = procs.free_port()
    serve_store(GroupConfig(address=f"127.0.0.1:{port}", num_sources=1, num_destinations=1, store_bind="0.0.0.0"))
    assert _listeners(port) in (["::"], ["0.0.0.0"])


def test_torch_tcpstore_by_itself_listens_on_every_interface():
    """What docs/security.md says torch does: ``host`` is ignored by the server."""
    from torch.distributed import TCPStore

    port = procs.free_port()
    store = TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    assert _listeners(port) in (["::"], ["0.0.0.0"])
    del store


def test_the_token_comes_from_the_environment_and_stays_out_of_reprs(monkeypatch):
    monkeypatch.setenv("RESHARD_TOKEN", "s3cr3t-value")
    cfg = GroupConfig(address="h:1", num_sources=1, num_destinations=1)
    assert cfg.token == "s3cr3t-value"
    assert "s3cr3t" not in repr(cfg)
    monkeypatch.delenv("RESHARD_TOKEN")
    assert GroupConfig(address="h:1", num_sources=1, num_destinations=1).token is None
    with pytest.raises(ValueError, match="token must be a non-empty string"):
        GroupConfig(address="h:1", num_sources=1, num_destinations=1, token="")


def _pair(address: str, token: str | None, out: dict) -> None:
    """A trainer rank and an engine worker with ``token``, as threads; they
    refit once and stay joined (``out`` gets the endpoints and results)."""
    cfg = group_config(address, 1, 1, token=token)
    piece = [PieceSpec(SECRET, Box((0, 0), (8, 4)), "w", (8, 4))]
    src = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    dst = torch.zeros(8, 4)
    s = Sender.from_pieces(piece, {"w": src}, config=cfg, rank=0)
    r = Receiver({"w": dst}, piece, config=cfg, rank=1)
    threads = [threading.Thread(target=s.push, args=(1,)), threading.Thread(target=r.pull, args=(1,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
        assert not t.is_alive(), "a refit of the pair hung"
    out.update(sender=s, receiver=r, ok=torch.equal(src, dst))


def test_a_rank_with_another_token_is_refused_and_can_neither_read_nor_inject():
    port = procs.free_port()
    address = f"127.0.0.1:{port}"
    serve_store(GroupConfig(address=address, num_sources=1, num_destinations=1))
    legit: dict = {}
    _pair(address, "token-A", legit)
    assert legit["ok"]
    # Joining with another token, or none, is refused at once with a clear error.
    for token, hint in (("token-B", ""), (None, "this rank has none")):
        cfg = GroupConfig(
            address=address, num_sources=1, num_destinations=1, timeout_s=30, token=token, host_store=False
        )
        # Refused by the token the store holds (a rank waiting for its peers
        # would fail "did not join" at the timeout instead).
        with pytest.raises(RefitError, match=r"refused: job 'reshard' generation 0 .* different job token") as e:
            RefitGroup.join(cfg, rank=1)
        assert e.value.step == "join" and hint in str(e.value)
    # Anyone who can reach the store can list and read it, but learns nothing:
    # no tensor name, no layout, in any value.
    from torch.distributed import TCPStore

    raw = TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=5))
    keys = raw.list_keys()
    layout_keys = [k for k in keys if k.endswith("/layout/join/1")]
    assert layout_keys
    other = job_keys("token-B", "reshard", 0)
    for k in keys:
        value = bytes(raw.get(k))
        assert b"secret_proj" not in value, k
        with pytest.raises((MetadataError, msgspec.DecodeError)):
            wire.decode(value)
        with pytest.raises(MetadataError):
            other.open(k.split("/", 4)[-1], value)
    # A value written without the token is refused by the legit ranks.
    group = legit["sender"].session.group
    name = "layout/join/1"
    forged = wire.RankLayout(rank=1, table="00" * 16)
    full = layout_keys[0]
    for value in (other.seal(f"e{group.epoch}/{name}", wire.encode(forged)), wire.encode(forged)):
        raw.set(full, value)
        with pytest.raises(RefitError, match=r"failed authentication|too short"):
            group.get_many([name], wire.RankLayout, step="layout")
    legit["sender"].close()
    legit["receiver"].close()


def test_without_a_token_values_are_still_sealed_against_corruption():
    keys = job_keys(None, "job", 0)
    sealed = keys.seal("e0/x", b"payload")
    assert keys.open("e0/x", sealed) == b"payload"
    with pytest.raises(MetadataError):
        keys.open("e0/x", sealed[:-1] + bytes([sealed[-1] ^ 1]))


# -- no pickle --------------------------------------------------------------------

_OBJECT_COLLECTIVES = {
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "_object_to_tensor",
    "_tensor_to_object",
}


def _no_pickle(rank: int, address: str) -> dict:
    """A full refit (token, checksums, leader forwarding) with every way to
    unpickle trapped in this process."""
    import _pickle
    import pickle

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    calls: list[str] = []

    def trap(name: str):
        def fail(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} on the refit path")

        return fail

    class NoUnpickler(pickle.Unpickler):
        def load(self):
            return trap("Unpickler.load")()

    for mod in (pickle, _pickle):
        for name in ("loads", "load"):
            setattr(mod, name, trap(f"{mod.__name__}.{name}"))
        mod.Unpickler = NoUnpickler  # type: ignore[misc,assignment]
    for name in _OBJECT_COLLECTIVES:
        for mod in (c10d, dist):
            if hasattr(mod, name):
                setattr(mod, name, trap(name))
    torch.load = trap("torch.load")
    # The traps are live.
    live = []
    for probe in (lambda: pickle.loads(b"\x80\x04K\x01."), lambda: c10d._tensor_to_object(None, 0, None)):
        try:
            probe()
        except AssertionError:
            live.append(True)
    calls.clear()
    # Rank 0 trains; ranks 1-2, one NVLink domain, keep everything: one leads, one is forwarded to.
    cfg = group_config(address, 1, 2, token="job-token", checksums=True, domain="trainer" if rank == 0 else "engines")
    meta = TensorMeta("w", (256, 64), "bfloat16")
    full = torch.arange(256 * 64, dtype=torch.float32).reshape(256, 64).to(torch.bfloat16)
    piece = [PieceSpec(meta, Box((0, 0), (256, 64)), "w", (256, 64))]
    if rank == 0:
        stats = Sender.from_pieces(piece, {"w": full.clone()}, config=cfg, rank=0, round_bytes=8 << 10).push(1)
        ok = True
    else:
        dst = torch.zeros(256, 64, dtype=torch.bfloat16)
        stats = Receiver({"w": dst}, piece, config=cfg, rank=rank, round_bytes=8 << 10).pull(1)
        ok = torch.equal(dst, full)
    return {"live": live, "calls": calls, "ok": ok, "sent": stats.exec.bytes_sent}


def test_a_refit_never_unpickles():
    server = procs.StoreServer()
    out = procs.check(procs.run(_no_pickle, 3, server.address))
    for r in out:
        assert r["live"] == [True, True]
        assert r["calls"] == []
        assert r["ok"]
    # The leader forwarded what it pulled to the other engine worker.
    assert sum(1 for r in out[1:] if r["sent"] > 0) == 1


def test_the_code_never_uses_pickle_or_object_collectives():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        core = "adapters" not in path.parts
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Attribute):
                names.append(node.attr)
            elif isinstance(node, ast.Name):
                names.append(node.id)
            elif isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names += [node.module or "", *(a.name for a in node.names)]
            for n in names:
                if n in _OBJECT_COLLECTIVES or (
                    core and n.split(".")[0] in ("pickle", "_pickle", "cloudpickle", "dill")
                ):
                    bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {n}")
                if core and isinstance(node, ast.Attribute) and n == "load" and ast.unparse(node.value) == "torch":
                    bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: torch.load")
    assert bad == []
