"""CUDA IPC links between ranks on one host (CUDA tensors).

The GPU analogue of the shared-memory export path (:mod:`reshard.transport.shm`):
with ``GroupConfig(shared_memory=True)``, a source rank whose tensors are on
a GPU publishes, per tensor, the CUDA IPC handle of the allocation its
storage lies in, the storage's offset in it and the tensor's view
(:class:`~reshard.transport.wire.CudaIpc`, msgspec: no pickle). A
destination rank on the same host that sees that GPU (its hello lists the
GPUs it sees, by UUID, so both sides decide alike) opens the storage once,
keeps it open across refits, and copies the slices it keeps straight out of
it: a copy inside the GPU's memory when both ranks are on one GPU, a
peer-to-peer copy otherwise. Those transfers never enter NCCL, which
refuses two ranks of one communicator on one GPU.

Registration happens once per storage and receiver: torch's
``_share_cuda_`` wraps the storage in a reference-counted context each time
it is called (the block stays allocated while a receiver maps it), so the
sender calls it once per (storage, receiver, group epoch), only for the
receivers whose plan reads that storage (a counter nobody releases would
keep it allocated after the trainer frees it), and reuses the result; no
handle is made or opened again in later refits. A receiver opens each
storage once (``_new_shared_cuda``) and releases its counter when it drops
the mapping (a storage no longer published, or the group closed). Handles
are per allocation, and a process opens each allocation once however many
storages lie in it.

Consistency is the export path's: the sender synchronizes its device before
it posts its plan status (so the bytes are refit ``n``'s), stays in its push
for the whole refit, and returns only after every receiver reported done;
each receiver synchronizes the streams its copies ran on before it reports.
A receiver that dies fails the refit on every rank through the agreement.

Memory: a storage the trainer frees while a receiver still maps it stays
allocated (torch keeps it "in limbo") until the receiver drops the mapping,
which happens at the next refit that no longer publishes it, or when the
receiver's group closes. A receiver that dies never releases its counters:
the storages it mapped stay allocated, once freed by the trainer, until the
trainer's process exits (torch warns when many pile up).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from reshard.transport.wire import Export

__all__ = ["CudaExporter", "CudaImports", "gpu_uuid", "local_storage", "visible_gpus"]


def gpu_uuid(device: torch.device) -> str:
    """The UUID of a CUDA device (the same string in every process that sees it)."""
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


def visible_gpus() -> tuple[str, ...]:
    """The UUIDs of the GPUs this process sees, in its device order."""
    import torch

    if not torch.cuda.is_available():
        return ()
    return tuple(gpu_uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count()))


_LOCAL: dict[int, Any] = {}
"""Storages exported to receivers in this same process, by key
(:attr:`reshard.transport.wire.CudaIpc.local`): CUDA refuses to open an
IPC handle in the process that made it, so those receivers take the
storage itself from here."""


def local_storage(key: int) -> Any:
    """The storage this process exported under ``key`` to its own receivers."""
    st = _LOCAL.get(key)
    if st is None:
        raise RuntimeError(f"no storage {key:#x} is exported in this process")
    return st


class _Shared:
    """One CUDA storage exported: what every receiver in another process
    opens (registered once, on first need) and the reference counter of
    each; receivers in this process take the storage itself."""

    __slots__ = ("event", "event_sync", "handle", "local", "nbytes", "offset", "refs", "storage")

    def __init__(self, storage: Any) -> None:
        self.storage = storage  # held: its StorageImpl (and so its key) cannot be reused
        self.nbytes = int(storage.nbytes())
        self.handle = b""
        self.offset = 0
        self.event = b""
        self.event_sync = False
        self.refs: dict[int, tuple[bytes, int]] = {}
        self.local = 0
        """Its key in :data:`_LOCAL` (0: no receiver of this process reads it)."""

    def register(self, reader: int) -> None:
        """Register the storage for ``reader`` in another process (one
        reference counter each: the reader's to release)."""
        args = self.storage._share_cuda_()
        _device, handle, nbytes, offset, counter, counter_offset, event, event_sync = args
        if not self.refs and not self.handle:
            self.handle, self.nbytes, self.offset = bytes(handle), int(nbytes), int(offset)
            self.event = bytes(event) if event is not None else b""
            self.event_sync = bool(event_sync)
        elif bytes(handle) != self.handle or int(offset) != self.offset:
            raise RuntimeError("its IPC handle changed between registrations")
        self.refs[reader] = (bytes(counter), int(counter_offset))

    def share_locally(self) -> None:
        if not self.local:
            self.local = int(self.storage._cdata)
            _LOCAL[self.local] = self.storage

    def drop(self) -> None:
        if self.local:
            _LOCAL.pop(self.local, None)
            self.local = 0


class CudaExporter:
    """A sender's CUDA source tensors, registered for the receivers that map them."""

    def __init__(self) -> None:
        self._shared: dict[int, _Shared] = {}
        self._epoch = -1
        self.refused = ""
        """Why the last call exported less than it was given (empty: it did not)."""

    def exports(
        self,
        tensors: Mapping[str, torch.Tensor],
        readers: Mapping[str, Collection[int]],
        *,
        epoch: int,
        local: Collection[int] = (),
    ) -> tuple[Export, ...]:
        """Describe the strided CUDA tensors of ``tensors`` that ``readers``
        names (tensor name -> the destination ranks that read it), registering
        their storages for the readers not yet registered. Only readers that
        read a storage are registered for it: a registration nobody opens
        would keep the storage allocated after the trainer frees it. A new
        ``epoch`` (the group was rebuilt, and every receiver released what it
        mapped) registers everything afresh. ``local``: readers in this
        process, which take the storage itself (:func:`local_storage`)
        instead of opening a handle CUDA would refuse them."""
        import torch

        from reshard.transport.wire import CudaIpc, Export, IpcRef

        self.refused = ""
        if epoch != self._epoch:
            for shared in self._shared.values():
                shared.refs.clear()
            self._epoch = epoch
        kept: dict[int, _Shared] = {}
        uuids: dict[int, str] = {}
        out = []
        skipped = 0
        for name, t in sorted(tensors.items()):
            wanted = sorted(readers.get(name, ()))
            if not wanted:
                continue
            if t.device.type != "cuda" or t.layout != torch.strided:
                skipped += 1
                continue
            st = t.untyped_storage()
            if st.nbytes() == 0:
                continue  # nothing to read (and no allocation to share)
            key = int(st._cdata)
            entry: _Shared = kept.get(key) or self._shared.get(key) or _Shared(st)
            try:
                for r in wanted:
                    if r in local:
                        entry.share_locally()
                    elif r not in entry.refs:
                        entry.register(r)
            except (RuntimeError, TypeError, ValueError) as e:
                self.refused = f"tensor {name!r}: {e}"
                continue
            kept[key] = entry
            index = t.device.index if t.device.index is not None else torch.cuda.current_device()
            if index not in uuids:
                uuids[index] = gpu_uuid(torch.device("cuda", index))
            out.append(
                Export(
                    local=name,
                    fd=-1,
                    inode=0,
                    storage_bytes=entry.nbytes,
                    dtype=str(t.dtype).removeprefix("torch."),
                    shape=tuple(t.shape),
                    stride=tuple(t.stride()),
                    offset=int(t.storage_offset()),
                    cuda=CudaIpc(
                        gpu=uuids[index],
                        handle=entry.handle,
                        storage_offset=entry.offset,
                        event=entry.event,
                        event_sync=entry.event_sync,
                        refs=tuple(IpcRef(reader=r, counter=c, counter_offset=o) for r, (c, o) in entry.refs.items()),
                        local=entry.local,
                    ),
                )
            )
        if skipped and not self.refused:
            self.refused = f"{skipped} tensors are not strided CUDA tensors"
        # Storages no longer among the tensors are let go (freed with the
        # trainer's last reference, or once their receivers release them).
        for key, entry in self._shared.items():
            if key not in kept:
                entry.drop()
        self._shared = kept
        return tuple(out)


class CudaImports:
    """A receiver's opened CUDA storages of colocated senders, each opened
    once and kept while later refits use it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._maps: dict[tuple, Any] = {}
        self._index: dict[str, int] | None = None

    @staticmethod
    def key(pid: int, e: Export, *, local: bool = False) -> tuple:
        """What identifies the storage of ``e`` (exported by process ``pid``;
        ``local``: by this very process)."""
        assert e.cuda is not None
        if local:
            return ("local", e.cuda.local, e.storage_bytes)
        return ("cuda", pid, e.cuda.handle, e.cuda.storage_offset, e.storage_bytes)

    def _device_index(self, gpu: str) -> int:
        if self._index is None:
            self._index = {u: i for i, u in enumerate(visible_gpus())}
        i = self._index.get(gpu)
        if i is None:
            raise RuntimeError(f"GPU {gpu} is not visible to this process")
        return i

    def tensor(self, pid: int, e: Export, *, local: bool = False) -> torch.Tensor:
        """The sender's tensor ``e`` (process ``pid``), opened in this process;
        ``local``: exported by this very process, taken as it is."""
        import torch

        c = e.cuda
        assert c is not None
        key = self.key(pid, e, local=local)
        st = self._maps.get(key)
        if st is None and local:
            st = self._maps[key] = local_storage(c.local)
        if st is None:
            ref = next((r for r in c.refs if r.reader == self.rank), None)
            if ref is None:
                raise RuntimeError(f"tensor {e.local!r} was not registered for rank {self.rank}")
            torch.cuda._lazy_init()  # as torch's own rebuild does before opening a handle
            st = torch.UntypedStorage._new_shared_cuda(
                self._device_index(c.gpu),
                c.handle,
                e.storage_bytes,
                c.storage_offset,
                ref.counter,
                ref.counter_offset,
                c.event,
                c.event_sync,
            )
            self._maps[key] = st
        dtype = getattr(torch, e.dtype)
        return torch.empty(0, dtype=dtype, device=st.device).set_(st, e.offset, e.shape, e.stride)

    def retain(self, keys: Iterable[tuple]) -> None:
        """Release every storage not in ``keys`` (see :meth:`key`)."""
        keep = set(keys)
        for key in [k for k in self._maps if k not in keep]:
            del self._maps[key]

    def close(self) -> None:
        self._maps.clear()
