"""Wire types: what ranks tell each other through the store (msgspec, versioned).

Nothing that crosses a process boundary is pickled. Every message carries a
``version`` field; new fields are appended with defaults. Decoding validates
types, so malformed metadata is a clear ``msgspec.ValidationError`` naming
the field, not a crash deep in the planner.
"""

from __future__ import annotations

import msgspec

from reshard.errors import Problem
from reshard.plan.layout import Grid, LocalTensor, Piece, TensorMeta

__all__ = [
    "WIRE_VERSION",
    "Hello",
    "RankLayout",
    "Status",
    "decode",
    "encode",
]

WIRE_VERSION = 1

# Refuse metadata larger than this before decoding it (a table of a 1T-param
# MoE with ~100k tensors is ~7 MB).
MAX_MESSAGE_BYTES = 256 << 20


class Hello(msgspec.Struct, frozen=True, kw_only=True, tag="hello"):
    """Who a rank is. Published once when it joins."""

    rank: int
    role: str
    """``source`` (trainer) or ``destination`` (engine worker)."""
    domain: str
    """Ranks with equal labels share a fast fabric (an NVLink domain)."""
    host: str
    pid: int
    device: str = "cpu"
    version: int = WIRE_VERSION


class RankLayout(msgspec.Struct, frozen=True, kw_only=True, tag="layout"):
    """A rank's layout with its tensor table stored separately (by digest),
    so ranks that share a table store it once."""

    rank: int
    table: str
    locals: tuple[LocalTensor, ...] = ()
    pieces: tuple[Piece, ...] = ()
    grids: tuple[Grid, ...] = ()
    version: int = WIRE_VERSION


class Table(msgspec.Struct, frozen=True, kw_only=True, tag="table"):
    tensors: tuple[TensorMeta, ...]
    version: int = WIRE_VERSION


class Status(msgspec.Struct, frozen=True, kw_only=True, tag="status"):
    """One rank's outcome of one step of one refit."""

    rank: int
    step: str
    refit: int
    ok: bool
    error: str = ""
    problems: tuple[Problem, ...] = ()
    staging_need: int = 0
    """Bytes of staging this rank's plan needs in its busiest round."""
    version: int = WIRE_VERSION


Message = Hello | RankLayout | Table | Status

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, expect: type | None = None) -> Message:
    """Decode one message; ``expect`` checks its type."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"refit metadata of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    msg = _decoder.decode(data)
    if expect is not None and not isinstance(msg, expect):
        raise msgspec.ValidationError(f"expected a {expect.__name__} message, got {type(msg).__name__}")
    if msg.version > WIRE_VERSION:
        raise msgspec.ValidationError(
            f"{type(msg).__name__} has wire version {msg.version}; this reshard reads up to {WIRE_VERSION}"
        )
    return msg
