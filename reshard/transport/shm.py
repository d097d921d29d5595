"""Shared-memory links between ranks on one host (CPU tensors).

A pair of ranks whose hellos name the same shared-memory host (both with
``GroupConfig(shared_memory=True)``, equal :func:`host_id`, CPU tensors)
moves its messages through a :class:`Channel` instead of gloo. A channel is
one direction between two ranks: a file in ``/dev/shm`` (a POSIX shared
memory object) with a header and two slots, each as large as the busiest
round between the pair. Rounds alternate slots, so the sender writes round
``k+1`` while the receiver still reads round ``k``.

Protocol (one writer, one reader, per channel): the channel counts the
rounds it carried (``seq``, the same on both sides: the plans agree on
which rounds carry messages between the pair). The sender waits until the
reader released slot ``seq % 2`` (it read round ``seq - 2``), announces
``seq`` in the header, and copies the round's messages into the slot in
chunks, publishing after each how far the slot is written; the reader
copies each chunk out as soon as it is written (the two copies overlap),
then releases the slot. Every
wait is bounded by the group's timeout, and notices a peer process that
died (same host: its pid) within a fraction of a second, so a dead reader
never wedges a sender. The header words are 8-byte aligned stores and
loads ordered by the x86-64 memory model (and by the copies around them).

Lifetime: the sender creates the file (under a temporary name, renamed when
its header is ready), the reader maps it and removes the name at once; the
mappings live on until both close. Nothing stays in ``/dev/shm`` once the
reader attached, even if either process is killed; a sender that closes
before its reader attached removes the name itself. Channels are created at
the first round that uses them and reused by every later refit on the same
group (an epoch); a plan with a busier round makes a bigger one.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["SHM_DIR", "Channel", "host_id"]

SHM_DIR = "/dev/shm"
_HEADER = 4096
_MAGIC = 0x7265736861726401
_W = 2  # header words: magic, slot bytes, announced[2], read[2], written bytes[2]
_R = 4
_B = 6
CHUNK_BYTES = 4 << 20
"""A reader copies out what is written in pieces of this size."""


def host_id() -> str:
    """What two processes must share to map one shared-memory object: the
    machine (hostname and boot id) and the ``/dev/shm`` mount."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        st = os.stat(SHM_DIR)
        mount = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        return ""
    return f"{socket.gethostname()}/{boot}/{mount}"


def channel_name(namespace: str, epoch: int, src: int, src_pid: int, dst: int, slot_bytes: int) -> str:
    """The file name of the channel from ``src`` to ``dst`` (both sides derive
    it: the job's namespace, the epoch, the sender's pid, the slot size)."""
    tag = hashlib.blake2b(namespace.encode(), digest_size=6).hexdigest()
    return f"reshard-{tag}-e{epoch}-{src}.{src_pid}-{dst}-{slot_bytes}"


class Channel:
    """One direction of a shared-memory link (see the module docstring)."""

    def __init__(self, name: str, slot_bytes: int, *, create: bool, deadline: float | None = None, watch=None) -> None:
        """``create``: the sender's side; otherwise wait (until ``deadline``,
        calling ``watch()``, which raises to give up) for the sender to create it."""
        import torch

        self.name = name
        self.slot_bytes = slot_bytes
        self.path = os.path.join(SHM_DIR, name)
        self.linked = False
        size = _HEADER + 2 * slot_bytes
        if create:
            tmp = f"{self.path}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size)
                self._mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)
            self.head = self.buf[:_HEADER].view(torch.int64)
            self.head[1] = slot_bytes
            self.head[0] = _MAGIC
            os.replace(tmp, self.path)
            self.linked = True
            return
        pause = 0.0005
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"shared-memory channel {name} was never created") from None
                if watch is not None:
                    watch()
                time.sleep(pause)
                pause = min(pause * 2, 0.01)
                continue
            break
        try:
            if os.fstat(fd).st_size != size:
                raise RuntimeError(f"shared-memory channel {name} has {os.fstat(fd).st_size} bytes, expected {size}")
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        # Mapped: the name is no longer needed, and nothing is left behind.
        _unlink(self.path)
        self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.head = self.buf[:_HEADER].view(torch.int64)
        if int(self.head[0]) != _MAGIC or int(self.head[1]) != slot_bytes:
            raise RuntimeError(f"shared-memory channel {name} has a bad header")

    def _slot(self, seq: int) -> torch.Tensor:
        s = seq % 2
        return self.buf.narrow(0, _HEADER + s * self.slot_bytes, self.slot_bytes)

    def put(
        self, seq: int, parts: Sequence[tuple[int, torch.Tensor]], watch: Callable[[], None], deadline: float
    ) -> None:
        """Send round ``seq`` (1, 2, ... on this channel): ``parts`` are
        ``(offset, bytes)`` within the slot. Waits for the slot to be free."""
        s = seq % 2
        head = self.head
        _wait(_reached(head, _R + s, seq - 2), watch, deadline)
        slot = self._slot(seq)
        head[_B + s] = 0
        head[_W + s] = seq
        for off, data in parts:
            n = data.numel()
            for a in range(0, n, CHUNK_BYTES):
                b = min(n, a + CHUNK_BYTES)
                slot.narrow(0, off + a, b - a).copy_(data.narrow(0, a, b - a))
                head[_B + s] = off + b

    def get(
        self, seq: int, parts: Sequence[tuple[int, torch.Tensor]], watch: Callable[[], None], deadline: float
    ) -> None:
        """Receive round ``seq`` into ``parts`` (``(offset, buffer)``), then release its slot."""
        s = seq % 2
        head = self.head
        _wait(_reached(head, _W + s, seq), watch, deadline)
        slot = self._slot(seq)
        for off, out in parts:
            n = out.numel()
            for a in range(0, n, CHUNK_BYTES):
                b = min(n, a + CHUNK_BYTES)
                _wait(_reached(head, _B + s, off + b), watch, deadline)
                out.narrow(0, a, b - a).copy_(slot.narrow(0, off + a, b - a))
        head[_R + s] = seq

    def close(self) -> None:
        """Unmap (once no tensor views it) and remove the name if still there."""
        if self.linked:
            _unlink(self.path)
            self.linked = False
        self.head = self.buf = None  # type: ignore[assignment]
        mm, self._mm = self._mm, None  # type: ignore[assignment]
        if mm is not None:
            # A view still alive keeps the mapping; it goes with the view.
            with contextlib.suppress(BufferError):
                mm.close()


def _reached(head: torch.Tensor, word: int, value: int) -> Callable[[], bool]:
    return lambda: int(head[word]) >= value


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _wait(ready: Callable[[], bool], watch: Callable[[], None], deadline: float) -> None:
    """Spin briefly, then poll with a growing pause (at most 1 ms), calling
    ``watch()`` every 50 ms (it raises to give up) until ``ready()``."""
    if ready():
        return
    spins = 0
    pause = 0.00005
    next_watch = time.monotonic() + 0.05
    while not ready():
        spins += 1
        if spins < 200:
            continue
        time.sleep(pause)
        pause = min(pause * 2, 0.001)
        now = time.monotonic()
        if now >= next_watch:
            next_watch = now + 0.05
            watch()
            if now >= deadline:
                raise TimeoutError("the shared-memory peer did not move within the timeout")
