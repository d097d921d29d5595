"""What the driver and the in-worker hook say to each other.

SGLang's ``update_weights_from_tensor`` carries, per TP rank, a pickled
list of ``(name, tensor)`` pairs, and ignores whatever the custom loader
returns. So:

- a :class:`Command` (msgspec JSON) travels in the *name* of one empty CPU
  tensor: ``("reshard:" + json, torch.empty(0))``. SGLang's restricted
  unpickler accepts that payload, and an empty storage is pickled inline (no
  shared memory, no file descriptors), so it crosses machines and HTTP;
- each worker posts a :class:`~reshard.adapters.core.replies.WorkerReply`
  (msgspec JSON) to the refit group's
  TCPStore, under ``reshard/<job>/sglang/<command id>/<refit rank>``, before
  its loader returns; the driver reads them once the HTTP call has returned.
"""

from __future__ import annotations

import msgspec

from reshard.adapters.core.replies import WorkerReply
from reshard.adapters.core.spec import GroupSpec

__all__ = ["PREFIX", "Command", "decode_command", "encode_command", "reply_decoder", "reply_key", "reply_prefix"]

PREFIX = "reshard:"


class Command(msgspec.Struct, frozen=True, kw_only=True):
    version: int = 1
    op: str
    """``pull`` (receive refit ``refit``), ``close`` (leave the refit group)
    or ``state`` (digest every tensor the model's forward pass may read,
    :func:`reshard.adapters.core.state.model_state`, into the reply's
    ``stats["state"]``)."""
    id: str
    group: GroupSpec
    refit: int = 0
    method: str = "reshard"


_command_decoder = msgspec.json.Decoder(Command)
reply_decoder = msgspec.json.Decoder(WorkerReply)


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
