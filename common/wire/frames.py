"""PriorityFEC wire format: the only module that turns bytes into messages (sans-IO).

Byte layouts, encoding and the one parser (raising ``ParseError``). The messages, sizes and codes are
:mod:`.messages`'; sealing and opening (keys, AEAD, the replay window) are :mod:`.seal`'s, which calls
the per-packet pieces here.

Every datagram is a 14-byte cleartext header (the AEAD associated data), the AEAD
ciphertext of a type-specific body, and a 16-byte AES-256-GCM tag. All integers are
big-endian (network order).

Header (14 B, cleartext, authenticated)::

    u8 version (= WIRE_VERSION = 5) | u8 phase:2 | type:6 | u64 session_id | u32 packet_number

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
    ACCEPT  5  u16 window_cap | u32 n_source | 16 B receiver_random (R_r) | 38
               u32 prefill_a_us | u32 prefill_b_ns | u32 prefill_c_ps |
               u32 decode_us (window_cap: the decoder span the receiver
               granted, >= the OFFER's window_cap; the four speeds: its
               prefill curve as measured, all 0 when not stated; n_source 0
               and window_cap 0: the answer to a speed query)
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
    ACCEPT 30 + 12 + 38 = 80 B, answering an OFFER of at least 30 + 12 + 66 = 108 B

No datagram may exceed MAX_DATAGRAM = 1400 B (1428 B on IPv4, 1448 B on IPv6 < 1500 MTU).

Protection: :class:`pfec.common.wire.seal.PacketProtector` (one session, one local role).

Parsing failures raise ``ParseError`` (:mod:`.seal`'s ``AuthError``/``ReplayError`` are subclasses)
whose ``.reason`` is one of ``PARSE_REASONS``. Encoding our own malformed message
raises ``ValueError`` (``TypeError`` for something that is not a message).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import fields
from typing import Any, Final, TypeAlias

from pfec.common.wire.messages import (
    _U16_MAX,
    ACCEPT_BODY_SIZE,
    ACK_BODY_SIZE,
    CLOSE_BY_INT,
    DEFAULT_SYMBOL_SIZE,
    DONE_BODY_SIZE,
    DONE_BY_INT,
    FINGERPRINT_SIZE,
    HEADER_SIZE,
    MAX_DATAGRAM,
    MAX_HOLE_BITS,
    MAX_TEXT,
    MSGTYPE_BY_INT,
    NONCE_SIZE,
    OFFER_FIXED_SIZE,
    OVERHEAD,
    PHASE_MASK,
    RANDOM_SIZE,
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
    max_app_chunk,
)

_HEADER = struct.Struct(">BBQI")
_U32 = struct.Struct(">I")
_REPAIR_ID = struct.Struct(">HHI")
_ACK = struct.Struct(">IIIHHIIIIIIH")
_OFFER = struct.Struct(">HHII32sHH16sH")
_ACCEPT = struct.Struct(">HI16sIIII")
_RESULT = struct.Struct(">IHH")
_DONE = struct.Struct(">IIIB")
# Bound methods, to save an attribute lookup per packet on the hot path (the public ones are
# :mod:`.seal`'s per-packet layout steps).
pack_header: Final = _HEADER.pack  # (version, type, session_id, packet_number) -> 14 B
_HEADER_UNPACK_FROM: Final = _HEADER.unpack_from
pack_source_id: Final = _U32.pack  # (esi,) -> the SOURCE FEC Payload ID
_REPAIR_ID_PACK: Final = _REPAIR_ID.pack  # (repair_key, dt << 12 | nss, fss_esi)
_U32_UNPACK_FROM: Final = _U32.unpack_from

assert _HEADER.size == HEADER_SIZE
assert _REPAIR_ID.size == REPAIR_ID_SIZE
assert _ACK.size == ACK_BODY_SIZE
assert _OFFER.size == OFFER_FIXED_SIZE
assert _ACCEPT.size == ACCEPT_BODY_SIZE
assert _RESULT.size == RESULT_FIXED_SIZE
assert _DONE.size == DONE_BODY_SIZE


def _buflen(buf: bytes | bytearray | memoryview) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


# --------------------------------------------------------------------------- encoding


def _pack(st: struct.Struct, what: str, *values: object) -> bytes:
    try:
        return st.pack(*values)
    except struct.error as exc:
        raise ValueError(f"{what}: field out of range: {exc} (values {values!r})") from exc


def _encode_text(code: int, text: str, what: str) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"{what}: text must be a str, got {type(text).__name__}")
    raw = text.encode("utf-8")
    if len(raw) > MAX_TEXT:
        raise ValueError(f"{what}: text is {len(raw)} B UTF-8, at most {MAX_TEXT}")
    return bytes((code,)) + raw


def _check_parts(part_index: int, part_count: int, what: str) -> None:
    if not (
        isinstance(part_index, int)
        and isinstance(part_count, int)
        and 1 <= part_count <= _U16_MAX
        and 0 <= part_index < part_count
    ):
        raise ValueError(f"{what}: need 0 <= part_index < part_count <= 65535, got {part_index}/{part_count}")


def _check_random(value: bytes, what: str) -> None:
    if not isinstance(value, (bytes, bytearray)) or len(value) != RANDOM_SIZE:
        raise ValueError(f"{what} must be {RANDOM_SIZE} fresh random bytes")


def repair_fec_id(repair_key: int, dt: int, nss: int, fss_esi: int) -> bytes:
    """The 8-byte REPAIR FEC Payload ID (RFC 8681); ValueError for a field out of its domain."""
    if type(dt) is not int or type(nss) is not int or not (0 <= dt <= 15 and 1 <= nss <= 0xFFF):
        raise ValueError(f"REPAIR: need 0 <= dt <= 15 and 1 <= nss <= 4095, got {dt!r}, {nss!r}")
    try:
        return _REPAIR_ID_PACK(repair_key, (dt << 12) | nss, fss_esi)
    except struct.error as exc:
        raise ValueError(f"REPAIR: field out of range: {exc}") from exc


def _enc_symbol(msg: Source | Repair, symbol_size: int | None) -> bytes:
    n = _buflen(msg.symbol)
    if symbol_size is None:
        if not 1 <= n <= DEFAULT_SYMBOL_SIZE:
            raise ValueError(f"symbol of {n} B: must be 1..{DEFAULT_SYMBOL_SIZE}")
    elif n != symbol_size:
        raise ValueError(f"symbol of {n} B, session symbol_size is {symbol_size}")
    if isinstance(msg, Source):
        return _pack(_U32, "SOURCE", msg.esi) + msg.symbol
    return repair_fec_id(msg.repair_key, msg.dt, msg.nss, msg.fss_esi) + msg.symbol


def _enc_ack(msg: Ack) -> bytes:
    deficit, unknowns = msg.deficit, msg.unknowns
    if not (0 <= msg.hole_bits <= MAX_HOLE_BITS and len(msg.holes) == (msg.hole_bits + 7) // 8):
        raise ValueError(
            f"ACK: hole map of {len(msg.holes)} bytes does not fit hole_bits {msg.hole_bits!r} "
            f"(<= {MAX_HOLE_BITS})"
        )
    if not (isinstance(deficit, int) and isinstance(unknowns, int) and deficit >= 0 and unknowns >= 0):
        raise ValueError(f"ACK: deficit/unknowns must be non-negative ints, got {deficit!r}/{unknowns!r}")
    return _pack(
        _ACK,
        "ACK",
        msg.decoded_prefix,
        msg.seen_end,
        msg.decoded_count,
        min(deficit, _U16_MAX),
        min(unknowns, _U16_MAX),
        msg.largest_pn,
        msg.ack_delay_us,
        msg.received,
        msg.lost,
        msg.loss_runs,
        msg.computed_tokens,
        msg.hole_bits,
    ) + bytes(msg.holes)


def _enc_offer(msg: Offer) -> bytes:
    if not isinstance(msg.fingerprint, (bytes, bytearray)) or len(msg.fingerprint) != FINGERPRINT_SIZE:
        raise ValueError(f"OFFER: fingerprint must be {FINGERPRINT_SIZE} bytes")
    _check_parts(msg.part_index, msg.part_count, "OFFER")
    _check_random(msg.sender_random, "OFFER: sender_random")
    if not (isinstance(msg.symbol_size, int) and 1 <= msg.symbol_size <= DEFAULT_SYMBOL_SIZE):
        raise ValueError(f"OFFER: symbol_size must be 1..{DEFAULT_SYMBOL_SIZE}, got {msg.symbol_size!r}")
    if len(msg.app) > max_app_chunk(MsgType.OFFER):
        raise ValueError(f"OFFER: app chunk of {len(msg.app)} B > {max_app_chunk(MsgType.OFFER)}")
    fixed = _pack(
        _OFFER,
        "OFFER",
        msg.symbol_size,
        msg.window_cap,
        msg.n_source,
        msg.budget_us,
        bytes(msg.fingerprint),
        msg.part_index,
        msg.part_count,
        bytes(msg.sender_random),
        msg.span,
    )
    return fixed + msg.app


def _enc_result(msg: Result) -> bytes:
    _check_parts(msg.part_index, msg.part_count, "RESULT")
    if len(msg.app) > max_app_chunk(MsgType.RESULT):
        raise ValueError(f"RESULT: app chunk of {len(msg.app)} B > {max_app_chunk(MsgType.RESULT)}")
    return _pack(_RESULT, "RESULT", msg.decoded_count, msg.part_index, msg.part_count) + msg.app


def _enc_coded_text(msg: Refuse | Close) -> bytes:
    what, codes = ("REFUSE", REFUSE_BY_INT) if isinstance(msg, Refuse) else ("CLOSE", CLOSE_BY_INT)
    if msg.code not in codes:
        raise ValueError(f"{what}: unknown code {msg.code!r}")
    return _encode_text(msg.code, msg.text, what)


def encode_body(msg: Message, symbol_size: int | None = None) -> bytes:
    """Plaintext body of ``msg``. ``symbol_size`` (if given) fixes SOURCE/REPAIR symbol length.

    Raises ValueError for out-of-range fields or a body that would not fit MAX_DATAGRAM.
    """
    if isinstance(msg, (Source, Repair)):
        return _enc_symbol(msg, symbol_size)
    if isinstance(msg, Ack):
        return _enc_ack(msg)
    if isinstance(msg, Offer):
        return _enc_offer(msg)
    if isinstance(msg, Accept):
        _check_random(msg.receiver_random, "ACCEPT: receiver_random")
        return _pack(_ACCEPT, "ACCEPT", msg.window_cap, msg.n_source, bytes(msg.receiver_random),
                     msg.prefill_a_us, msg.prefill_b_ns, msg.prefill_c_ps, msg.decode_us)
    if isinstance(msg, Result):
        return _enc_result(msg)
    if isinstance(msg, (Refuse, Close)):
        return _enc_coded_text(msg)
    if isinstance(msg, Done):
        if msg.reason not in DONE_BY_INT.values():
            raise ValueError(f"DONE: unknown reason {msg.reason!r}")
        return _pack(_DONE, "DONE", msg.sources_sent, msg.repairs_sent, msg.last_data_pn, msg.reason)
    raise TypeError(f"not a wire message: {type(msg).__name__}")


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
    return Source(_U32.unpack_from(body)[0], memoryview(body)[SOURCE_ID_SIZE:])


def _dec_repair(body: _Body) -> Repair:
    key, dtnss, fss = _REPAIR_ID.unpack_from(body)
    nss = dtnss & 0xFFF
    if nss == 0:
        raise ParseError("bad_field", "REPAIR nss 0")
    return _new_repair(key, dtnss >> 12, nss, fss, memoryview(body)[REPAIR_ID_SIZE:])


def _dec_ack(body: _Body) -> Ack:
    fields = _ACK.unpack_from(body)
    hole_bits = fields[-1]
    if hole_bits > MAX_HOLE_BITS or len(body) != ACK_BODY_SIZE + (hole_bits + 7) // 8:
        raise ParseError("bad_length", f"ACK hole map: {hole_bits} bits in {len(body) - ACK_BODY_SIZE} bytes")
    *counters, computed, _ = fields
    return Ack(*counters, hole_bits, bytes(body[ACK_BODY_SIZE:]), computed)  # type: ignore[call-arg]


def _dec_parts(pi: int, pc: int, what: str) -> None:
    if pc == 0 or pi >= pc:
        raise ParseError("bad_field", f"{what} part {pi}/{pc}")


def _dec_offer(body: _Body) -> Offer:
    ss, wc, ns, budget, fp, pi, pc, r_s, span = _OFFER.unpack_from(body)
    _dec_parts(pi, pc, "OFFER")
    if not 1 <= ss <= DEFAULT_SYMBOL_SIZE:  # no datagram could carry such a symbol
        raise ParseError("bad_field", f"OFFER symbol_size {ss}")
    return Offer(ss, wc, ns, budget, fp, pi, pc, bytes(body[OFFER_FIXED_SIZE:]), r_s, span)


def _dec_accept(body: _Body) -> Accept:
    return Accept(*_ACCEPT.unpack_from(body))


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
    dc, pi, pc = _RESULT.unpack_from(body)
    _dec_parts(pi, pc, "RESULT")
    return Result(dc, pi, pc, bytes(body[RESULT_FIXED_SIZE:]))


def _dec_close(body: _Body) -> Close:
    code = CLOSE_BY_INT.get(body[0])
    if code is None:
        raise ParseError("bad_field", f"CLOSE code {body[0]}")
    return Close(code, _dec_text(body, "CLOSE"))


def _dec_done(body: _Body) -> Done:
    sources, repairs, last_pn, code = _DONE.unpack_from(body)
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
    n = _buflen(body)
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
    n = _buflen(datagram)
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
    if phase is _HANDSHAKE and _buflen(datagram) < OVERHEAD + NONCE_SIZE:
        raise ParseError("truncated", "handshake datagram without its nonce")
    return new_header(version, split[0], sid, pn, phase)


# Every valid type byte -> (MsgType, KeyPhase): one lookup per datagram.
_TYPE_AND_PHASE: Final[dict[int, tuple[MsgType, KeyPhase]]] = {
    int(p) | int(t): (t, p) for p in KeyPhase for t in MsgType
}
_HANDSHAKE: Final = KeyPhase.HANDSHAKE
assert all(b & PHASE_MASK == p and b & TYPE_MASK == t for b, (t, p) in _TYPE_AND_PHASE.items())
