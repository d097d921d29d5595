"""Shared fixtures for every test module."""

from __future__ import annotations

import pytest

from . import procs


@pytest.fixture(scope="module", autouse=True)
def _shared_processes():
    """Processes shared by ``procs.run(..., reuse=True)`` live for one module."""
    yield
    procs.close_shared()
