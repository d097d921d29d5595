"""Where a sender's delta speeds come from (:class:`reshard.plan.delta_format.Speeds`).

A delta part pays when gathering and patching its changes costs less time
than the bytes it saves on the wire (:func:`reshard.plan.delta_format.pays`).
Both numbers are measured on the sender, where the choice is made; the
receiver learns each choice from the round's header, so the two ranks agree
without another message, and the choice is a pure function of what the
header carries and these two numbers.

- ``wire_s_per_byte``: this rank's last refit whose bytes were mostly
  dense (the first refit of a group is, and so is any refit after a
  failure, or one whose parts went dense): its transfer seconds, less
  the time it spent encoding and keeping its snapshot (which the first
  refit creates), over the bytes it sent. It is what a dense
  byte really costs on the way this group runs (links, the peers' speed at
  taking it, contention), not a link's nominal speed.
- ``change_s``: measured once per process and device, by the encoder and
  applier the refits use (compiled, numpy or torch): a part of
  :data:`CALIBRATION_ELEMENTS` 2-byte elements (32 MB: larger than caches,
  as real parts are; a change then costs its cache lines, not only its
  instructions) encoded with nothing changed and with 1 in 32 changed, and
  its ``sparse`` part applied; the extra encode time plus the apply time,
  over the changes (best of :data:`CALIBRATION_REPEATS`). The receiver's
  patch is taken to run as fast as the sender's (the same code on the same
  kind of device). Taken once the group's first refit succeeded (it
  takes about half a second on a CPU), not during a transfer.

Until a dense refit was measured the choice is by bytes alone. A caller may
pin both numbers (:attr:`SpeedMeter.pinned`; the tests do, for choices they
can predict).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from reshard.plan.delta_format import SPARSE, Speeds, part_size
from reshard.transport.stats import ExecStats

if TYPE_CHECKING:
    import torch

__all__ = ["CALIBRATION_ELEMENTS", "CALIBRATION_REPEATS", "SpeedMeter", "change_seconds"]

CALIBRATION_ELEMENTS = 1 << 24
CALIBRATION_REPEATS = 3
_MIN_BYTES = 1 << 20
"""A dense refit that sent less than this says more about latency than about bytes: not measured."""

_lock = threading.Lock()
_change_s: dict[str, float] = {}


def change_seconds(device: torch.device | str) -> float:
    """Seconds one changed element costs to gather and to patch on ``device``
    (measured once per process and device type; see the module docstring)."""
    import torch

    device = torch.device(device)
    key = device.type
    with _lock:
        if key in _change_s:
            return _change_s[key]
        _change_s[key] = value = _calibrate(device)
        return value


def _calibrate(device: torch.device) -> float:
    import torch

    from reshard.transport.encoding import apply_part, encode_part

    n = CALIBRATION_ELEMENTS
    base = torch.arange(n, dtype=torch.int32).to(torch.int16)  # host: moved below
    new = base.clone()
    # One change in each run of 32 elements, at a random place in it (a
    # regular stride would let the branch predictor learn it).
    g = torch.Generator().manual_seed(0)
    idx = torch.arange(0, n, 32) + torch.randint(0, 32, (n // 32,), generator=g)  # host: moved below
    new[idx] ^= 1
    base, new = base.to(device), new.to(device)
    out = torch.empty(part_size(SPARSE, n, n, 2) + 2 * n, dtype=torch.uint8, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tiny = torch.zeros(64, dtype=torch.int16, device=device)
    encode_part(tiny, tiny.clone(), out)  # compiles the kernels (once per process)
    same = changed = applied = float("inf")
    for _ in range(CALIBRATION_REPEATS):
        snap = new.clone()
        sync()
        t0 = time.perf_counter()
        encode_part(new, snap, out)
        sync()
        t1 = time.perf_counter()
        snap.copy_(base)
        sync()
        t2 = time.perf_counter()
        enc, k, size = encode_part(new, snap, out)
        sync()
        t3 = time.perf_counter()
        dst = base.clone()
        sync()
        t4 = time.perf_counter()
        apply_part(enc, k, out[:size], dst)
        sync()
        t5 = time.perf_counter()
        same, changed, applied = min(same, t1 - t0), min(changed, t3 - t2), min(applied, t5 - t4)
    return max(changed - same, 0.0) / (n // 32) + applied / (n // 32)


class SpeedMeter:
    """A sender's speeds across refits (held by its :class:`~reshard.transport.delta.DeltaState`)."""

    def __init__(self) -> None:
        self.wire_s_per_byte: float | None = None
        """From the last all-dense refit (``None``: none measured yet)."""
        self.pinned: Speeds | None = None
        """Speeds to use instead of measuring (``None``: measure)."""

    def saw(self, stats: ExecStats, device: torch.device | str) -> None:
        """After a successful refit: take the wire speed from it if its bytes
        were mostly dense (at least a quarter of a dense refit's: a float32
        trainer's dense parts travel in the engines' bf16), and calibrate
        the change cost if not done yet (off any transfer)."""
        if self.pinned is None:
            change_seconds(device)
        if stats.bytes_sent < max(_MIN_BYTES, stats.dense_bytes // 4):
            return
        # Less the delta work: encoding, and the snapshot's copy of dense parts
        # (on the first refit also its creation, page faults and all).
        seconds = stats.seconds - sum(stats.phase_seconds.get(p, 0.0) for p in ("encode", "snapshot"))
        if seconds > 0:
            self.wire_s_per_byte = seconds / stats.bytes_sent

    def speeds(self, device: torch.device | str) -> Speeds | None:
        """The speeds a refit's choices use (``None``: bytes alone decide)."""
        if self.pinned is not None:
            return self.pinned
        if self.wire_s_per_byte is None:
            return None
        return Speeds(wire_s_per_byte=self.wire_s_per_byte, change_s=change_seconds(device))
