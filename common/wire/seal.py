"""Datagram protection (sans-IO): the keys, the handshake's sealing and opening, AEAD, the replay window.

Design (wire version 3: the handshake of version 2, plus the OFFER's decoder-span request)
------------------------------------------------------------------------------------------
Threat model: an on-path attacker without the pre-shared key (PSK) can capture, replay, drop, delay,
reorder and forge datagrams; a key holder is trusted to send KV but must not be able to crash, wedge or
exhaust the peer. Properties, and how each is met:

* **No (key, nonce) pair is ever used twice**, across restarts, replays, evictions and session-id reuse.
  Each side seals under a key that depends on fresh randomness of its own (as TLS, QUIC and WireGuard do):

  - ``K_hs_s2r``, ``K_hs_r2s`` = HKDF(psk, salt "pfec/2 handshake", info "pfec/2 hs s2r" / "... r2s"):
    static, derived once per :class:`Keyring` (one per daemon, endpoint or simulation). They seal only
    handshake datagrams (OFFER; ACCEPT and a REFUSE before any session), each with an explicit random
    12-byte nonce right after the header; header and nonce are the associated data, and a receiver's
    handshake datagram also authenticates the sender's R_s (an implicit echo: the sender opens an ACCEPT
    or REFUSE only for its own attempt). Random 96-bit nonces under one key stay within NIST SP 800-38D's
    bound for 2^32 seals per key: rotate the PSK before 2^32 handshake datagrams (about 1.4 years at 100
    handshake datagrams per second). An ACCEPT repeated for a retried OFFER is the same bytes again
    (identical ciphertext, not a second seal).
  - ``K0_s2r`` = HKDF(psk, salt R_s, info "pfec/2 s2r-early" + u64 session id): the sender's early data
    (and a CLOSE) before the ACCEPT. R_s is 16 fresh bytes per session from the sender.
  - ``K_s2r`` / ``K_r2s`` = HKDF(psk, salt R_s + R_r, info "pfec/2 s2r" / "pfec/2 r2s" + u64 session
    id): everything after the ACCEPT, starting with the OFFER's last part sealed once more under K_s2r
    (so the receiver establishes even when no data is left to send). R_r is 16 fresh bytes per ACCEPT
    from the receiver (a pending handshake draws it once and re-sends the same sealed ACCEPT).

  Packet numbers (one u32 space per session and direction, over every phase) are the nonces of the early
  and session phases (8 zero bytes + u32 pn). The sender's keys are fresh because R_s is; the receiver's
  (K_r2s) because R_r is, even when a replayed OFFER carries an old R_s to a restarted receiver.
* **A replay opens nothing.** An authentic OFFER only creates a small pending handshake entry at the
  receiver (bounded, expiring) and gets an ACCEPT back; a session exists once a datagram opens under
  K_s2r, which needs R_r: a proof that the peer holds the PSK and saw this receiver's fresh value.
  Replayed data opens under no key the receiver holds (new R_r) or meets no session.
* **Anti-amplification** (RFC 9000 section 8.1): before establishment a pending entry sends at most 3x
  the authenticated bytes it received (an ACCEPT is 116 B; an OFFER at least 108 B).
* **Cheap rejection.** Nothing is derived before authentication: a datagram without the key costs one
  AES-GCM open with an AEAD object built once (the static handshake keys), or with the session's own
  (a forged OFFER: about 5 us of CPU on the 2-core dev machine, against about 21 us with the two HKDF
  derivations and the protector it cost before). Session keys are derived once per pending handshake,
  when its first early or session datagram arrives.
* **Bounded handshake state.** Pending handshakes are few (``max_handshakes``), expire
  (``handshake_timeout_s``), hold a bounded number of OFFER parts and early datagrams, and a session id
  they ended is remembered (``closed_memory``), so a replayed OFFER is dropped cheaply for a while.
* **Cleartext**: the 14-byte header (version, phase and type, session id, packet number) is
  authenticated, not encrypted. ``authenticate=False`` (the simulator's speed mode) keeps every layout and
  size and an all-zero, still checked, tag.

Layouts and body parsing are :mod:`.frames`'s; opening fails with its ``ParseError`` or one of the
subclasses here (:class:`AuthError`, :class:`ReplayError`), sealing our own malformed message with
``ValueError``.
"""

from __future__ import annotations

import os
import struct
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pfec.common.wire.encoding import encode_body, repair_fec_id
from pfec.common.wire.frames import (
    decode_checked_body,
    new_header,
    pack_header,
    pack_source_id,
    unpack_header,
)
from pfec.common.wire.handshake import (
    AuthError,
    ByteBuffer,
    MalformedError,
    ReplayError,
    drop_reason,
    open_handshake,
    seal_handshake,
)
from pfec.common.wire.keyring import (
    KEY_SIZE,
    MIN_PSK_SIZE,
    Keyring,
    RandomBytes,
    check_psk,
    check_random,
    check_sid,
    keyring_for,
)
from pfec.common.wire.messages import (
    HEADER_SIZE,
    NONCE_SIZE,
    OVERHEAD,
    PHASE_BY_INT,
    PHASE_MASK,
    RANDOM_SIZE,
    TAG_SIZE,
    TYPE_MASK,
    U32_MAX,
    WIRE_VERSION,
    Header,
    KeyPhase,
    Message,
    MsgType,
    Offer,
    ParseError,
    Repair,
    Role,
    Source,
    body_bounds,
    check_symbol_size,
    phase_of,
    phases_sent_by,
)

__all__ = [
    "KEY_SIZE",
    "MIN_PSK_SIZE",
    "AuthError",
    "Keyring",
    "MalformedError",
    "PacketProtector",
    "RandomBytes",
    "ReplayError",
    "drop_reason",
    "keyring_for",
    "open_handshake",
    "seal_handshake",
]

_NONCE_PACK: Final = struct.Struct(">8xI").pack
_ZERO_TAG: Final = bytes(TAG_SIZE)
_SOURCE: Final = int(MsgType.SOURCE)
_REPAIR: Final = int(MsgType.REPAIR)
_HS_PHASE: Final = KeyPhase.HANDSHAKE
_EARLY: Final = int(KeyPhase.EARLY)
_MSGTYPE_BY_INT: Final = {int(t): t for t in MsgType}
_DATA_TYPES: Final = frozenset({MsgType.SOURCE, MsgType.REPAIR})


class PacketProtector:
    """Seals outgoing and opens incoming datagrams of one session for one local role.

    A sender's protector draws its R_s from ``random_bytes`` and seals early until
    :meth:`set_peer_random` (the ACCEPT's R_r) gives it the session keys; a receiver's is built at
    establishment with both values (``local_random`` = R_r, ``peer_random`` = R_s) and opens early and
    session datagrams. The OFFER is a handshake datagram (explicit random nonce from ``random_bytes``).
    ``keyring`` may be a PSK (then the shared :func:`keyring_for` it, with ``authenticate``).

    ``symbol_size`` may be None where it is not known yet: SOURCE and REPAIR are then refused as
    ``bad_type`` until :meth:`set_symbol_size`.

    In ``open`` the order of checks is: size, version, session id, (phase, type) and direction, body
    length, packet number 0, key held, AEAD tag, replay window (updated only after the tag verified and the
    body parsed), body fields. SOURCE/REPAIR symbols are memoryviews into the decrypted plaintext
    (authenticated mode) or into ``datagram`` itself (``authenticate=False``): in the latter case do not
    reuse a receive buffer while the message is alive.

    Replay window (every phase): ``ring[pn % W]`` holds the last packet number stored in that slot. A
    packet with ``largest - W < pn <= largest`` was received iff ``ring[pn % W] == pn`` (a later writer of
    that slot would be >= pn + W > largest), so duplicate detection is O(1) with no bitmap shifting.
    """

    __slots__ = (
        "_bounds",
        "_early_opener",
        "_has_keys",
        "_keyring",
        "_largest",
        "_local_random",
        "_next_pn",
        "_opener",
        "_peer_random",
        "_phase_bits",
        "_random_bytes",
        "_ring",
        "_role",
        "_sealer",
        "_sends_data",
        "_session_id",
        "_symbol_size",
        "_window",
    )

    def __init__(
        self,
        keyring: Keyring | bytes,
        session_id: int,
        role: Role,
        symbol_size: int | None,
        *,
        authenticate: bool = True,
        local_random: bytes | None = None,
        peer_random: bytes | None = None,
        random_bytes: RandomBytes = os.urandom,
        replay_window: int = 1024,
        first_pn: int = 1,
    ) -> None:
        if not isinstance(role, Role):
            raise ValueError(f"role must be a Role, got {role!r}")
        if isinstance(keyring, (bytes, bytearray)):
            keyring = keyring_for(check_psk(keyring), authenticate)
        check_sid(session_id)
        if symbol_size is not None:
            check_symbol_size(symbol_size)
        if not isinstance(replay_window, int) or not 1 <= replay_window <= 1 << 20:
            raise ValueError(f"replay_window must be an int in [1, 2**20], got {replay_window!r}")
        if not isinstance(first_pn, int) or not 1 <= first_pn <= U32_MAX:
            raise ValueError(f"first_pn must be in 1..{U32_MAX}, got {first_pn!r}")
        self._keyring = keyring
        self._role = role
        self._session_id = session_id
        self._random_bytes = random_bytes
        self._local_random = check_random(
            random_bytes(RANDOM_SIZE) if local_random is None else local_random, "local_random"
        )
        self._window = replay_window
        self._ring = [0] * replay_window
        self._largest = 0
        self._next_pn = first_pn
        self._sends_data = role is Role.SENDER
        self._symbol_size = symbol_size
        self._sealer: AESGCM | None = None
        self._opener: AESGCM | None = None
        self._early_opener: AESGCM | None = None
        self._has_keys = False
        self._phase_bits = _EARLY if role is Role.SENDER else int(KeyPhase.SESSION)
        self._peer_random: bytes | None = None
        self._bounds: dict[int, tuple[int, int]] = {}
        if role is Role.SENDER:
            self._sealer = keyring.early(session_id, self._local_random)
            if peer_random is not None:
                self.set_peer_random(peer_random)
        else:
            if peer_random is None:
                raise ValueError("a receiver's protector needs the sender's random (R_s) from the OFFER")
            r_s = check_random(peer_random, "peer_random")
            self._peer_random = r_s
            k_s2r, k_r2s = keyring.session(session_id, r_s, self._local_random)
            self._early_opener = keyring.early(session_id, r_s)
            self._opener, self._sealer = k_s2r, k_r2s
            self._has_keys = True
        self._set_bounds()

    def _set_bounds(self) -> None:
        """(min, max) body size per type byte (phase | type) this side opens with its own keys (the
        handshake phase is :func:`open_handshake`'s); the data types' need the symbol size."""
        size = self._symbol_size
        peer = Role.RECEIVER if self._role is Role.SENDER else Role.SENDER
        bounds = {}
        for phase, mtype in phases_sent_by(peer):
            if phase is KeyPhase.HANDSHAKE or (size is None and mtype in _DATA_TYPES):
                continue
            if phase is KeyPhase.SESSION and not self._has_keys:
                continue
            bounds[int(phase) | int(mtype)] = body_bounds(mtype, size or 0)
        self._bounds = bounds

    def set_symbol_size(self, symbol_size: int) -> None:
        """Fix the session's symbol size, once."""
        if self._symbol_size is not None:
            raise ValueError(f"symbol_size is already {self._symbol_size}")
        check_symbol_size(symbol_size)
        self._symbol_size = symbol_size
        self._set_bounds()

    def set_peer_random(self, receiver_random: bytes) -> None:
        """The sender learns R_r from the ACCEPT: derive the session keys and seal under K_s2r from now."""
        if self._role is not Role.SENDER:
            raise ValueError("only a sender learns the peer's random from an ACCEPT")
        if self._has_keys:
            raise ValueError("the session keys are already set")
        r_r = check_random(receiver_random, "receiver_random")
        k_s2r, k_r2s = self._keyring.session(self._session_id, self._local_random, r_r)
        self._peer_random = r_r
        self._sealer, self._opener = k_s2r, k_r2s
        self._phase_bits = int(KeyPhase.SESSION)
        self._has_keys = True
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
        return self._keyring.authenticate

    @property
    def keyring(self) -> Keyring:
        return self._keyring

    @property
    def local_random(self) -> bytes:
        """This side's fresh value: R_s for a sender, R_r for a receiver."""
        return self._local_random

    @property
    def peer_random(self) -> bytes | None:
        return self._peer_random

    @property
    def has_session_keys(self) -> bool:
        return self._has_keys

    @property
    def replay_window(self) -> int:
        return self._window

    @property
    def packets_sealed(self) -> int:
        """The last packet number used (sealing starts at ``first_pn``)."""
        return self._next_pn - 1

    @property
    def largest_received_pn(self) -> int:
        """Largest authenticated packet number received (0 before any)."""
        return self._largest

    # sealing --------------------------------------------------------------------
    def seal(self, msg: Message) -> bytes:
        """Encode and protect ``msg`` with the next packet number, in the phase its type and this side's
        keys give (:func:`.messages.phase_of`).

        ValueError for out-of-range fields, a wrong symbol length, a type this role never sends, an OFFER
        whose R_s is not this protector's, or an exhausted packet-number space; the number is then not used.
        """
        if type(msg) is Source:
            return self.seal_source(msg.esi, msg.symbol)
        if type(msg) is Repair:
            return self.seal_repair(msg.repair_key, msg.dt, msg.nss, msg.fss_esi, msg.symbol)
        body = encode_body(msg, self._symbol_size)  # TypeError for a non-message, ValueError for bad fields
        mtype = msg.TYPE
        phase = phase_of(mtype, self._role, session_keys=self._has_keys)
        if (phase, mtype) not in phases_sent_by(self._role):
            raise ValueError(f"{self._role.name} never sends {mtype.name} in phase {phase.name}")
        if isinstance(msg, Offer) and msg.sender_random != self._local_random:
            raise ValueError("OFFER: sender_random must be this protector's local_random")
        if phase is KeyPhase.HANDSHAKE:
            pn = self._next_pn
            out = seal_handshake(self._keyring, self._role, msg, self._session_id, pn,
                                 self._random_bytes(NONCE_SIZE), self._peer_random or b"")
            self._next_pn = pn + 1
            return out
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
        header = pack_header(WIRE_VERSION, mtype | self._phase_bits, self._session_id, pn)
        sealer = self._sealer
        if sealer is None:
            out = b"".join((header, head, tail, _ZERO_TAG))
        else:
            out = header + sealer.encrypt(_NONCE_PACK(pn), head + tail, header)
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
        """Verify and parse one datagram of any phase; raises ParseError (or a subclass) only."""
        version, type_byte, sid, pn = unpack_header(datagram)
        mtype = _MSGTYPE_BY_INT.get(type_byte & TYPE_MASK)
        phase = PHASE_BY_INT.get(type_byte & PHASE_MASK)
        if mtype is None or phase is None:
            raise ParseError("bad_type", f"type byte {type_byte:#x}")
        header = new_header(version, mtype, sid, pn, phase)
        if phase is KeyPhase.HANDSHAKE:
            return header, self._open_handshake(header, datagram)
        return header, self._open_body(sid, type_byte, pn, datagram, len(datagram))

    def open_peeked(self, header: Header, datagram: ByteBuffer) -> Message:
        """:meth:`open` for a datagram whose ``header`` :func:`.frames.peek_header` already parsed and
        checked (size, version, type, packet number 0): the receiver's demultiplexer parses it once."""
        if header.phase is _HS_PHASE:
            return self._open_handshake(header, datagram)
        return self._open_body(
            header.session_id, header.type | header.phase, header.packet_number, datagram, len(datagram)
        )

    def _open_handshake(self, header: Header, datagram: ByteBuffer) -> Message:
        if header.session_id != self._session_id:
            raise ParseError("wrong_session", f"session {header.session_id:#x}")
        if header.packet_number == 0:
            raise ParseError("bad_field", "packet number 0")
        if len(datagram) < OVERHEAD + NONCE_SIZE:
            raise ParseError("truncated", "handshake datagram without its nonce")
        r_s = self._local_random if self._role is Role.SENDER else b""
        msg = open_handshake(self._keyring, self._role, header, datagram, r_s)
        self.mark_received(header.packet_number)
        return msg

    def mark_received(self, pn: int) -> None:
        """Enter an authenticated packet number in the replay window (ReplayError when it is already
        there or too old); the handshake datagrams, opened with the static keys, pass through here too."""
        largest = self._largest
        if pn <= largest:
            if largest - pn >= self._window:
                raise ReplayError("too_old", f"packet {pn}, largest {largest}")
            if self._ring[pn % self._window] == pn:
                raise ReplayError("replay", f"packet {pn}")
        else:
            self._largest = pn
        self._ring[pn % self._window] = pn

    def _open_body(self, sid: int, type_byte: int, pn: int, datagram: ByteBuffer, n: int) -> Message:
        """Every check after the header's own, then the body's message; the replay window is updated last."""
        if sid != self._session_id:
            raise ParseError("wrong_session", f"session {sid:#x}")
        bounds = self._bounds.get(type_byte)
        if bounds is None:
            if type_byte & PHASE_MASK == 0 and not self._has_keys:
                raise ParseError("no_key", "a session-phase datagram before the session keys")
            raise ParseError("bad_type", f"type byte {type_byte:#x} not opened by {self._role.name}")
        blen = n - OVERHEAD
        if blen < bounds[0]:
            raise ParseError("truncated", f"type byte {type_byte:#x} body {blen} B < {bounds[0]}")
        if blen > bounds[1]:
            raise ParseError("bad_length", f"type byte {type_byte:#x} body {blen} B > {bounds[1]}")
        if pn == 0:
            raise ParseError("bad_field", "packet number 0")
        view = memoryview(datagram)
        body: memoryview
        opener = self._opener if type_byte < _EARLY else self._early_opener
        if self._keyring.authenticate:
            if opener is None:
                raise ParseError("no_key", f"type byte {type_byte:#x}")
            try:
                plain = opener.decrypt(_NONCE_PACK(pn), view[HEADER_SIZE:], view[:HEADER_SIZE])
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
        try:  # inline rather than _decode: this runs per datagram
            msg = decode_checked_body(type_byte & TYPE_MASK, body)
        except ParseError as exc:
            raise MalformedError(exc.reason, str(exc)) from None
        if pn > largest:
            self._largest = pn
        self._ring[pn % self._window] = pn
        return msg
