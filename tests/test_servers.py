"""Engine servers as replicas of an elastic group (``GroupConfig.min_replicas``):
the drivers' layout of replicas and how they treat a server that is down,
without an engine (a URL nobody listens on). The live-server half is in
tests/test_vllm_server.py."""

from __future__ import annotations

import pytest

from reshard import GroupConfig
from reshard.adapters.core.servers import replica_offsets
from reshard.adapters.sglang.driver import SglangEngines
from reshard.adapters.vllm.driver import VllmEngines
from reshard.errors import ReshardError, ServerUnreachable
from reshard.testing.ports import free_port


def _config(num_destinations: int, **kw) -> GroupConfig:
    return GroupConfig(
        address=f"127.0.0.1:{free_port()}", num_sources=1, num_destinations=num_destinations, host_store=False, **kw
    )


def _dead() -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_replica_offsets_set_replica_size_from_the_live_servers():
    cfg = _config(4, min_replicas=1)
    assert replica_offsets(cfg, [None, 2], ["a", "b"]) == [0, 2]
    assert cfg.replica_size == 2 and cfg.num_replicas == 2


@pytest.mark.parametrize(
    ("sizes", "kw", "words"),
    [
        ([1, 2], {}, "different numbers of workers (a: 1, b: 2)"),
        ([2, None], {"replica_size": 1}, "replica_size is 1, but each engine server has 2 workers"),
        ([1, 1], {}, "make 2 refit ranks, but the refit group expects num_destinations=4"),
        ([None, None], {}, "none of the engine servers is reachable: a, b"),
        ([2, 2], {"min_replicas": 3}, "min_replicas is 3, but 2 engine servers make only 2 replicas"),
    ],
)
def test_replica_offsets_refuse_servers_that_are_not_one_size(sizes, kw, words):
    kw = {"min_replicas": 1, **kw}
    with pytest.raises(ReshardError) as err:
        replica_offsets(_config(4, **kw), sizes, ["a", "b"])
    assert words in str(err.value)


def test_a_server_that_is_down_fails_a_fixed_group_naming_its_url():
    url = _dead()
    with pytest.raises(ServerUnreachable, match=f"vLLM server {url}: POST /collective_rpc failed"):
        VllmEngines([url]).init(_config(1))
    with pytest.raises(ServerUnreachable, match=f"SGLang server {url}: GET /server_info failed"):
        SglangEngines([url]).init(_config(1))


def test_an_elastic_group_needs_one_live_server_to_size_its_replicas():
    urls = [_dead(), _dead()]
    for engines in (VllmEngines(urls), SglangEngines(urls)):
        with pytest.raises(ReshardError, match="none of the engine servers is reachable"):
            engines.init(_config(2, min_replicas=1))
        assert sorted(engines.unreachable) == [0, 1]
        assert urls[1] in engines.unreachable[1] and "unreachable" in engines.unreachable[1]
