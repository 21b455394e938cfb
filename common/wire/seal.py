"""Datagram protection (sans-IO): keys, AEAD sealing and opening, the replay window.

One :class:`PacketProtector` per session and local role. Keys:
HKDF-SHA256(psk, salt=b"pfec/1", info=b"pfec/1 s2r" | b"pfec/1 r2s" + u64 session_id),
32 bytes (AES-256-GCM). The cleartext header is the associated data and the packet number the
nonce (8 zero bytes + u32 pn), safe because every (session, direction) has its own key. With
``authenticate=False`` bodies travel in clear and the tag is a fixed all-zero field that is still
checked (identical datagram sizes).

Layouts and body parsing are :mod:`.frames`'s; opening fails with its ``ParseError`` or one of the
subclasses here (:class:`AuthError`, :class:`ReplayError`), sealing our own malformed message with
``ValueError``.
"""

from __future__ import annotations

import struct
from typing import Final, Literal

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from pfec.common.wire.frames import (
    decode_checked_body,
    encode_body,
    new_header,
    pack_header,
    pack_source_id,
    repair_fec_id,
    unpack_header,
)
from pfec.common.wire.messages import (
    HEADER_SIZE,
    OVERHEAD,
    TAG_SIZE,
    U32_MAX,
    WIRE_VERSION,
    Header,
    Message,
    MsgType,
    ParseError,
    ParseReason,
    Repair,
    Role,
    Source,
    body_bounds,
    check_symbol_size,
    types_received_by,
    types_sent_by,
)

__all__ = [
    "KEY_SIZE",
    "MIN_PSK_SIZE",
    "AuthError",
    "PacketProtector",
    "ReplayError",
    "derive_key",
]

KEY_SIZE: Final = 32
MIN_PSK_SIZE: Final = 32

_U64_MAX: Final = 0xFFFF_FFFF_FFFF_FFFF
_SID = struct.Struct(">Q")
_NONCE_PACK: Final = struct.Struct(">8xI").pack
_ZERO_TAG: Final = bytes(TAG_SIZE)
_SOURCE: Final = int(MsgType.SOURCE)
_REPAIR: Final = int(MsgType.REPAIR)
_MSGTYPE_BY_INT: Final = {int(t): t for t in MsgType}
_DATA_TYPES: Final = frozenset({MsgType.SOURCE, MsgType.REPAIR})

ByteBuffer = bytes | bytearray | memoryview


class AuthError(ParseError):
    """The authentication tag did not verify (wrong key, tampering, corruption)."""

    def __init__(self, reason: ParseReason = "auth", detail: str = "") -> None:
        super().__init__(reason, detail)


class ReplayError(ParseError):
    """Duplicate packet number (``replay``) or one older than the window (``too_old``)."""


def derive_key(psk: bytes, session_id: int, direction: Literal["s2r", "r2s"]) -> bytes:
    """HKDF-SHA256 key for one session and direction (s2r: sender -> receiver)."""
    if not isinstance(psk, (bytes, bytearray)) or len(psk) < MIN_PSK_SIZE:
        raise ValueError(f"psk must be at least {MIN_PSK_SIZE} bytes")
    if direction not in ("s2r", "r2s"):
        raise ValueError(f"direction must be 's2r' or 'r2s', got {direction!r}")
    if not isinstance(session_id, int) or not 0 <= session_id <= _U64_MAX:
        raise ValueError(f"session_id must be a u64, got {session_id!r}")
    info = b"pfec/1 " + direction.encode("ascii") + _SID.pack(session_id)
    return HKDF(algorithm=hashes.SHA256(), length=KEY_SIZE, salt=b"pfec/1", info=info).derive(bytes(psk))


class PacketProtector:
    """Seals outgoing and opens incoming datagrams of one session for one local role.

    Never build two protectors for the same (psk, session_id, role): the packet number
    is the nonce, so a second sealer would reuse nonces. Session ids must be fresh.

    ``symbol_size`` may be None where it is not known yet (a receiver before the OFFER, which
    tells it): SOURCE and REPAIR are then refused as ``bad_type`` until :meth:`set_symbol_size`.

    In ``open`` the order of checks is: size, version, session id, type (and direction),
    body length, packet number 0, AEAD tag, replay window (updated only after the tag
    verified), body fields. SOURCE/REPAIR symbols are memoryviews into the decrypted
    plaintext (authenticated mode) or into ``datagram`` itself (``authenticate=False``):
    in the latter case do not reuse a receive buffer while the message is alive.
    ``datagram`` must be a byte buffer (bytes, bytearray or a format-"B" memoryview).

    Replay window: ``ring[pn % W]`` holds the last packet number stored in that slot. A
    packet with ``largest - W < pn <= largest`` was received iff ``ring[pn % W] == pn``
    (a later writer of that slot would be >= pn + W > largest), so duplicate detection is
    O(1) with no bitmap shifting.
    """

    __slots__ = (
        "_bounds",
        "_largest",
        "_next_pn",
        "_opener",
        "_ring",
        "_role",
        "_sealer",
        "_send_types",
        "_sends_data",
        "_session_id",
        "_symbol_size",
        "_window",
    )

    def __init__(
        self,
        psk: bytes,
        session_id: int,
        role: Role,
        symbol_size: int | None,
        *,
        authenticate: bool = True,
        replay_window: int = 1024,
    ) -> None:
        if not isinstance(role, Role):
            raise ValueError(f"role must be a Role, got {role!r}")
        if symbol_size is not None:
            check_symbol_size(symbol_size)
        if not isinstance(replay_window, int) or not 1 <= replay_window <= 1 << 20:
            raise ValueError(f"replay_window must be an int in [1, 2**20], got {replay_window!r}")
        k_s2r = derive_key(psk, session_id, "s2r")
        k_r2s = derive_key(psk, session_id, "r2s")
        k_out, k_in = (k_s2r, k_r2s) if role is Role.SENDER else (k_r2s, k_s2r)
        self._sealer: AESGCM | None = AESGCM(k_out) if authenticate else None
        self._opener: AESGCM | None = AESGCM(k_in) if authenticate else None
        self._role = role
        self._session_id = session_id
        self._window = replay_window
        self._ring = [0] * replay_window
        self._largest = 0
        self._next_pn = 1
        send = types_sent_by(role)
        self._send_types = frozenset(int(t) for t in send)
        self._sends_data = MsgType.SOURCE in send
        self._symbol_size = symbol_size
        self._bounds: dict[int, tuple[int, int]] = {}
        self._set_bounds()

    def _set_bounds(self) -> None:
        """(min, max) body size of each type this role opens; the data types' need the symbol size."""
        size = self._symbol_size
        opened = [t for t in types_received_by(self._role) if size is not None or t not in _DATA_TYPES]
        self._bounds = {int(t): body_bounds(t, size or 0) for t in opened}  # size 0: never a data type

    def set_symbol_size(self, symbol_size: int) -> None:
        """Fix the session's symbol size (a receiver learns it from the OFFER), once."""
        if self._symbol_size is not None:
            raise ValueError(f"symbol_size is already {self._symbol_size}")
        check_symbol_size(symbol_size)
        self._symbol_size = symbol_size
        self._set_bounds()

    # read-only view -------------------------------------------------------------
    @property
    def session_id(self) -> int:
        return self._session_id

    @property
    def role(self) -> Role:
        return self._role

    @property
    def symbol_size(self) -> int | None:
        return self._symbol_size

    @property
    def authenticate(self) -> bool:
        return self._sealer is not None

    @property
    def replay_window(self) -> int:
        return self._window

    @property
    def packets_sealed(self) -> int:
        return self._next_pn - 1

    @property
    def largest_received_pn(self) -> int:
        """Largest authenticated packet number received (0 before any)."""
        return self._largest

    # sealing --------------------------------------------------------------------
    def seal(self, msg: Message) -> bytes:
        """Encode and protect ``msg`` with the next packet number.

        ValueError for out-of-range fields, a wrong symbol length, a type this role
        never sends, or an exhausted packet-number space; the number is then not used.
        """
        if type(msg) is Source:
            return self.seal_source(msg.esi, msg.symbol)
        if type(msg) is Repair:
            return self.seal_repair(msg.repair_key, msg.dt, msg.nss, msg.fss_esi, msg.symbol)
        body = encode_body(msg, self._symbol_size)
        mtype = msg.TYPE
        if mtype not in self._send_types:
            raise ValueError(f"{self._role.name} never sends {mtype.name}")
        return self._protect(mtype, body, b"")

    def seal_source(self, esi: int, symbol: bytes | memoryview) -> bytes:
        """``seal(Source(esi, symbol))`` without building the message: the sender's per-datagram path."""
        try:
            fec_id = pack_source_id(esi)
        except struct.error as exc:
            raise ValueError(f"SOURCE: esi out of range: {esi!r}") from exc
        return self._protect(_SOURCE, fec_id, symbol)

    def seal_repair(
        self, repair_key: int, dt: int, nss: int, fss_esi: int, symbol: bytes | memoryview
    ) -> bytes:
        """``seal(Repair(...))`` without building the message: the sender's per-repair path."""
        return self._protect(_REPAIR, repair_fec_id(repair_key, dt, nss, fss_esi), symbol)

    def _protect(self, mtype: int, head: bytes, tail: bytes | memoryview) -> bytes:
        """Header and protected body ``head + tail`` under the next packet number, which is then spent.

        For SOURCE and REPAIR ``head`` is the FEC Payload ID and ``tail`` the symbol, checked here; for the
        other types ``head`` is the whole body and ``tail`` empty. One flat function: it runs per datagram.
        """
        pn = self._next_pn
        if pn > U32_MAX:
            raise ValueError("packet number space exhausted; start a new session")
        if mtype <= _REPAIR and (
            not self._sends_data
            or len(tail) != self._symbol_size
            or (type(tail) is memoryview and tail.itemsize != 1)
        ):
            raise self._symbol_error(mtype, tail)
        header = pack_header(WIRE_VERSION, mtype, self._session_id, pn)
        if self._sealer is None:
            out = b"".join((header, head, tail, _ZERO_TAG))
        else:
            out = header + self._sealer.encrypt(_NONCE_PACK(pn), head + tail, header)
        self._next_pn = pn + 1
        return out

    def _symbol_error(self, mtype: int, symbol: bytes | memoryview) -> ValueError:
        name = _MSGTYPE_BY_INT[mtype].name
        if not self._sends_data:
            return ValueError(f"{self._role.name} never sends {name}")
        size = memoryview(symbol).nbytes
        return ValueError(f"{name} symbol of {size} B, symbol_size is {self._symbol_size}")

    # opening --------------------------------------------------------------------
    def open(self, datagram: ByteBuffer) -> tuple[Header, Message]:
        """Verify and parse one datagram; raises ParseError (or a subclass) only."""
        version, mtype, sid, pn = unpack_header(datagram)
        msg = self._open_body(sid, mtype, pn, datagram, len(datagram))
        return new_header(version, _MSGTYPE_BY_INT[mtype], sid, pn), msg

    def open_peeked(self, header: Header, datagram: ByteBuffer) -> Message:
        """:meth:`open` for a datagram whose ``header`` :func:`.frames.peek_header` already parsed and
        checked (size, version, type, packet number 0): the receiver's demultiplexer parses it once."""
        return self._open_body(header.session_id, header.type, header.packet_number, datagram, len(datagram))

    def _open_body(self, sid: int, mtype: int, pn: int, datagram: ByteBuffer, n: int) -> Message:
        """Every check after the header's own, then the body's message; the replay window is updated last."""
        if sid != self._session_id:
            raise ParseError("wrong_session", f"session {sid:#x}")
        bounds = self._bounds.get(mtype)
        if bounds is None:
            raise ParseError("bad_type", f"type {mtype} not accepted by {self._role.name}")
        blen = n - OVERHEAD
        if blen < bounds[0]:
            raise ParseError("truncated", f"type {mtype} body {blen} B < {bounds[0]}")
        if blen > bounds[1]:
            raise ParseError("bad_length", f"type {mtype} body {blen} B > {bounds[1]}")
        if pn == 0:
            raise ParseError("bad_field", "packet number 0")
        view = memoryview(datagram)
        body: memoryview
        if self._opener is not None:
            try:
                plain = self._opener.decrypt(_NONCE_PACK(pn), view[HEADER_SIZE:], view[:HEADER_SIZE])
                body = memoryview(plain)
            except InvalidTag:
                raise AuthError("auth", f"packet {pn}") from None
        else:
            if view[n - TAG_SIZE :] != _ZERO_TAG:
                raise AuthError("auth", f"packet {pn}: non-zero tag in unauthenticated mode")
            body = view[HEADER_SIZE : n - TAG_SIZE]
        # Replay window: checked now that the packet is authentic, updated once it also parsed.
        largest = self._largest
        if pn <= largest:
            if largest - pn >= self._window:
                raise ReplayError("too_old", f"packet {pn}, largest {largest}")
            if self._ring[pn % self._window] == pn:
                raise ReplayError("replay", f"packet {pn}")
        msg = decode_checked_body(mtype, body)
        if pn > largest:
            self._largest = pn
        self._ring[pn % self._window] = pn
        return msg
