"""The group key of one fan-out stream (sans-IO): its ticket's wire format, its keyring and its protectors.

A multicast fan-out seals every data datagram once, under a key that every member of the group holds:

- ``K_g``: 32 fresh random bytes per stream, drawn by the sender; independent of the PSK and of every
  other stream's key (a member that learns it learns nothing else). The stream's own session id ``G``
  (fresh, u64) and two fresh 16-byte values R_s, R_g salt the derivation:
  K_gs2r = HKDF(K_g, salt R_s + R_g, info "pfec/2 group s2r" + u64 G). The early and r2s keys are
  derived too (the protector's layout wants them) under labels no unicast session uses; nobody seals under
  them, and a group opener opens only the sender's data and DONE (:func:`open_group`).
- The ticket (``GroupTicket``: G, K_g, R_s, R_g) travels to each member inside that member's own
  authenticated handshake; this module only packs and parses it (typed and bounded, 81 bytes).
- Packet numbers are the group's own u32 space: the nonce (8 zero bytes + pn) never repeats under K_g,
  which no other stream uses. The header (with G) is the associated data: a datagram of one stream fails
  under another stream's opener (``wrong_session`` on G, ``auth`` on the key).

What a member can forge with K_g: data symbols and a DONE of that stream, to the other members of that
stream (docs/SECURITY.md says what follows). It cannot forge anything the sender opens: ACKs and RESULTs
go under each member's own session keys, and the group's r2s key seals nothing anyone opens.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Final

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pfec.common.wire.handshake import ByteBuffer
from pfec.common.wire.keyring import KEY_SIZE, Keyring, RandomBytes, _hkdf, check_random, check_sid
from pfec.common.wire.messages import (
    RANDOM_SIZE,
    Done,
    Header,
    KeyPhase,
    Message,
    ParseError,
    Repair,
    Role,
    Source,
)
from pfec.common.wire.seal import PacketProtector

__all__ = ["GROUP_TICKET_SIZE", "GroupKeyring", "GroupTicket", "group_opener", "group_sealer", "open_group"]

_TICKET: Final = struct.Struct(f">BQ{KEY_SIZE}s{RANDOM_SIZE}s{RANDOM_SIZE}s")
_TICKET_VERSION: Final = 1
GROUP_TICKET_SIZE: Final = _TICKET.size  # 81 bytes
_SID: Final = struct.Struct(">Q")
_GROUP_TYPES: Final = (Source, Repair, Done)  # all a group opener hands on


@dataclass(frozen=True, slots=True)
class GroupTicket:
    """What a member needs to open one stream: its session id, its key and the two salts."""

    session_id: int
    key: bytes
    sender_random: bytes
    group_random: bytes

    def __post_init__(self) -> None:
        check_sid(self.session_id)
        if not isinstance(self.key, bytes) or len(self.key) != KEY_SIZE:
            raise ValueError(f"group key must be {KEY_SIZE} bytes")
        check_random(self.sender_random, "sender_random")
        check_random(self.group_random, "group_random")

    def __repr__(self) -> str:  # never print key material
        return f"GroupTicket(session_id={self.session_id:#x})"

    @classmethod
    def fresh(cls, session_id: int, random_bytes: RandomBytes = os.urandom) -> GroupTicket:
        """A new stream's ticket: every secret drawn fresh."""
        return cls(session_id, random_bytes(KEY_SIZE), random_bytes(RANDOM_SIZE), random_bytes(RANDOM_SIZE))

    def pack(self) -> bytes:
        return _TICKET.pack(_TICKET_VERSION, self.session_id, self.key, self.sender_random, self.group_random)

    @classmethod
    def parse(cls, data: ByteBuffer) -> GroupTicket:
        """A ticket from a peer: exactly ``GROUP_TICKET_SIZE`` bytes of version 1 (ParseError otherwise)."""
        if len(data) != GROUP_TICKET_SIZE:
            raise ParseError("bad_length", f"group ticket of {len(data)} B, expected {GROUP_TICKET_SIZE}")
        version, sid, key, r_s, r_g = _TICKET.unpack(bytes(data))
        if version != _TICKET_VERSION:
            raise ParseError("bad_version", f"group ticket version {version}")
        return cls(sid, key, r_s, r_g)


class GroupKeyring(Keyring):
    """A :class:`Keyring` over one stream's K_g, with labels of its own: the protectors of seal.py work
    unchanged, and no key it gives equals a unicast session's (another input key, other labels)."""

    __slots__ = ()

    def __init__(self, group_key: bytes) -> None:  # no call to Keyring's: no handshake keys under K_g
        if not isinstance(group_key, bytes) or len(group_key) != KEY_SIZE:
            raise ValueError(f"group key must be {KEY_SIZE} bytes")
        self._psk = group_key
        self.authenticate = True
        self.derivations = 0
        # Handshake keys under a label nothing seals with: a handshake datagram never opens under K_g.
        self.hs_s2r = self._aead(b"pfec/2 group handshake", b"pfec/2 group hs s2r (never sealed)")
        self.hs_r2s = self._aead(b"pfec/2 group handshake", b"pfec/2 group hs r2s (never sealed)")

    def _aead(self, salt: bytes, info: bytes) -> AESGCM:
        self.derivations += 1
        return AESGCM(_hkdf(self._psk, salt, info))

    def early(self, session_id: int, sender_random: bytes) -> AESGCM:
        check_sid(session_id)
        return self._aead(check_random(sender_random, "sender_random"),
                          b"pfec/2 group early (never sealed)" + _SID.pack(session_id))

    def session(self, session_id: int, sender_random: bytes, receiver_random: bytes) -> tuple[AESGCM, AESGCM]:
        check_sid(session_id)
        salt = check_random(sender_random, "sender_random") + check_random(receiver_random, "receiver_random")
        sid = _SID.pack(session_id)
        return (self._aead(salt, b"pfec/2 group s2r" + sid),
                self._aead(salt, b"pfec/2 group r2s (never sealed)" + sid))


def group_sealer(ticket: GroupTicket, symbol_size: int) -> PacketProtector:
    """The sender's protector of the stream: seals data and DONE once, under K_gs2r, from packet 1."""
    return PacketProtector(GroupKeyring(ticket.key), ticket.session_id, Role.SENDER, symbol_size,
                           local_random=ticket.sender_random, peer_random=ticket.group_random)


def group_opener(ticket: GroupTicket, symbol_size: int, replay_window: int = 1024) -> PacketProtector:
    """A member's protector of the stream (opens what ``group_sealer`` sealed; its own replay window)."""
    return PacketProtector(GroupKeyring(ticket.key), ticket.session_id, Role.RECEIVER, symbol_size,
                           local_random=ticket.group_random, peer_random=ticket.sender_random,
                           replay_window=replay_window)


def open_group(opener: PacketProtector, datagram: ByteBuffer) -> tuple[Header, Message]:
    """Open one datagram of the stream: only the sender's SOURCE, REPAIR and DONE in the session phase
    (``bad_type`` for anything else; auth and replay errors as ``PacketProtector.open``'s)."""
    header, message = opener.open(datagram)
    if header.phase is not KeyPhase.SESSION or not isinstance(message, _GROUP_TYPES):
        raise ParseError("bad_type", f"{type(message).__name__} ({header.phase.name}) under a group key")
    return header, message
