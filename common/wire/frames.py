"""PriorityFEC wire format: the only module that turns bytes into messages (sans-IO).

Byte layouts and the one parser (raising ``ParseError``). Encoding our own messages with these layouts
is :mod:`.encoding`'s; the messages, sizes and codes are :mod:`.messages`'; sealing and opening (keys,
AEAD, the replay window) are :mod:`.seal`'s, which calls the per-packet pieces here.

Every datagram is a 14-byte cleartext header (the AEAD associated data), the AEAD
ciphertext of a type-specific body, and a 16-byte AES-256-GCM tag. All integers are
big-endian (network order).

Header (14 B, cleartext, authenticated)::

    u8 version (= WIRE_VERSION = 6) | u8 phase:2 | type:6 | u64 session_id | u32 packet_number

The type byte's top two bits are the key phase (:class:`.messages.KeyPhase`): 0x00 SESSION (the session
keys), 0x40 EARLY (the sender's early key, before the ACCEPT), 0x80 HANDSHAKE (the static handshake key of
the direction); 0xC0 is invalid. A HANDSHAKE datagram carries a 12-byte random AEAD nonce right after the
header (authenticated as associated data with it); the others use the packet number as the nonce (8 zero
bytes + u32 pn). ``packet_number`` counts per session and per direction over every phase, starts at 1 and
strictly increases as sealed; 0 is never valid. Keys and nonces are :mod:`.seal`'s (see its module doc).

Bodies (type: layout -- body size in bytes)::

    SOURCE  1  u32 esi | symbol[symbol_size]                               4 + ss
    REPAIR  2  u16 repair_key | u16 (DT:4 | NSS:12) | u32 fss_esi |         8 + ss
               symbol[symbol_size]   (RFC 8681 Repair FEC Payload ID, GF(2^8); NSS >= 1)
    ACK     3  u32 decoded_prefix | u32 seen_end | u32 decoded_count |     42 + map
               u16 deficit (saturating) | u16 unknowns (saturating) |
               u32 largest_pn | u32 ack_delay_us | u32 received |
               u32 lost | u32 loss_runs | u32 computed_tokens (the
               receiver's own prefill: context tokens [0, c) computed; 0
               unless split) | u16 hole_bits (<= 4096) |
               hole map: ceil(hole_bits / 8) bytes, bit i (MSB first) set when
               ESI decoded_prefix + i is undecoded
               (deficit, unknowns and the map cover the receiver's decoder span
               [decoded_prefix, decoded_prefix + hole_bits): where repairs can help)
    OFFER   4  u16 symbol_size | u16 window_cap | u32 n_source |           66 + app
               u32 budget_us | 32 B fingerprint | u16 part_index |
               u16 part_count | 16 B sender_random (R_s) |
               u16 span (the decoder span asked for; 0: the receiver's
               choice) | app bytes (rest)
               (n_source 0: a speed query, one part, no app bytes)
    ACCEPT  5  u16 window_cap | u32 n_source | 16 B receiver_random (R_r) | 74
               u32 prefill_a_us | u32 prefill_b_ns | u32 prefill_c_ps |
               u32 decode_us | u32 rebuild_{native,int8,int4,int2}_ns |
               u32 question_a_us | u32 question_ns_per_token |
               u32 question_ps_per_cached | u32 decode_ps_per_cached |
               u32 datagram_ns (window_cap: the decoder span the receiver
               granted, >= the OFFER's window_cap; the thirteen speeds: what
               it measured of itself, receiver_speed.Statement, 0 when not
               stated; n_source 0 and window_cap 0: the answer to a speed
               query)
    REFUSE  6  u8 RefuseCode | UTF-8 text (rest, <= 512 B)                 1 + text
    RESULT  7  u32 decoded_count | u16 part_index | u16 part_count |        8 + app
               app bytes (rest)
    CLOSE   8  u8 CloseCode | UTF-8 text (rest, <= 512 B)                  1 + text
    DONE    9  u32 sources_sent | u32 repairs_sent | u32 last_data_pn |   13
               u8 DoneReason (the completion signal: nothing more the
               receiver could use will follow)

Direction and phase: the sender seals OFFER (handshake), SOURCE, REPAIR and CLOSE (early or session) and
DONE (session); the receiver seals ACCEPT (handshake), REFUSE (handshake or session), ACK, RESULT and
CLOSE (session).
Any other (phase, type) pair arriving is ``bad_type``.
For OFFER/RESULT ``part_index < part_count`` and ``part_count >= 1``; OFFER symbol_size
is in [1, DEFAULT_SYMBOL_SIZE] (no datagram could carry a larger symbol).

Per-datagram overhead (on top of UDP/IP: +28 B IPv4, +48 B IPv6)::

    header 14 + tag 16 = 30 B for every datagram (+ the 12 B nonce of a handshake datagram)
    SOURCE  30 + 4 = 34 B  -> 1396 B datagram with the default 1362 B symbol
    REPAIR  30 + 8 = 38 B  -> 1400 B datagram (= MAX_DATAGRAM) with the default symbol
    OFFER / RESULT app chunk: at most max_app_chunk(kind) = 1292 / 1362 B per datagram
    ACCEPT 30 + 12 + 74 = 116 B, answering an OFFER of at least 30 + 12 + 66 = 108 B (1.07x)

No datagram may exceed MAX_DATAGRAM = 1400 B (1428 B on IPv4, 1448 B on IPv6 < 1500 MTU).

Protection: :class:`pfec.common.wire.seal.PacketProtector` (one session, one local role).

Parsing failures raise ``ParseError`` (:mod:`.seal`'s ``AuthError``/``ReplayError`` are subclasses)
whose ``.reason`` is one of ``PARSE_REASONS``. Encoding our own malformed message
raises ``ValueError`` (``TypeError`` for something that is not a message; :mod:`.encoding`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import fields
from typing import Any, Final, TypeAlias

from pfec.common.wire.messages import (
    ACCEPT_BODY_SIZE,
    ACK_BODY_SIZE,
    CLOSE_BY_INT,
    DEFAULT_SYMBOL_SIZE,
    DONE_BODY_SIZE,
    DONE_BY_INT,
    HEADER_SIZE,
    MAX_DATAGRAM,
    MAX_HOLE_BITS,
    MSGTYPE_BY_INT,
    NONCE_SIZE,
    OFFER_FIXED_SIZE,
    OVERHEAD,
    PHASE_MASK,
    REFUSE_BY_INT,
    REPAIR_ID_SIZE,
    RESULT_FIXED_SIZE,
    SOURCE_ID_SIZE,
    TYPE_MASK,
    WIRE_VERSION,
    Accept,
    Ack,
    Close,
    Done,
    Header,
    KeyPhase,
    Message,
    MsgType,
    Offer,
    ParseError,
    Refuse,
    Repair,
    Result,
    Source,
    body_bounds,
)

HEADER_LAYOUT = struct.Struct(">BBQI")
U32_LAYOUT = struct.Struct(">I")
REPAIR_ID_LAYOUT = struct.Struct(">HHI")
ACK_LAYOUT = struct.Struct(">IIIHHIIIIIIH")
OFFER_LAYOUT = struct.Struct(">HHII32sHH16sH")
ACCEPT_LAYOUT = struct.Struct(">HI16sIIII9I")
RESULT_LAYOUT = struct.Struct(">IHH")
DONE_LAYOUT = struct.Struct(">IIIB")
# Bound methods, to save an attribute lookup per packet on the hot path (the public ones are
# :mod:`.seal`'s per-packet layout steps).
pack_header: Final = HEADER_LAYOUT.pack  # (version, type, session_id, packet_number) -> 14 B
_HEADER_UNPACK_FROM: Final = HEADER_LAYOUT.unpack_from
pack_source_id: Final = U32_LAYOUT.pack  # (esi,) -> the SOURCE FEC Payload ID
_U32_UNPACK_FROM: Final = U32_LAYOUT.unpack_from

assert HEADER_LAYOUT.size == HEADER_SIZE
assert REPAIR_ID_LAYOUT.size == REPAIR_ID_SIZE
assert ACK_LAYOUT.size == ACK_BODY_SIZE
assert OFFER_LAYOUT.size == OFFER_FIXED_SIZE
assert ACCEPT_LAYOUT.size == ACCEPT_BODY_SIZE
assert RESULT_LAYOUT.size == RESULT_FIXED_SIZE
assert DONE_LAYOUT.size == DONE_BODY_SIZE


def buflen(buf: bytes | bytearray | memoryview) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


# --------------------------------------------------------------------------- decoding
# Messages made per packet skip the generated __init__ of their frozen dataclass.


def _fast_ctor2(cls: type[Any]) -> Callable[[Any, Any], Any]:
    """Constructor for a frozen slots dataclass of 2 fields that skips the generated
    __init__ (which pays for frozen-object __setattr__ per field); used on the hot path."""
    a, b = (cls.__dict__[f.name].__set__ for f in fields(cls))
    new = object.__new__

    def make(x: Any, y: Any) -> Any:
        obj = new(cls)
        a(obj, x)
        b(obj, y)
        return obj

    return make


def _fast_ctor5(cls: type[Any]) -> Callable[[Any, Any, Any, Any, Any], Any]:
    a, b, c, d, e = (cls.__dict__[f.name].__set__ for f in fields(cls))
    new = object.__new__

    def make(v: Any, w: Any, x: Any, y: Any, z: Any) -> Any:
        obj = new(cls)
        a(obj, v)
        b(obj, w)
        c(obj, x)
        d(obj, y)
        e(obj, z)
        return obj

    return make


new_header: Final[Callable[[int, MsgType, int, int, KeyPhase], Header]] = _fast_ctor5(Header)
_new_source: Final[Callable[[int, memoryview], Source]] = _fast_ctor2(Source)
_new_repair: Final[Callable[[int, int, int, int, memoryview], Repair]] = _fast_ctor5(Repair)


# Decoders assume the body length was already checked against body_bounds.

_Body: TypeAlias = bytes | memoryview


def _dec_source(body: _Body) -> Source:
    return Source(U32_LAYOUT.unpack_from(body)[0], memoryview(body)[SOURCE_ID_SIZE:])


def _dec_repair(body: _Body) -> Repair:
    key, dtnss, fss = REPAIR_ID_LAYOUT.unpack_from(body)
    nss = dtnss & 0xFFF
    if nss == 0:
        raise ParseError("bad_field", "REPAIR nss 0")
    return _new_repair(key, dtnss >> 12, nss, fss, memoryview(body)[REPAIR_ID_SIZE:])


def _dec_ack(body: _Body) -> Ack:
    fields = ACK_LAYOUT.unpack_from(body)
    hole_bits = fields[-1]
    if hole_bits > MAX_HOLE_BITS or len(body) != ACK_BODY_SIZE + (hole_bits + 7) // 8:
        raise ParseError("bad_length", f"ACK hole map: {hole_bits} bits in {len(body) - ACK_BODY_SIZE} bytes")
    *counters, computed, _ = fields
    return Ack(*counters, hole_bits, bytes(body[ACK_BODY_SIZE:]), computed)  # type: ignore[call-arg]


def _dec_parts(pi: int, pc: int, what: str) -> None:
    if pc == 0 or pi >= pc:
        raise ParseError("bad_field", f"{what} part {pi}/{pc}")


def _dec_offer(body: _Body) -> Offer:
    ss, wc, ns, budget, fp, pi, pc, r_s, span = OFFER_LAYOUT.unpack_from(body)
    _dec_parts(pi, pc, "OFFER")
    if not 1 <= ss <= DEFAULT_SYMBOL_SIZE:  # no datagram could carry such a symbol
        raise ParseError("bad_field", f"OFFER symbol_size {ss}")
    return Offer(ss, wc, ns, budget, fp, pi, pc, bytes(body[OFFER_FIXED_SIZE:]), r_s, span)


def _dec_accept(body: _Body) -> Accept:
    return Accept(*ACCEPT_LAYOUT.unpack_from(body))


def _dec_text(body: _Body, what: str) -> str:
    try:
        return bytes(body[1:]).decode("utf-8")
    except UnicodeDecodeError:
        raise ParseError("bad_field", f"{what} text is not UTF-8") from None


def _dec_refuse(body: _Body) -> Refuse:
    code = REFUSE_BY_INT.get(body[0])
    if code is None:
        raise ParseError("bad_field", f"REFUSE code {body[0]}")
    return Refuse(code, _dec_text(body, "REFUSE"))


def _dec_result(body: _Body) -> Result:
    dc, pi, pc = RESULT_LAYOUT.unpack_from(body)
    _dec_parts(pi, pc, "RESULT")
    return Result(dc, pi, pc, bytes(body[RESULT_FIXED_SIZE:]))


def _dec_close(body: _Body) -> Close:
    code = CLOSE_BY_INT.get(body[0])
    if code is None:
        raise ParseError("bad_field", f"CLOSE code {body[0]}")
    return Close(code, _dec_text(body, "CLOSE"))


def _dec_done(body: _Body) -> Done:
    sources, repairs, last_pn, code = DONE_LAYOUT.unpack_from(body)
    reason = DONE_BY_INT.get(code)
    if reason is None:
        raise ParseError("bad_field", f"DONE reason {code}")
    return Done(sources, repairs, last_pn, reason)


_DECODERS: Final[dict[int, Callable[[_Body], Message]]] = {
    1: _dec_source,
    2: _dec_repair,
    3: _dec_ack,
    4: _dec_offer,
    5: _dec_accept,
    6: _dec_refuse,
    7: _dec_result,
    8: _dec_close,
    9: _dec_done,
}


def decode_body(mtype: int, body: bytes | memoryview, symbol_size: int) -> Message:
    """Parse a plaintext body of type ``mtype``; raises ParseError only.

    SOURCE/REPAIR ``symbol`` is a memoryview into ``body`` (zero copy).
    """
    if mtype not in MSGTYPE_BY_INT:
        raise ParseError("bad_type", f"type {mtype}")
    lo, hi = body_bounds(mtype, symbol_size)
    n = buflen(body)
    if n < lo:
        raise ParseError("truncated", f"{MsgType(mtype).name} body {n} B < {lo}")
    if n > hi:
        raise ParseError("bad_length", f"{MsgType(mtype).name} body {n} B > {hi}")
    return _DECODERS[mtype](body)


def decode_checked_body(mtype: int, body: memoryview) -> Message:
    """Parse the opened body of a datagram whose type and body length the protector already checked.

    Raises ParseError (bad field values) only; SOURCE/REPAIR ``symbol`` is a view into ``body``.
    """
    if mtype == 1:  # SOURCE, most datagrams: no decoder lookup
        return _new_source(_U32_UNPACK_FROM(body)[0], body[SOURCE_ID_SIZE:])
    return _DECODERS[mtype](body)


def unpack_header(datagram: bytes | bytearray | memoryview) -> tuple[int, int, int, int]:
    """(version, type byte, session id, packet number) of a datagram of a possible size and our version;
    ParseError otherwise. The checks of the type byte (phase and type) and the packet number are the
    caller's."""
    n = buflen(datagram)
    if n < OVERHEAD:
        raise ParseError("truncated", f"{n} B datagram")
    if n > MAX_DATAGRAM:
        raise ParseError("oversized", f"{n} B datagram")
    fields = _HEADER_UNPACK_FROM(datagram)
    if fields[0] != WIRE_VERSION:
        raise ParseError("bad_version", f"version {fields[0]}")
    return fields


def peek_header(datagram: bytes | bytearray | memoryview) -> Header:
    """Parse and sanity-check the cleartext header only (for dispatch by session id).

    Nothing here is authenticated yet: use it to pick a key, then open the datagram with it. A handshake
    datagram must also hold its nonce (``truncated`` otherwise).
    """
    version, type_byte, sid, pn = unpack_header(datagram)
    split = _TYPE_AND_PHASE.get(type_byte)
    if split is None:
        raise ParseError("bad_type", f"type byte {type_byte:#x}")
    if pn == 0:
        raise ParseError("bad_field", "packet number 0")
    phase = split[1]
    if phase is _HANDSHAKE and buflen(datagram) < OVERHEAD + NONCE_SIZE:
        raise ParseError("truncated", "handshake datagram without its nonce")
    return new_header(version, split[0], sid, pn, phase)


# Every valid type byte -> (MsgType, KeyPhase): one lookup per datagram.
_TYPE_AND_PHASE: Final[dict[int, tuple[MsgType, KeyPhase]]] = {
    int(p) | int(t): (t, p) for p in KeyPhase for t in MsgType
}
_HANDSHAKE: Final = KeyPhase.HANDSHAKE
assert all(b & PHASE_MASK == p and b & TYPE_MASK == t for b, (t, p) in _TYPE_AND_PHASE.items())
