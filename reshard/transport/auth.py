"""The job token: keys on the store and sealed values.

Every refit of a job shares a secret *token* (``GroupConfig.token`` or
``$RESHARD_TOKEN``). From the token, the job name and the generation each
rank derives, with the standard library only:

- ``namespace``: where the job's keys live on the store (an HMAC of the token);
- ``fingerprint``: a public value the first rank to join puts on the store,
  so a rank with another token (or none) is refused with a clear error
  instead of waiting for peers it will never see;
- two secret keys that *seal* every value reshard writes: the payload is
  encrypted (a SHAKE-256 keystream, keyed by the secret key and a random
  nonce) and authenticated (HMAC-SHA256 over the store key, the nonce and
  the ciphertext; encrypt-then-MAC). A rank with a wrong token can neither
  read a layout nor write one that another rank accepts, and a value cannot
  be moved to another key.

The master key is PBKDF2-HMAC-SHA256 of the token (salted with the job and
generation), which slows a dictionary attack on a weak token; use a random
one (``python -c "import secrets; print(secrets.token_hex(32))"``).

Without a token everything is derived from the job name alone: values are
still sealed (a corrupted value is caught) but anyone can open them. See
``docs/security.md`` for what this does and does not protect.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from functools import lru_cache

from reshard.errors import MetadataError

__all__ = ["JobKeys", "job_keys"]

PBKDF2_ITERATIONS = 100_000
_NONCE = 16
_TAG = 32


@dataclass(frozen=True, slots=True)
class JobKeys:
    """Keys of one (token, job, generation); see the module docstring."""

    namespace: str
    fingerprint: str
    has_token: bool
    _enc: bytes = field(repr=False)
    _mac: bytes = field(repr=False)

    def seal(self, key: str, payload: bytes) -> bytes:
        """``nonce || ciphertext || tag`` for ``payload`` stored under ``key``."""
        nonce = secrets.token_bytes(_NONCE)
        ct = _xor(payload, self._stream(nonce, len(payload)))
        return nonce + ct + self._tag(key, nonce, ct)

    def open(self, key: str, sealed: bytes) -> bytes:
        """The payload of a value read from ``key``; :class:`MetadataError` if it
        was written with another token, under another key, or altered."""
        sealed = bytes(sealed)
        if len(sealed) < _NONCE + _TAG:
            raise MetadataError(f"refit metadata at {key!r} is {len(sealed)} bytes, too short to be sealed")
        nonce, ct, tag = sealed[:_NONCE], sealed[_NONCE:-_TAG], sealed[-_TAG:]
        if not hmac.compare_digest(tag, self._tag(key, nonce, ct)):
            raise MetadataError(
                f"refit metadata at {key!r} failed authentication: it was written with a different job token "
                "(or none), or altered on the store"
            )
        return _xor(ct, self._stream(nonce, len(ct)))

    def _stream(self, nonce: bytes, n: int) -> bytes:
        return hashlib.shake_256(self._enc + nonce).digest(n) if n else b""

    def _tag(self, key: str, nonce: bytes, ct: bytes) -> bytes:
        h = hmac.new(self._mac, digestmod=hashlib.sha256)
        k = key.encode()
        h.update(len(k).to_bytes(4, "little") + k + nonce)
        h.update(ct)
        return h.digest()


@lru_cache(maxsize=16)
def job_keys(token: str | None, job: str, generation: int) -> JobKeys:
    """Derive a job's keys (cached: PBKDF2 takes tens of milliseconds)."""
    salt = f"reshard/v1/{job}/g{generation}".encode()
    if token:
        master = hashlib.pbkdf2_hmac("sha256", token.encode(), salt, PBKDF2_ITERATIONS)
    else:
        master = hashlib.sha256(b"reshard/no-token/" + salt).digest()

    def derive(label: str) -> bytes:
        return hmac.new(master, label.encode(), hashlib.sha256).digest()

    return JobKeys(
        namespace=derive("namespace").hex()[:32],
        fingerprint=derive("fingerprint").hex()[:32],
        has_token=bool(token),
        _enc=derive("encrypt"),
        _mac=derive("authenticate"),
    )


def _xor(a: bytes, b: bytes) -> bytes:
    if len(a) > 4096:
        try:
            import numpy as np
        except ImportError:  # pragma: no cover
            pass
        else:
            return np.bitwise_xor(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)).tobytes()
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")
