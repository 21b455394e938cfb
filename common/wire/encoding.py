"""Our own messages -> plaintext bodies (sans-IO): every field checked against its layout and domain.

The byte layouts are :mod:`.frames`' (as is parsing: the one module that turns bytes into messages);
:mod:`.seal` seals what this builds. Encoding a malformed message of ours raises ``ValueError``
(``TypeError`` for something that is not a message), never ``ParseError``.
"""

from __future__ import annotations

import struct
from typing import Final

from pfec.common.wire.frames import (
    ACCEPT_LAYOUT,
    ACK_LAYOUT,
    DONE_LAYOUT,
    OFFER_LAYOUT,
    REPAIR_ID_LAYOUT,
    RESULT_LAYOUT,
    U32_LAYOUT,
    buflen,
)
from pfec.common.wire.messages import (
    _U16_MAX,
    CLOSE_BY_INT,
    DEFAULT_SYMBOL_SIZE,
    DONE_BY_INT,
    FINGERPRINT_SIZE,
    MAX_HOLE_BITS,
    MAX_TEXT,
    RANDOM_SIZE,
    REFUSE_BY_INT,
    Accept,
    Ack,
    Close,
    Done,
    Message,
    MsgType,
    Offer,
    Refuse,
    Repair,
    Result,
    Source,
    max_app_chunk,
)

_REPAIR_ID_PACK: Final = REPAIR_ID_LAYOUT.pack  # (repair_key, dt << 12 | nss, fss_esi): one lookup less


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
    n = buflen(msg.symbol)
    if symbol_size is None:
        if not 1 <= n <= DEFAULT_SYMBOL_SIZE:
            raise ValueError(f"symbol of {n} B: must be 1..{DEFAULT_SYMBOL_SIZE}")
    elif n != symbol_size:
        raise ValueError(f"symbol of {n} B, session symbol_size is {symbol_size}")
    if isinstance(msg, Source):
        return _pack(U32_LAYOUT, "SOURCE", msg.esi) + msg.symbol
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
        ACK_LAYOUT,
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
        OFFER_LAYOUT,
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
    return _pack(RESULT_LAYOUT, "RESULT", msg.decoded_count, msg.part_index, msg.part_count) + msg.app


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
        return _pack(ACCEPT_LAYOUT, "ACCEPT", msg.window_cap, msg.n_source, bytes(msg.receiver_random),
                     msg.prefill_a_us, msg.prefill_b_ns, msg.prefill_c_ps, msg.decode_us,
                     msg.rebuild_native_ns, msg.rebuild_int8_ns, msg.rebuild_int4_ns, msg.rebuild_int2_ns,
                     msg.question_a_us, msg.question_ns_per_token, msg.question_ps_per_cached,
                     msg.decode_ps_per_cached, msg.datagram_ns)
    if isinstance(msg, Result):
        return _enc_result(msg)
    if isinstance(msg, (Refuse, Close)):
        return _enc_coded_text(msg)
    if isinstance(msg, Done):
        if msg.reason not in DONE_BY_INT.values():
            raise ValueError(f"DONE: unknown reason {msg.reason!r}")
        return _pack(DONE_LAYOUT, "DONE", msg.sources_sent, msg.repairs_sent, msg.last_data_pn, msg.reason)
    raise TypeError(f"not a wire message: {type(msg).__name__}")
