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

One copy instead of two (``GroupConfig.export_sources``): a sender moves
each CPU source tensor's storage into shared memory once, in place (every
view of it, an FSDP flat buffer's included, sees the same bytes, as
``Tensor.share_memory_()`` does), and publishes each tensor's file
descriptor and view (:class:`~reshard.transport.wire.Export`) in the store
once per change; its plan status carries only their digest.
A colocated receiver maps the storage read-only through
``/proc/<pid>/fd/<fd>`` once (kept across refits) and copies the slices it
keeps straight out of it; those transfers never enter a channel. The
sender is inside its push for the whole refit, so the bytes hold refit
``n`` while receivers read them, and it returns only when every receiver
reported done. The descriptors belong to the sender (unlinked from the
start): nothing is left in ``/dev/shm`` when it exits or is killed.

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
import resource
import socket
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from reshard.transport.wire import Export

__all__ = ["SHM_DIR", "Channel", "ExportMaps", "Exporter", "host_id"]

SHM_DIR = "/dev/shm"
_HEADER = 4096
_MAGIC = 0x7265736861726401
_W = 2  # header words: magic, slot bytes, announced[2], read[2], written bytes[2]
_R = 4
_B = 6
CHUNK_BYTES = 4 << 20
"""A reader copies out what is written in pieces of this size."""
SHM_HEADROOM = 256 << 20
"""Free space ``/dev/shm`` must keep after a sender exports its tensors
(a full tmpfs would kill a writer with SIGBUS, so a sender that does not
fit exports nothing and its bytes take the channels)."""


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
            self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)  # host: a mapping
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
        self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)  # host: a mapping
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


class Exporter:
    """A sender's CPU source tensors in shared memory (see the module docstring)."""

    def __init__(self) -> None:
        self._inodes: dict[tuple[int, int, int], int] = {}
        self.refused = ""
        """Why the last call exported less than it was given (empty: it did not)."""

    def exports(self, tensors: Mapping[str, torch.Tensor]) -> tuple[Export, ...]:
        """Move the storages of ``tensors`` that are not yet shared into shared
        memory (once) and describe each tensor's view of its storage."""
        import torch

        from reshard.transport.wire import Export

        self.refused = ""
        cpu = {n: t for n, t in tensors.items() if t.device.type == "cpu" and t.layout == torch.strided}
        if len(cpu) < len(tensors):
            self.refused = f"{len(tensors) - len(cpu)} tensors are not strided CPU tensors"
        seen: set[int] = set()
        need = 0
        for t in cpu.values():
            st = t.untyped_storage()
            if not st.is_shared() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                need += st.nbytes()
        if need:
            vfs = os.statvfs(SHM_DIR)
            free = vfs.f_bavail * vfs.f_frsize
            if free < need + SHM_HEADROOM:
                self.refused = (
                    f"{SHM_DIR} has {free >> 20} MiB free; exporting needs {need >> 20} MiB "
                    f"and keeps {SHM_HEADROOM >> 20} MiB"
                )
                return ()
            _raise_fd_limit(len(seen))
        out = []
        for name, t in sorted(cpu.items()):
            st = t.untyped_storage()
            try:
                fd, size = st._share_fd_cpu_()
            except (RuntimeError, OSError) as e:
                self.refused = f"tensor {name!r}: {e}"
                continue
            key = (st.data_ptr(), size, fd)
            inode = self._inodes.get(key)
            if inode is None:
                inode = self._inodes[key] = os.fstat(fd).st_ino
            out.append(
                Export(
                    local=name,
                    fd=fd,
                    inode=inode,
                    storage_bytes=size,
                    dtype=str(t.dtype).removeprefix("torch."),
                    shape=tuple(t.shape),
                    stride=tuple(t.stride()),
                    offset=int(t.storage_offset()),
                )
            )
        return tuple(out)


class ExportMaps:
    """A receiver's read-only mappings of colocated senders' exported
    storages, each mapped once and kept while later refits use it."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int, int], tuple[mmap.mmap, torch.Tensor]] = {}

    def tensor(self, pid: int, e: Export) -> torch.Tensor:
        """The sender's tensor ``e`` (process ``pid``), viewed in this process."""
        import torch

        key = (pid, e.fd, e.inode)
        got = self._maps.get(key)
        if got is None:
            path = f"/proc/{pid}/fd/{e.fd}"
            fd = os.open(path, os.O_RDONLY)
            try:
                st = os.fstat(fd)
                if st.st_ino != e.inode or st.st_size < e.storage_bytes:
                    raise RuntimeError(
                        f"{path} is not the storage of tensor {e.local!r} the sender exported "
                        f"(inode {st.st_ino}, {st.st_size} bytes; expected inode {e.inode}, {e.storage_bytes} bytes)"
                    )
                mm = mmap.mmap(fd, e.storage_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
            finally:
                os.close(fd)
            with warnings.catch_warnings():
                # Read-only on purpose: a receiver never writes a trainer's memory.
                warnings.simplefilter("ignore", UserWarning)
                buf = torch.frombuffer(mm, dtype=torch.uint8)  # host: a mapping
            got = self._maps[key] = (mm, buf)
        dtype = getattr(torch, e.dtype)
        return got[1].view(dtype).as_strided(e.shape, e.stride, e.offset)

    def retain(self, keys: set[tuple[int, int, int]]) -> None:
        """Unmap every storage not in ``keys`` (``(pid, fd, inode)``)."""
        for key in [k for k in self._maps if k not in keys]:
            _close_map(*self._maps.pop(key))

    def close(self) -> None:
        self.retain(set())


def _close_map(mm: mmap.mmap, buf: torch.Tensor) -> None:
    # A view still alive keeps the mapping; it goes with the view.
    with contextlib.suppress(BufferError):
        mm.close()


def _raise_fd_limit(more: int) -> None:
    """Each exported storage keeps a descriptor open: raise the soft limit
    towards the hard one when ``more`` of them would come close to it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = len(os.listdir("/proc/self/fd")) + more + 256
    if soft != resource.RLIM_INFINITY and want > soft:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
