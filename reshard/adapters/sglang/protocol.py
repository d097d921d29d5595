"""What the driver and the in-worker hook say to each other.

SGLang's ``update_weights_from_tensor`` carries, per TP rank, a pickled
list of ``(name, tensor)`` pairs, and ignores whatever the custom loader
returns. So:

- a :class:`Command` (msgspec JSON) travels in the *name* of one empty CPU
  tensor: ``("reshard:" + json, torch.empty(0))``. SGLang's restricted
  unpickler accepts that payload, and an empty storage is pickled inline (no
  shared memory, no file descriptors), so it crosses machines and HTTP;
- each worker posts a :class:`Reply` (msgspec JSON) to the refit group's
  TCPStore, under ``reshard/<job>/sglang/<command id>/<refit rank>``, before
  its loader returns; the driver reads them once the HTTP call has returned.
"""

from __future__ import annotations

import msgspec

__all__ = ["PREFIX", "Command", "GroupSpec", "Reply", "decode_command", "encode_command", "reply_key"]

PREFIX = "reshard:"


class GroupSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The refit group as an engine's workers join it."""

    config: dict[str, str | int | float | bool | None]
    """:class:`reshard.GroupConfig` fields, without the per-rank ones
    (``host_store``, ``store_bind``, ``domain``) and without the job token,
    which never travels over HTTP: workers read ``$RESHARD_TOKEN`` from the
    server's environment."""
    engine_offset: int = 0
    """Refit ranks of this engine's workers start at ``num_sources + engine_offset``."""
    budget_bytes: int = 256 << 20

    @property
    def address(self) -> str:
        return str(self.config["address"])

    @property
    def job(self) -> str:
        return str(self.config.get("job", "reshard"))

    @property
    def num_sources(self) -> int:
        return int(self.config["num_sources"])  # type: ignore[arg-type]

    @property
    def timeout_s(self) -> float:
        return float(self.config.get("timeout_s", 300.0))  # type: ignore[arg-type]


class Command(msgspec.Struct, frozen=True, kw_only=True):
    version: int = 1
    op: str
    """``pull`` (receive refit ``refit``) or ``close`` (leave the refit group)."""
    id: str
    group: GroupSpec
    refit: int = 0
    method: str = "reshard"


class Reply(msgspec.Struct, frozen=True, kw_only=True):
    version: int = 1
    id: str
    rank: int
    """This worker's refit rank."""
    tp_rank: int
    ok: bool
    error: str = ""
    step: str | None = None
    errors: dict[int, str] | None = None
    """Per refit rank, when the error is a :class:`reshard.RefitError`."""
    mixed: bool = False
    """The refit failed after bytes landed: the weights mix old and new."""
    stats: dict[str, float] = msgspec.field(default_factory=dict)


_command_decoder = msgspec.json.Decoder(Command)
reply_decoder = msgspec.json.Decoder(Reply)


def encode_command(cmd: Command) -> str:
    return PREFIX + msgspec.json.encode(cmd).decode()


def decode_command(name: str) -> Command:
    if not name.startswith(PREFIX):
        raise ValueError(f"not a reshard command: {name[:60]!r}")
    return _command_decoder.decode(name[len(PREFIX) :])


def reply_key(cmd_id: str, rank: int) -> str:
    return f"{cmd_id}/{rank}"


def reply_prefix(job: str) -> str:
    return f"reshard/{job}/sglang"
