"""PriorityFEC wire format: the only module that turns bytes into messages (sans-IO).

Layouts, message types, encoding and the one parser (raising ``ParseError``). Sealing and opening
(keys, AEAD, the replay window) are :mod:`.seal`'s; it calls the per-packet pieces here.

Every datagram is a 14-byte cleartext header (the AEAD associated data), the AEAD
ciphertext of a type-specific body, and a 16-byte AES-256-GCM tag. All integers are
big-endian (network order).

Header (14 B, cleartext, authenticated)::

    u8 version (= WIRE_VERSION = 1) | u8 type | u64 session_id | u32 packet_number

``packet_number`` counts per session and per direction, starts at 1 and strictly
increases as sealed; it is the AEAD nonce (8 zero bytes + u32 pn), which is safe because
every (session, direction) has its own HKDF-derived key. 0 is never valid.

Bodies (type: layout -- body size in bytes)::

    SOURCE  1  u32 esi | symbol[symbol_size]                               4 + ss
    REPAIR  2  u16 repair_key | u16 (DT:4 | NSS:12) | u32 fss_esi |         8 + ss
               symbol[symbol_size]   (RFC 8681 Repair FEC Payload ID, GF(2^8); NSS >= 1)
    ACK     3  u32 decoded_prefix | u32 seen_end | u32 decoded_count |     38 + map
               u16 deficit (saturating) | u16 unknowns (saturating) |
               u32 largest_pn | u32 ack_delay_us | u32 received |
               u32 lost | u32 loss_runs | u16 hole_bits (<= 4096) |
               hole map: ceil(hole_bits / 8) bytes, bit i (MSB first) set when
               ESI decoded_prefix + i is undecoded
               (deficit, unknowns and the map cover the receiver's decoder span
               [decoded_prefix, decoded_prefix + hole_bits): where repairs can help)
    OFFER   4  u16 symbol_size | u16 window_cap | u32 n_source |           48 + app
               u32 budget_us | 32 B fingerprint | u16 part_index |
               u16 part_count | app bytes (rest)
    ACCEPT  5  u16 window_cap | u32 n_source                               6
    REFUSE  6  u8 RefuseCode | UTF-8 text (rest, <= 512 B)                 1 + text
    RESULT  7  u32 decoded_count | u16 part_index | u16 part_count |        8 + app
               app bytes (rest)
    CLOSE   8  u8 CloseCode | UTF-8 text (rest, <= 512 B)                  1 + text

Direction: the sender seals SOURCE, REPAIR, OFFER, CLOSE; the receiver seals ACK,
ACCEPT, REFUSE, RESULT, CLOSE. A type arriving from the wrong direction is ``bad_type``.
For OFFER/RESULT ``part_index < part_count`` and ``part_count >= 1``; OFFER symbol_size
is in [1, DEFAULT_SYMBOL_SIZE] (no datagram could carry a larger symbol).

Per-datagram overhead (on top of UDP/IP: +28 B IPv4, +48 B IPv6)::

    header 14 + tag 16 = 30 B for every datagram
    SOURCE  30 + 4 = 34 B  -> 1396 B datagram with the default 1362 B symbol
    REPAIR  30 + 8 = 38 B  -> 1400 B datagram (= MAX_DATAGRAM) with the default symbol
    OFFER / RESULT app chunk: at most max_app_chunk(kind) = 1322 / 1362 B per datagram

No datagram may exceed MAX_DATAGRAM = 1400 B (1428 B on IPv4, 1448 B on IPv6 < 1500 MTU).

Protection: :class:`pfec.common.wire.seal.PacketProtector` (one session, one local role).

Parsing failures raise ``ParseError`` (:mod:`.seal`'s ``AuthError``/``ReplayError`` are subclasses)
whose ``.reason`` is one of ``PARSE_REASONS``. Encoding our own malformed message
raises ``ValueError`` (``TypeError`` for something that is not a message).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Final, Literal, TypeAlias

__all__ = [
    "ACCEPT_BODY_SIZE",
    "ACK_BODY_SIZE",
    "DEFAULT_SYMBOL_SIZE",
    "FINGERPRINT_SIZE",
    "HEADER_SIZE",
    "MAX_DATAGRAM",
    "MAX_HOLE_BITS",
    "MAX_TEXT",
    "OFFER_FIXED_SIZE",
    "OVERHEAD",
    "PARSE_REASONS",
    "REPAIR_ID_SIZE",
    "RESULT_FIXED_SIZE",
    "SOURCE_ID_SIZE",
    "TAG_SIZE",
    "U32_MAX",
    "WIRE_VERSION",
    "Accept",
    "Ack",
    "Close",
    "CloseCode",
    "Header",
    "Message",
    "MsgType",
    "Offer",
    "ParseError",
    "ParseReason",
    "Refuse",
    "RefuseCode",
    "Repair",
    "Result",
    "Role",
    "Source",
    "body_bounds",
    "check_symbol_size",
    "clip_text",
    "decode_body",
    "decode_checked_body",
    "encode_body",
    "max_app_chunk",
    "new_header",
    "pack_header",
    "pack_source_id",
    "peek_header",
    "repair_fec_id",
    "split_app",
    "types_received_by",
    "types_sent_by",
    "unpack_header",
]

# --------------------------------------------------------------------------- constants

WIRE_VERSION: Final = 1
HEADER_SIZE: Final = 14
TAG_SIZE: Final = 16
OVERHEAD: Final = HEADER_SIZE + TAG_SIZE
MAX_DATAGRAM: Final = 1400
SOURCE_ID_SIZE: Final = 4
REPAIR_ID_SIZE: Final = 8
DEFAULT_SYMBOL_SIZE: Final = MAX_DATAGRAM - HEADER_SIZE - TAG_SIZE - REPAIR_ID_SIZE  # 1362
ACK_BODY_SIZE: Final = 38  # fixed part; the hole map follows
MAX_HOLE_BITS: Final = 4096
OFFER_FIXED_SIZE: Final = 48
ACCEPT_BODY_SIZE: Final = 6
RESULT_FIXED_SIZE: Final = 8
FINGERPRINT_SIZE: Final = 32
MAX_TEXT: Final = 512
MAX_BODY: Final = MAX_DATAGRAM - OVERHEAD

U32_MAX: Final = 0xFFFF_FFFF  # also the last packet number
_U16_MAX: Final = 0xFFFF

_HEADER = struct.Struct(">BBQI")
_U32 = struct.Struct(">I")
_REPAIR_ID = struct.Struct(">HHI")
_ACK = struct.Struct(">IIIHHIIIIIH")
_OFFER = struct.Struct(">HHII32sHH")
_ACCEPT = struct.Struct(">HI")
_RESULT = struct.Struct(">IHH")
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


class MsgType(enum.IntEnum):
    SOURCE = 1
    REPAIR = 2
    ACK = 3
    OFFER = 4
    ACCEPT = 5
    REFUSE = 6
    RESULT = 7
    CLOSE = 8


class RefuseCode(enum.IntEnum):
    FINGERPRINT_MISMATCH = 1
    OVERLOADED = 2
    BAD_PARAMETERS = 3
    UNSUPPORTED_VERSION = 4
    OTHER = 5


class CloseCode(enum.IntEnum):
    DONE = 0
    CANCELLED = 1
    ERROR = 2
    TIMEOUT = 3


class Role(enum.Enum):
    SENDER = "sender"
    RECEIVER = "receiver"


_MSGTYPE_BY_INT: Final = {int(t): t for t in MsgType}
_REFUSE_BY_INT: Final = {int(c): c for c in RefuseCode}
_CLOSE_BY_INT: Final = {int(c): c for c in CloseCode}

# Types each direction may carry (s2r = sealed by the sender, opened by the receiver).
_S2R_TYPES: Final = frozenset({MsgType.SOURCE, MsgType.REPAIR, MsgType.OFFER, MsgType.CLOSE})
_R2S_TYPES: Final = frozenset({MsgType.ACK, MsgType.ACCEPT, MsgType.REFUSE, MsgType.RESULT, MsgType.CLOSE})


def types_sent_by(role: Role) -> frozenset[MsgType]:
    """The message types ``role`` seals."""
    return _S2R_TYPES if role is Role.SENDER else _R2S_TYPES


def types_received_by(role: Role) -> frozenset[MsgType]:
    """The message types ``role`` opens (the peer's)."""
    return _R2S_TYPES if role is Role.SENDER else _S2R_TYPES


# --------------------------------------------------------------------------- errors

ParseReason: TypeAlias = Literal[
    "truncated",  # shorter than the header+tag or than the type's minimum body
    "oversized",  # datagram longer than MAX_DATAGRAM
    "bad_version",  # version byte != WIRE_VERSION
    "bad_type",  # unknown type, or a type the peer's role never sends
    "bad_length",  # body longer than the type allows / not the fixed size
    "wrong_session",  # header session id is not this protector's
    "auth",  # AEAD tag (or the all-zero tag in unauthenticated mode) does not verify
    "replay",  # packet number already received
    "too_old",  # packet number left of the replay window
    "bad_field",  # field value out of its domain (pn 0, NSS 0, unknown code, bad UTF-8, ...)
]
PARSE_REASONS: Final[frozenset[str]] = frozenset(
    {
        "truncated",
        "oversized",
        "bad_version",
        "bad_type",
        "bad_length",
        "wrong_session",
        "auth",
        "replay",
        "too_old",
        "bad_field",
    }
)


class ParseError(Exception):
    """A received datagram was rejected. ``reason`` is a short snake_case code."""

    reason: ParseReason

    def __init__(self, reason: ParseReason, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class Header:
    version: int
    type: MsgType
    session_id: int
    packet_number: int


@dataclass(frozen=True, slots=True)
class Source:
    TYPE: ClassVar[MsgType] = MsgType.SOURCE
    esi: int
    symbol: bytes | memoryview


@dataclass(frozen=True, slots=True)
class Repair:
    TYPE: ClassVar[MsgType] = MsgType.REPAIR
    repair_key: int
    dt: int
    nss: int
    fss_esi: int
    symbol: bytes | memoryview


@dataclass(frozen=True, slots=True)
class Ack:
    TYPE: ClassVar[MsgType] = MsgType.ACK
    decoded_prefix: int
    seen_end: int
    decoded_count: int
    deficit: int  # saturates at 65535 when encoded
    unknowns: int  # saturates at 65535 when encoded
    largest_pn: int
    ack_delay_us: int
    received: int
    lost: int
    loss_runs: int
    hole_bits: int = 0  # length of the hole map in bits
    holes: bytes = b""  # packed map of undecoded ESIs from decoded_prefix (see module doc)


@dataclass(frozen=True, slots=True)
class Offer:
    TYPE: ClassVar[MsgType] = MsgType.OFFER
    symbol_size: int
    window_cap: int
    n_source: int
    budget_us: int
    fingerprint: bytes
    part_index: int = 0
    part_count: int = 1
    app: bytes = b""


@dataclass(frozen=True, slots=True)
class Accept:
    TYPE: ClassVar[MsgType] = MsgType.ACCEPT
    window_cap: int
    n_source: int


@dataclass(frozen=True, slots=True)
class Refuse:
    TYPE: ClassVar[MsgType] = MsgType.REFUSE
    code: RefuseCode
    text: str = ""


@dataclass(frozen=True, slots=True)
class Result:
    TYPE: ClassVar[MsgType] = MsgType.RESULT
    decoded_count: int
    part_index: int = 0
    part_count: int = 1
    app: bytes = b""


@dataclass(frozen=True, slots=True)
class Close:
    TYPE: ClassVar[MsgType] = MsgType.CLOSE
    code: CloseCode
    text: str = ""


Message: TypeAlias = Source | Repair | Ack | Offer | Accept | Refuse | Result | Close

# --------------------------------------------------------------------------- helpers


def max_app_chunk(kind: MsgType) -> int:
    """Largest app-bytes chunk an OFFER or RESULT part can carry within MAX_DATAGRAM."""
    if kind == MsgType.OFFER:
        return MAX_BODY - OFFER_FIXED_SIZE
    if kind == MsgType.RESULT:
        return MAX_BODY - RESULT_FIXED_SIZE
    raise ValueError(f"max_app_chunk: kind must be MsgType.OFFER or MsgType.RESULT, got {kind!r}")


def split_app(blob: bytes, kind: MsgType) -> list[bytes]:
    """Split an application blob into OFFER/RESULT part chunks (at least one, maybe empty)."""
    size = max_app_chunk(kind)
    chunks = [bytes(blob[i : i + size]) for i in range(0, len(blob), size)] or [b""]
    if len(chunks) > _U16_MAX:
        raise ValueError(f"app blob of {len(blob)} B needs {len(chunks)} parts; at most {_U16_MAX} fit")
    return chunks


def clip_text(text: str, limit: int = MAX_TEXT) -> str:
    """Longest prefix of ``text`` whose UTF-8 encoding fits ``limit`` bytes (REFUSE/CLOSE)."""
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return text
    return raw[:limit].decode("utf-8", errors="ignore")


def _buflen(buf: bytes | bytearray | memoryview) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def body_bounds(mtype: int, symbol_size: int) -> tuple[int, int]:
    """(min, max) body size for a type; KeyError for an unknown type."""
    return {
        MsgType.SOURCE: (SOURCE_ID_SIZE + symbol_size, SOURCE_ID_SIZE + symbol_size),
        MsgType.REPAIR: (REPAIR_ID_SIZE + symbol_size, REPAIR_ID_SIZE + symbol_size),
        MsgType.ACK: (ACK_BODY_SIZE, ACK_BODY_SIZE + MAX_HOLE_BITS // 8),
        MsgType.OFFER: (OFFER_FIXED_SIZE, MAX_BODY),
        MsgType.ACCEPT: (ACCEPT_BODY_SIZE, ACCEPT_BODY_SIZE),
        MsgType.REFUSE: (1, 1 + MAX_TEXT),
        MsgType.RESULT: (RESULT_FIXED_SIZE, MAX_BODY),
        MsgType.CLOSE: (1, 1 + MAX_TEXT),
    }[_MSGTYPE_BY_INT[mtype]]


def check_symbol_size(symbol_size: int) -> None:
    """ValueError unless ``symbol_size`` is a session symbol size one datagram can carry."""
    if not isinstance(symbol_size, int) or not 1 <= symbol_size <= DEFAULT_SYMBOL_SIZE:
        raise ValueError(f"symbol_size must be an int in [1, {DEFAULT_SYMBOL_SIZE}], got {symbol_size!r}")


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
        msg.hole_bits,
    ) + bytes(msg.holes)


def _enc_offer(msg: Offer) -> bytes:
    if not isinstance(msg.fingerprint, (bytes, bytearray)) or len(msg.fingerprint) != FINGERPRINT_SIZE:
        raise ValueError(f"OFFER: fingerprint must be {FINGERPRINT_SIZE} bytes")
    _check_parts(msg.part_index, msg.part_count, "OFFER")
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
    )
    return fixed + msg.app


def _enc_result(msg: Result) -> bytes:
    _check_parts(msg.part_index, msg.part_count, "RESULT")
    if len(msg.app) > max_app_chunk(MsgType.RESULT):
        raise ValueError(f"RESULT: app chunk of {len(msg.app)} B > {max_app_chunk(MsgType.RESULT)}")
    return _pack(_RESULT, "RESULT", msg.decoded_count, msg.part_index, msg.part_count) + msg.app


def _enc_coded_text(msg: Refuse | Close) -> bytes:
    what, codes = ("REFUSE", _REFUSE_BY_INT) if isinstance(msg, Refuse) else ("CLOSE", _CLOSE_BY_INT)
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
        return _pack(_ACCEPT, "ACCEPT", msg.window_cap, msg.n_source)
    if isinstance(msg, Result):
        return _enc_result(msg)
    if isinstance(msg, (Refuse, Close)):
        return _enc_coded_text(msg)
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


def _fast_ctor4(cls: type[Any]) -> Callable[[Any, Any, Any, Any], Any]:
    a, b, c, d = (cls.__dict__[f.name].__set__ for f in fields(cls))
    new = object.__new__

    def make(w: Any, x: Any, y: Any, z: Any) -> Any:
        obj = new(cls)
        a(obj, w)
        b(obj, x)
        c(obj, y)
        d(obj, z)
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


new_header: Final[Callable[[int, MsgType, int, int], Header]] = _fast_ctor4(Header)
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
    return Ack(*fields, bytes(body[ACK_BODY_SIZE:]))  # type: ignore[call-arg]


def _dec_parts(pi: int, pc: int, what: str) -> None:
    if pc == 0 or pi >= pc:
        raise ParseError("bad_field", f"{what} part {pi}/{pc}")


def _dec_offer(body: _Body) -> Offer:
    ss, wc, ns, budget, fp, pi, pc = _OFFER.unpack_from(body)
    _dec_parts(pi, pc, "OFFER")
    if not 1 <= ss <= DEFAULT_SYMBOL_SIZE:  # no datagram could carry such a symbol
        raise ParseError("bad_field", f"OFFER symbol_size {ss}")
    return Offer(ss, wc, ns, budget, fp, pi, pc, bytes(body[OFFER_FIXED_SIZE:]))


def _dec_accept(body: _Body) -> Accept:
    wc, ns = _ACCEPT.unpack_from(body)
    return Accept(wc, ns)


def _dec_text(body: _Body, what: str) -> str:
    try:
        return bytes(body[1:]).decode("utf-8")
    except UnicodeDecodeError:
        raise ParseError("bad_field", f"{what} text is not UTF-8") from None


def _dec_refuse(body: _Body) -> Refuse:
    code = _REFUSE_BY_INT.get(body[0])
    if code is None:
        raise ParseError("bad_field", f"REFUSE code {body[0]}")
    return Refuse(code, _dec_text(body, "REFUSE"))


def _dec_result(body: _Body) -> Result:
    dc, pi, pc = _RESULT.unpack_from(body)
    _dec_parts(pi, pc, "RESULT")
    return Result(dc, pi, pc, bytes(body[RESULT_FIXED_SIZE:]))


def _dec_close(body: _Body) -> Close:
    code = _CLOSE_BY_INT.get(body[0])
    if code is None:
        raise ParseError("bad_field", f"CLOSE code {body[0]}")
    return Close(code, _dec_text(body, "CLOSE"))


_DECODERS: Final[dict[int, Callable[[_Body], Message]]] = {
    1: _dec_source,
    2: _dec_repair,
    3: _dec_ack,
    4: _dec_offer,
    5: _dec_accept,
    6: _dec_refuse,
    7: _dec_result,
    8: _dec_close,
}


def decode_body(mtype: int, body: bytes | memoryview, symbol_size: int) -> Message:
    """Parse a plaintext body of type ``mtype``; raises ParseError only.

    SOURCE/REPAIR ``symbol`` is a memoryview into ``body`` (zero copy).
    """
    if mtype not in _MSGTYPE_BY_INT:
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
    """(version, type, session id, packet number) of a datagram of a possible size and our version;
    ParseError otherwise. The checks of the type and the packet number are the caller's."""
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

    Nothing here is authenticated yet: use it to pick a protector, then call its ``open_peeked()``.
    """
    version, mtype, sid, pn = unpack_header(datagram)
    t = _MSGTYPE_BY_INT.get(mtype)
    if t is None:
        raise ParseError("bad_type", f"type {mtype}")
    if pn == 0:
        raise ParseError("bad_field", "packet number 0")
    return new_header(version, t, sid, pn)
