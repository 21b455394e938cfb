"""Handshake datagrams (sans-IO): sealing and opening under the static handshake keys, and the errors
opening a datagram raises (with the reason a receive path counts a drop under).

The design (what is sealed under which key, what is associated data) is :mod:`.seal`'s module docstring.
"""

from __future__ import annotations

from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pfec.common.wire.encoding import encode_body
from pfec.common.wire.frames import decode_checked_body, pack_header
from pfec.common.wire.keyring import Keyring, check_random
from pfec.common.wire.messages import (
    HEADER_SIZE,
    MAX_BODY,
    NONCE_SIZE,
    OVERHEAD,
    TAG_SIZE,
    U32_MAX,
    WIRE_VERSION,
    Header,
    KeyPhase,
    Message,
    MsgType,
    ParseError,
    ParseReason,
    Role,
    body_bounds,
    phases_sent_by,
)

__all__ = [
    "AuthError",
    "ByteBuffer",
    "MalformedError",
    "ReplayError",
    "drop_reason",
    "open_handshake",
    "seal_handshake",
]

_ZERO_TAG: Final = bytes(TAG_SIZE)
_HANDSHAKE: Final = int(KeyPhase.HANDSHAKE)
_HS_PHASE: Final = KeyPhase.HANDSHAKE
_HS_OFFSET: Final = HEADER_SIZE + NONCE_SIZE  # where a handshake datagram's ciphertext starts

ByteBuffer = bytes | bytearray | memoryview


class AuthError(ParseError):
    """The authentication tag did not verify (wrong key, tampering, corruption)."""

    def __init__(self, reason: ParseReason = "auth", detail: str = "") -> None:
        super().__init__(reason, detail)


class ReplayError(ParseError):
    """Duplicate packet number (``replay``) or one older than the window (``too_old``)."""


class MalformedError(ParseError):
    """An authentic datagram whose body fields are out of their domain: the key holder's bug, not junk."""


def drop_reason(exc: ParseError) -> str:
    """The reason a receive path counts a rejected datagram under: junk (nothing authenticated) is
    ``junk_header`` or ``junk_auth`` whatever type it claims; ``bad_version`` (a peer on another wire
    version); after authentication ``replay``, ``too_old`` or ``malformed`` (an authentic body out of its
    domain: the key holder's bug)."""
    if isinstance(exc, ReplayError):
        return exc.reason
    if isinstance(exc, MalformedError):
        return "malformed"
    if isinstance(exc, AuthError):
        return "junk_auth"
    return "bad_version" if exc.reason == "bad_version" else "junk_header"


def _decode(mtype: int, body: memoryview) -> Message:
    try:
        return decode_checked_body(mtype, body)
    except ParseError as exc:
        raise MalformedError(exc.reason, str(exc)) from None


# --------------------------------------------------------------------------- handshake datagrams


def _handshake_aead(keyring: Keyring, sealer: Role) -> AESGCM | None:
    return keyring.hs_s2r if sealer is Role.SENDER else keyring.hs_r2s


def seal_handshake(
    keyring: Keyring, sealer: Role, msg: Message, session_id: int, packet_number: int, nonce: bytes,
    sender_random: bytes,
) -> bytes:
    """A handshake datagram: header (phase HANDSHAKE) | 12-byte nonce | AEAD(static key of the direction).

    The associated data is header + nonce, and for the receiver's datagrams (ACCEPT, REFUSE) also the
    sender's ``sender_random`` R_s. ValueError for a type ``sealer`` never seals in this phase, a bad field,
    a nonce of the wrong size or a body that would not fit."""
    mtype = msg.TYPE
    if (KeyPhase.HANDSHAKE, mtype) not in phases_sent_by(sealer):
        raise ValueError(f"{sealer.name} never seals {mtype.name} in the handshake phase")
    if len(nonce) != NONCE_SIZE:
        raise ValueError(f"handshake nonce must be {NONCE_SIZE} bytes")
    if not 1 <= packet_number <= U32_MAX:
        raise ValueError(f"packet number {packet_number!r} outside 1..{U32_MAX}")
    body = encode_body(msg)
    if len(body) > MAX_BODY - NONCE_SIZE:
        raise ValueError(f"{mtype.name} body of {len(body)} B does not fit a handshake datagram")
    header = pack_header(WIRE_VERSION, int(mtype) | _HANDSHAKE, session_id, packet_number)
    aead = _handshake_aead(keyring, sealer)
    if aead is None:
        return b"".join((header, nonce, body, _ZERO_TAG))
    aad = header + nonce if sealer is Role.SENDER else header + nonce + check_random(sender_random, "R_s")
    return header + nonce + aead.encrypt(nonce, body, aad)


def open_handshake(keyring: Keyring, opener: Role, header: Header, datagram: ByteBuffer,
                   sender_random: bytes = b"") -> Message:
    """Open a handshake datagram whose ``header`` :func:`.frames.peek_header` parsed; ``opener`` is the
    local role. A receiver's datagram (opened by the sender) must carry ``sender_random`` as associated
    data. Raises ParseError (``bad_type``, ``truncated``, ``bad_length``, ``auth``, ``bad_field``) only;
    no key is derived here (the static AEADs are the keyring's)."""
    sealer = Role.RECEIVER if opener is Role.SENDER else Role.SENDER
    mtype = header.type
    bounds = _HS_BOUNDS[sealer].get(mtype)
    if header.phase is not _HS_PHASE or bounds is None:
        raise ParseError("bad_type", f"{mtype.name} in phase {header.phase.name} not opened by {opener.name}")
    n = len(datagram)
    lo, hi = bounds
    blen = n - OVERHEAD - NONCE_SIZE
    if blen < lo:
        raise ParseError("truncated", f"{mtype.name} body {blen} B < {lo}")
    if blen > hi:
        raise ParseError("bad_length", f"{mtype.name} body {blen} B > {hi}")
    view = memoryview(datagram)
    aead = _handshake_aead(keyring, sealer)
    if aead is None:
        if view[n - TAG_SIZE :] != _ZERO_TAG:
            raise AuthError("auth", "non-zero tag in unauthenticated mode")
        body = view[_HS_OFFSET : n - TAG_SIZE]
    else:
        aad: ByteBuffer = view[:_HS_OFFSET]
        if sealer is Role.RECEIVER:
            aad = bytes(aad) + sender_random
        try:
            body = memoryview(aead.decrypt(view[HEADER_SIZE:_HS_OFFSET], view[_HS_OFFSET:], aad))
        except InvalidTag:
            raise AuthError("auth", f"{mtype.name} handshake datagram") from None
    return _decode(int(mtype), body)


# Body bounds of the handshake types each role seals (precomputed: a forged OFFER is rejected per datagram).
_HS_BOUNDS: Final[dict[Role, dict[MsgType, tuple[int, int]]]] = {
    role: {t: body_bounds(t, 0) for p, t in phases_sent_by(role) if p is KeyPhase.HANDSHAKE} for role in Role
}
