"""Ports for tests, examples and benchmarks (``reshard.testing.ports``)."""

from __future__ import annotations

from reshard.testing.ports import _ephemeral_range, free_port


def test_free_ports_are_distinct_and_above_the_ephemeral_range():
    _, hi = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    if 65535 - hi >= 1000:  # room above the range
        assert all(p > hi for p in ports)
