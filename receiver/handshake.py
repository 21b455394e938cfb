"""What the endpoint keeps and checks for a handshake not yet established (sans-IO).

- ``check_offer``: every OFFER field bounded against ``ReceiverConfig`` (and the application's own
  ``Admission``) before anything is allocated for it; a refusal is a ``(code, reason)``.
- ``grant_span``: the decoder span a session gets (:mod:`pfec.receiver.endpoint` explains the rule).
- ``Pending``: one pending handshake, answered with an ACCEPT, holding its OFFER parts and early data.
- ``HandshakeInfo``: its public view, for ``/sessions`` and metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from pfec.common.codec.fec import MAX_NSS
from pfec.common.wire.messages import Message, Offer, RefuseCode
from pfec.common.wire.seal import PacketProtector
from pfec.receiver.session_types import ReceiverConfig

__all__ = [
    "AMPLIFICATION_FACTOR", "MAX_HELD_REPEATS", "MAX_SPAN", "Admission", "HandshakeInfo", "Pending",
    "check_offer", "decoder_bytes", "grant_span",
]

#: The application's own admission check: ``(session id, offer)`` -> a refusal, or None to admit.
Admission = Callable[[int, Offer], tuple[RefuseCode, str] | None]

AMPLIFICATION_FACTOR = 3  # bytes sent <= 3 x bytes received before establishment (RFC 9000 s8.1)
MAX_SPAN = MAX_NSS  # the largest decoder span: an RFC 8681 window (12-bit NSS)
MAX_HELD_REPEATS = 64  # repeated OFFER packet numbers a pending handshake remembers (bounded)


def decoder_bytes(span: int, symbol_size: int) -> int:
    """What a decoder of ``span`` allocates on top of the session's store: its span x span coefficient
    matrix, span payload rows and its integer state (about 4 x span int64)."""
    return span * span + span * symbol_size + 32 * span


def grant_span(offer: Offer, config: ReceiverConfig) -> int:
    """The decoder span a session for ``offer`` gets (told to the sender in the ACCEPT): the OFFER's request
    within [max(window_cap, config.decoder_span), min(MAX_SPAN, n_source)], shrunk until the store and the
    decoder fit ``max_session_bytes`` (never below that floor: ``check_offer`` refuses what cannot fit)."""
    floor = max(offer.window_cap, config.decoder_span)
    span = max(floor, min(offer.span, MAX_SPAN, offer.n_source))
    room = config.max_session_bytes - offer.n_source * offer.symbol_size
    if span > floor and decoder_bytes(span, offer.symbol_size) > room:
        # The largest span whose decoder fits the room: s^2 + s (S + 32) <= room.
        b = offer.symbol_size + 32
        fit = (math.isqrt(b * b + 4 * max(0, room)) - b) // 2
        span = max(floor, fit)
    return span


def check_offer(sid: int, offer: Offer, config: ReceiverConfig, fingerprint: bytes, sessions: int,
                admit: Admission | None) -> tuple[RefuseCode, str] | None:
    """Every OFFER field bounded before anything is allocated for it (``sessions``: how many this
    receiver holds); a refusal, or None to admit."""
    cfg = config
    if offer.fingerprint != fingerprint:
        return (
            RefuseCode.FINGERPRINT_MISMATCH,
            f"sender model fingerprint {offer.fingerprint.hex()[:16]} differs from this receiver's "
            f"{fingerprint.hex()[:16]}: both nodes must serve the same model and KV layout",
        )
    if offer.n_source == 0 or offer.window_cap == 0 or offer.window_cap > 4095:
        return (
            RefuseCode.BAD_PARAMETERS,
            f"n_source {offer.n_source} and window_cap {offer.window_cap} must be positive, "
            "window_cap <= 4095",
        )
    if offer.span > MAX_SPAN:
        return (RefuseCode.BAD_PARAMETERS,
                f"decoder span {offer.span} asked for, above the largest window {MAX_SPAN}")
    if offer.part_count > cfg.max_offer_parts:
        return (RefuseCode.BAD_PARAMETERS,
                f"OFFER of {offer.part_count} parts, above max_offer_parts {cfg.max_offer_parts}")
    if offer.budget_us > cfg.max_budget_s * 1e6:
        return (RefuseCode.BAD_PARAMETERS,
                f"budget {offer.budget_us / 1e6:.3f} s above max_budget_s {cfg.max_budget_s:g}")
    # The store and the smallest decoder this receiver would run (grant_span shrinks a larger one).
    floor = max(offer.window_cap, cfg.decoder_span)
    need = offer.n_source * offer.symbol_size + decoder_bytes(floor, offer.symbol_size)
    if need > cfg.max_session_bytes:
        return (
            RefuseCode.OVERLOADED,
            f"handoff needs {need} bytes (store and decoder of span {floor}), above this receiver's "
            f"max_session_bytes {cfg.max_session_bytes}",
        )
    if sessions >= cfg.max_sessions:
        return (RefuseCode.OVERLOADED, f"receiver already holds {sessions} sessions")
    if admit is not None:
        return admit(sid, offer)
    return None


@dataclass(frozen=True, slots=True)
class HandshakeInfo:
    """A pending handshake, for ``/sessions`` and metrics: answered with an ACCEPT, not yet established."""

    session_id: int
    created_at: float
    expires_at: float
    parts_received: int
    part_count: int
    n_source: int
    symbol_size: int
    budget_s: float
    bytes_received: int
    bytes_sent: int
    span: int = 0  # the decoder span granted (the ACCEPT's)


@dataclass(slots=True)
class Pending:
    """One pending handshake (small: a few hundred bytes plus the held OFFER parts and early data)."""

    offer: Offer  # the first part received
    offer_pn: int
    config: ReceiverConfig  # the session's: the endpoint's with the decoder span granted to this OFFER
    created_at: float
    expires_at: float
    receiver_random: bytes
    reply: bytes  # the sealed ACCEPT, sent again as is for a repeated OFFER
    parts: dict[int, int] = field(default_factory=dict)  # part index -> packet number
    repeats: set[int] = field(default_factory=set)  # packet numbers of repeated OFFER parts
    held: list[tuple[int, Message]] = field(default_factory=list)  # (pn, message): later parts, early data
    protector: PacketProtector | None = None  # the session's, built (keys derived) on first need
    bytes_received: int = 0
    bytes_sent: int = 0

    def info(self, sid: int) -> HandshakeInfo:
        offer = self.offer
        return HandshakeInfo(sid, self.created_at, self.expires_at, len(self.parts), offer.part_count,
                             offer.n_source, offer.symbol_size, offer.budget_us * 1e-6, self.bytes_received,
                             self.bytes_sent, self.config.decoder_span)
