"""The group settings exist once: ``GroupConfig``'s fields say their scope,
and the spec engine workers receive, vLLM's worker and trainer init infos
and every conversion between them follow it. Also the store address, IPv6
included."""

from __future__ import annotations

import dataclasses
import typing

import msgspec
import pytest

from reshard.adapters.core.spec import GroupSpec
from reshard.testing.ports import free_port
from reshard.transport.config import GROUP, TRAINER, GroupConfig, format_address, parse_address, scope_fields, settings
from reshard.transport.store import connect_store, serve_store

from .support import NON_DEFAULT_SETTINGS

_CONFIG_TYPES = typing.get_type_hints(GroupConfig)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GroupConfig)}


def test_every_shared_setting_is_set_in_the_sample():
    assert set(NON_DEFAULT_SETTINGS) == set(scope_fields(GROUP, TRAINER))
    for name, value in NON_DEFAULT_SETTINGS.items():
        assert value != _DEFAULTS[name], name


def test_the_spec_declares_the_group_settings_with_their_types_and_defaults():
    spec_fields = {f.name: f for f in msgspec.structs.fields(GroupSpec)}
    hints = typing.get_type_hints(GroupSpec)
    for name in scope_fields(GROUP):
        assert name in spec_fields, f"GroupSpec lacks the group setting {name!r}"
        assert hints[name] == _CONFIG_TYPES[name], name
        default = spec_fields[name].default
        assert default is msgspec.NODEFAULT if _DEFAULTS[name] is dataclasses.MISSING else default == _DEFAULTS[name]
    # Nothing else: each rank's own settings stay behind (domain and token on request).
    extra = set(spec_fields) - set(scope_fields(GROUP)) - set(GroupSpec.WORKER_OPTIONS)
    assert extra == {"domain", "token", "version"}
    assert not set(scope_fields(TRAINER)) & set(spec_fields)


def test_a_config_survives_the_trip_to_an_engine_worker():
    cfg = GroupConfig(**NON_DEFAULT_SETTINGS, token="secret", domain="rack-1")
    spec = GroupSpec.parse(GroupSpec.of(cfg, engine_offset=2, budget_bytes=7, atomic=True).to_json())
    worker = spec.config()
    assert settings(worker, GROUP) == settings(cfg, GROUP)
    assert worker.host_store is False and worker.token is None and worker.domain is None
    assert (spec.engine_offset, spec.budget_bytes, spec.atomic) == (2, 7, True)
    assert GroupSpec.of(cfg, with_token=True, domain="d").config().token == "secret"


def test_vllm_init_infos_carry_every_setting():
    pytest.importorskip("vllm")
    from reshard.adapters.vllm.backend import ReshardInitInfo, ReshardTrainerInitInfo

    # Trainer side: every group and trainer setting, with GroupConfig's defaults
    # (but the three that vLLM's positional dataclass needs defaults for).
    info_fields = {f.name: f for f in dataclasses.fields(ReshardTrainerInitInfo)}
    hints = typing.get_type_hints(ReshardTrainerInitInfo)
    for name in scope_fields(GROUP, TRAINER):
        mine = "group_backend" if name == "backend" else name
        assert mine in info_fields, f"ReshardTrainerInitInfo lacks {mine!r}"
        assert hints[mine] == _CONFIG_TYPES[name], name
        if _DEFAULTS[name] is not dataclasses.MISSING:
            assert info_fields[mine].default == _DEFAULTS[name], name
    values = {("group_backend" if k == "backend" else k): v for k, v in NON_DEFAULT_SETTINGS.items()}
    info = ReshardTrainerInitInfo(rank=0, **values)
    cfg = info.group_config()
    assert settings(cfg, GROUP, TRAINER) == NON_DEFAULT_SETTINGS
    assert cfg.host_store is False

    # Worker side: what the trainer's driver sends, as vLLM parses it.
    sent = {k: v for k, v in msgspec.to_builtins(GroupSpec.of(cfg, atomic=True)).items() if k != "token"}
    assert ReshardInitInfo(**sent).spec == GroupSpec.of(cfg, atomic=True)
    with pytest.raises(TypeError, match="nosuch"):
        ReshardInitInfo(**sent, nosuch=1)
    with pytest.raises(TypeError, match="token"):
        ReshardInitInfo(**sent, token="x")


@pytest.mark.parametrize(
    ("address", "host", "port"),
    [("trainer-0:29600", "trainer-0", 29600), ("10.0.0.7:1", "10.0.0.7", 1), ("[::1]:5000", "::1", 5000)],
)
def test_addresses_parse_and_format_back(address, host, port):
    assert parse_address(address) == (host, port)
    assert format_address(host, port) == address
    assert format_address(f"[{host}]", port) == address  # a bracketed host stays bracketed once


@pytest.mark.parametrize("address", ["nohost", ":5000", "h:0", "h:65536", "h:x", "::1:5000", "[::1]"])
def test_bad_addresses_are_refused_by_name(address):
    with pytest.raises(ValueError, match="is not host:port"):
        GroupConfig(address=address, num_sources=1, num_destinations=1)


def test_an_ipv6_store_address_hosts_and_reaches_the_store():
    """The address verl builds for an IPv6 node (``[::1]:port``) used to fail
    with ``socket.gaierror`` when the store bound to ``[::1]``."""
    cfg = GroupConfig(address=format_address("::1", free_port()), num_sources=1, num_destinations=1, timeout_s=60)
    server = serve_store(cfg)
    server.set("reshard-ipv6-probe", b"ok")
    client = connect_store(dataclasses.replace(cfg, host_store=False), rank=1)
    assert client.get("reshard-ipv6-probe") == b"ok"
