"""Shared fixtures for every test module."""

from __future__ import annotations

import os

import pytest

from . import procs


@pytest.fixture(scope="module", autouse=True)
def _shared_processes():
    """Processes shared by ``procs.run(..., reuse=True)`` live for one module."""
    yield
    procs.close_shared()


@pytest.fixture(scope="module")
def sglang_python():
    """The SGLang venv's Python; without it the SGLang engine tests fail,
    unless ``RESHARD_SKIP_SGLANG=1`` says to skip them."""
    from .sglang_support import REPO, sglang_python

    py = sglang_python()
    if py is None:
        where = os.environ.get("RESHARD_SGLANG_VENV") or REPO / ".venv-sglang"
        msg = f"no SGLang venv at {where}: run `make sglang-setup` (or set RESHARD_SGLANG_VENV)"
        if os.environ.get("RESHARD_SKIP_SGLANG") == "1":
            pytest.skip(msg)
        pytest.fail(msg)
    return py
