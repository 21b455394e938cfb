"""What travels between the two nodes: sizes, message types and codes, the message dataclasses, the
one parse error, and small helpers over them (sans-IO, no bytes parsed here).

The byte layouts, encoding and the one parser are :mod:`.frames`'; sealing and opening are :mod:`.seal`'s.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, Final, Literal, TypeAlias

# --------------------------------------------------------------------------- constants

# Wire versions: 2: key phases, a handshake with fresh randomness per side; 3: the OFFER's span;
# 4: the ACK's computed_tokens (how far the receiver's own prefill has got: compute front, stream back);
# 5: the sender's DONE (the completion signal: it will send nothing more the receiver could use) and the
# ACCEPT's statement of the receiver's prefill speed; 6: the ACCEPT states the rest of the receiver's
# measured speed (rebuild per precision, the question's forward, decode growth, receive cost per datagram)
WIRE_VERSION: Final = 6
HEADER_SIZE: Final = 14
TAG_SIZE: Final = 16
OVERHEAD: Final = HEADER_SIZE + TAG_SIZE
MAX_DATAGRAM: Final = 1400
SOURCE_ID_SIZE: Final = 4
REPAIR_ID_SIZE: Final = 8
DEFAULT_SYMBOL_SIZE: Final = MAX_DATAGRAM - HEADER_SIZE - TAG_SIZE - REPAIR_ID_SIZE  # 1362
ACK_BODY_SIZE: Final = 42  # fixed part; the hole map follows
MAX_HOLE_BITS: Final = 4096
RANDOM_SIZE: Final = 16  # each side's fresh handshake value (R_s in the OFFER, R_r in the ACCEPT)
NONCE_SIZE: Final = 12  # the explicit random AEAD nonce of a handshake datagram, right after the header
OFFER_FIXED_SIZE: Final = 50 + RANDOM_SIZE
ACCEPT_BODY_SIZE: Final = 6 + RANDOM_SIZE + 16 + 36
RESULT_FIXED_SIZE: Final = 8
DONE_BODY_SIZE: Final = 13
FINGERPRINT_SIZE: Final = 32
MAX_TEXT: Final = 512
MAX_BODY: Final = MAX_DATAGRAM - OVERHEAD

U32_MAX: Final = 0xFFFF_FFFF  # also the last packet number
_U16_MAX: Final = 0xFFFF


class MsgType(enum.IntEnum):
    SOURCE = 1
    REPAIR = 2
    ACK = 3
    OFFER = 4
    ACCEPT = 5
    REFUSE = 6
    RESULT = 7
    CLOSE = 8
    DONE = 9


class KeyPhase(enum.IntEnum):
    """Which key sealed a datagram: the top two bits of its type byte (the low six are the ``MsgType``)."""

    SESSION = 0x00  # the session keys (sender and receiver randomness); nonce = packet number
    EARLY = 0x40  # sender -> receiver before the ACCEPT: the sender's early key; nonce = packet number
    HANDSHAKE = 0x80  # OFFER, ACCEPT, REFUSE before a session: static key per direction, explicit nonce


TYPE_MASK: Final = 0x3F
PHASE_MASK: Final = 0xC0


class RefuseCode(enum.IntEnum):
    FINGERPRINT_MISMATCH = 1
    OVERLOADED = 2
    BAD_PARAMETERS = 3
    UNSUPPORTED_VERSION = 4
    OTHER = 5


class DoneReason(enum.IntEnum):
    """Why the sender will send nothing more the receiver could use (the DONE's reason)."""

    DECODED = 0  # the ACKs say every source symbol planned is decoded
    BUDGET_SPENT = 1  # its repair cap is spent with every source sent
    NO_REPAIR = 2  # a scheme without repairs (or an open-loop code) has sent everything it will send
    PATH_BROKEN = 3  # the rate controller's circuit breaker stopped the stream: the path stopped delivering


class CloseCode(enum.IntEnum):
    DONE = 0
    CANCELLED = 1
    ERROR = 2
    TIMEOUT = 3


class Role(enum.Enum):
    SENDER = "sender"
    RECEIVER = "receiver"


MSGTYPE_BY_INT: Final = {int(t): t for t in MsgType}
PHASE_BY_INT: Final = {int(p): p for p in KeyPhase}
REFUSE_BY_INT: Final = {int(c): c for c in RefuseCode}
CLOSE_BY_INT: Final = {int(c): c for c in CloseCode}
DONE_BY_INT: Final = {int(c): c for c in DoneReason}

# Types each direction may carry (s2r = sealed by the sender, opened by the receiver).
_S2R_TYPES: Final = frozenset({MsgType.SOURCE, MsgType.REPAIR, MsgType.OFFER, MsgType.CLOSE, MsgType.DONE})
_R2S_TYPES: Final = frozenset({MsgType.ACK, MsgType.ACCEPT, MsgType.REFUSE, MsgType.RESULT, MsgType.CLOSE})


# (phase, type) pairs each direction may carry: the OFFER in the handshake phase (and once more under the
# session key right after the ACCEPT, to establish the session), ACCEPT only in the handshake phase, REFUSE
# in the handshake phase (before a session exists) or under the session keys, data and CLOSE early or in
# session; DONE only under the session keys (the sender sends it after the ACCEPT).
_S2R_PHASES: Final = frozenset(
    {(KeyPhase.HANDSHAKE, MsgType.OFFER), (KeyPhase.SESSION, MsgType.OFFER), (KeyPhase.SESSION, MsgType.DONE)}
    | {
        (p, t)
        for p in (KeyPhase.EARLY, KeyPhase.SESSION)
        for t in (MsgType.SOURCE, MsgType.REPAIR, MsgType.CLOSE)
    }
)
_R2S_PHASES: Final = frozenset(
    {(KeyPhase.HANDSHAKE, MsgType.ACCEPT), (KeyPhase.HANDSHAKE, MsgType.REFUSE)}
    | {(KeyPhase.SESSION, t) for t in (MsgType.ACK, MsgType.REFUSE, MsgType.RESULT, MsgType.CLOSE)}
)


def phases_sent_by(role: Role) -> frozenset[tuple[KeyPhase, MsgType]]:
    """The (key phase, message type) pairs ``role`` seals."""
    return _S2R_PHASES if role is Role.SENDER else _R2S_PHASES


def phase_of(mtype: MsgType, role: Role, *, session_keys: bool) -> KeyPhase:
    """The phase ``role`` seals ``mtype`` in: ACCEPT always handshake, the OFFER until the session keys;
    before them the sender's data and CLOSE are early and the receiver's REFUSE is handshake."""
    if mtype is MsgType.ACCEPT or (mtype is MsgType.OFFER and not session_keys):
        return KeyPhase.HANDSHAKE
    if session_keys:
        return KeyPhase.SESSION
    return KeyPhase.EARLY if role is Role.SENDER else KeyPhase.HANDSHAKE


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
    "no_key",  # a phase whose key this side does not hold yet (session keys before the ACCEPT)
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
        "no_key",
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
    type: MsgType  # the type byte's low six bits
    session_id: int
    packet_number: int
    phase: KeyPhase = KeyPhase.SESSION  # the type byte's top two bits: which key sealed the datagram


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
    # Context tokens [0, computed_tokens) the receiver has prefilled itself (a split handoff; 0 otherwise):
    # the sender stops sending pieces of blocks entirely below it. Checked against the context by the
    # sender (a value past it is dropped with a reason).
    computed_tokens: int = 0


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
    sender_random: bytes = b""  # R_s: RANDOM_SIZE fresh bytes per session (the sender's protector's)
    span: int = 0  # decoder span the sender asks for (symbols past the prefix repairs may reach); 0: any


@dataclass(frozen=True, slots=True)
class Accept:
    TYPE: ClassVar[MsgType] = MsgType.ACCEPT
    window_cap: int
    n_source: int
    receiver_random: bytes = b""  # R_r: RANDOM_SIZE fresh bytes per ACCEPT (the sender's R_s is its AAD)
    # The receiver's prefill speed as it measured it (t(N) = a + bN + cN^2, one decode step), in integer
    # units: a in us, b in ns per token, c in ps per token^2, decode in us; all 0: not stated. The sender
    # checks them (common/plan/breakeven.py ``stated_receiver``) before its planner uses them.
    prefill_a_us: int = 0
    prefill_b_ns: int = 0
    prefill_c_ps: int = 0
    decode_us: int = 0
    # Wire version 6: the rest of what the planner predicts, as the receiver measured it on itself
    # (``receiver_speed.Statement``; 0: not measured): its rebuild per context token at native, int8, int4
    # and int2, the question's masked forward (fixed, per question token, per cached token), the first decode
    # step's growth per cached token, and its receive path's CPU per datagram.
    rebuild_native_ns: int = 0
    rebuild_int8_ns: int = 0
    rebuild_int4_ns: int = 0
    rebuild_int2_ns: int = 0
    question_a_us: int = 0
    question_ns_per_token: int = 0
    question_ps_per_cached: int = 0
    decode_ps_per_cached: int = 0
    datagram_ns: int = 0


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
class Done:
    """The completion signal: the sender will send nothing more the receiver could use. Its counts are
    what the sender sent; the receiver checks them against what arrived (a DONE claiming fewer sources
    than the receiver saw, or a last data packet at or after its own, is dropped)."""

    TYPE: ClassVar[MsgType] = MsgType.DONE
    sources_sent: int  # source symbols sent: ESIs [0, sources_sent)
    repairs_sent: int
    last_data_pn: int  # packet number of the last SOURCE/REPAIR sealed (0: none)
    reason: DoneReason


@dataclass(frozen=True, slots=True)
class Close:
    TYPE: ClassVar[MsgType] = MsgType.CLOSE
    code: CloseCode
    text: str = ""


Message: TypeAlias = Source | Repair | Ack | Offer | Accept | Refuse | Result | Close | Done

# --------------------------------------------------------------------------- helpers


def max_app_chunk(kind: MsgType) -> int:
    """Largest app-bytes chunk an OFFER or RESULT part can carry within MAX_DATAGRAM."""
    if kind == MsgType.OFFER:  # a handshake datagram: the explicit nonce comes off the body
        return MAX_BODY - NONCE_SIZE - OFFER_FIXED_SIZE
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


def body_bounds(mtype: int, symbol_size: int) -> tuple[int, int]:
    """(min, max) body size for a type; KeyError for an unknown type."""
    return {
        MsgType.SOURCE: (SOURCE_ID_SIZE + symbol_size, SOURCE_ID_SIZE + symbol_size),
        MsgType.REPAIR: (REPAIR_ID_SIZE + symbol_size, REPAIR_ID_SIZE + symbol_size),
        MsgType.ACK: (ACK_BODY_SIZE, ACK_BODY_SIZE + MAX_HOLE_BITS // 8),
        MsgType.OFFER: (OFFER_FIXED_SIZE, MAX_BODY - NONCE_SIZE),
        MsgType.ACCEPT: (ACCEPT_BODY_SIZE, ACCEPT_BODY_SIZE),
        MsgType.REFUSE: (1, 1 + MAX_TEXT),  # + NONCE_SIZE still fits MAX_DATAGRAM
        MsgType.RESULT: (RESULT_FIXED_SIZE, MAX_BODY),
        MsgType.CLOSE: (1, 1 + MAX_TEXT),
        MsgType.DONE: (DONE_BODY_SIZE, DONE_BODY_SIZE),
    }[MSGTYPE_BY_INT[mtype]]


def check_symbol_size(symbol_size: int) -> None:
    """ValueError unless ``symbol_size`` is a session symbol size one datagram can carry."""
    if not isinstance(symbol_size, int) or not 1 <= symbol_size <= DEFAULT_SYMBOL_SIZE:
        raise ValueError(f"symbol_size must be an int in [1, {DEFAULT_SYMBOL_SIZE}], got {symbol_size!r}")


