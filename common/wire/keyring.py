"""The key material of one PSK (sans-IO): the static handshake AEADs and each session's key derivation.

The key schedule and why each key is fresh are :mod:`.seal`'s module docstring (the security design).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from typing import Final

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from pfec.common.wire.messages import RANDOM_SIZE

__all__ = [
    "KEY_SIZE",
    "MIN_PSK_SIZE",
    "Keyring",
    "RandomBytes",
    "check_psk",
    "check_random",
    "check_sid",
    "keyring_for",
]

KEY_SIZE: Final = 32
MIN_PSK_SIZE: Final = 32

RandomBytes = Callable[[int], bytes]  # n -> n fresh random bytes (os.urandom in the daemons)

_U64_MAX: Final = 0xFFFF_FFFF_FFFF_FFFF
_SID = struct.Struct(">Q")



def check_psk(psk: bytes) -> bytes:
    if not isinstance(psk, (bytes, bytearray)) or len(psk) < MIN_PSK_SIZE:
        raise ValueError(f"psk must be at least {MIN_PSK_SIZE} bytes")
    return bytes(psk)


def _hkdf(psk: bytes, salt: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_SIZE, salt=salt, info=info).derive(psk)


def check_sid(session_id: int) -> None:
    if not isinstance(session_id, int) or not 0 <= session_id <= _U64_MAX:
        raise ValueError(f"session_id must be a u64, got {session_id!r}")


def check_random(value: bytes, what: str) -> bytes:
    if not isinstance(value, (bytes, bytearray)) or len(value) != RANDOM_SIZE:
        raise ValueError(f"{what} must be {RANDOM_SIZE} bytes")
    return bytes(value)


class Keyring:
    """The key material of one PSK: the two static handshake AEADs, derived once here, and the derivation
    of each session's early and session keys. One per daemon, endpoint or simulation (see the module doc).

    ``derivations`` counts HKDF derivations (a forged datagram must cause none)."""

    __slots__ = ("_psk", "authenticate", "derivations", "hs_r2s", "hs_s2r")

    def __init__(self, psk: bytes, *, authenticate: bool = True) -> None:
        self._psk = check_psk(psk)
        self.authenticate = authenticate
        self.derivations = 0
        self.hs_s2r = self._aead(b"pfec/2 handshake", b"pfec/2 hs s2r")
        self.hs_r2s = self._aead(b"pfec/2 handshake", b"pfec/2 hs r2s")

    def _aead(self, salt: bytes, info: bytes) -> AESGCM | None:
        self.derivations += 1
        key = _hkdf(self._psk, salt, info)
        return AESGCM(key) if self.authenticate else None

    def early(self, session_id: int, sender_random: bytes) -> AESGCM | None:
        """K0_s2r: the sender's early key (data and CLOSE before the ACCEPT)."""
        check_sid(session_id)
        r_s = check_random(sender_random, "sender_random")
        return self._aead(r_s, b"pfec/2 s2r-early" + _SID.pack(session_id))

    def session(
        self, session_id: int, sender_random: bytes, receiver_random: bytes
    ) -> tuple[AESGCM | None, AESGCM | None]:
        """(K_s2r, K_r2s): the session keys, each direction fresh from its own side's randomness."""
        check_sid(session_id)
        salt = check_random(sender_random, "sender_random")
        salt += check_random(receiver_random, "receiver_random")
        sid = _SID.pack(session_id)
        return self._aead(salt, b"pfec/2 s2r" + sid), self._aead(salt, b"pfec/2 r2s" + sid)


@functools.lru_cache(maxsize=8)
def keyring_for(psk: bytes, authenticate: bool = True) -> Keyring:
    """The shared :class:`Keyring` of ``psk`` (built once: the sender assembles a session per handoff)."""
    return Keyring(psk, authenticate=authenticate)
