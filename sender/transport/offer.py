"""The sender's OFFER datagrams (sans-IO): the handoff's parameters and application blob, in parts.

Each part states the receiver's time budget as it will be when the part arrives (the deadline less the
one-way delay and the part's own serialisation), never a timestamp; the receiver's deadline runs from the
first part it receives. Parts are sealed in the handshake phase (an explicit random nonce) until the
ACCEPT, and the last part once more under the session key right after it (the receiver establishes the
session on that datagram: :mod:`pfec.receiver.endpoint`).

Until the ACCEPT the OFFER goes again every ``offer_retry_s``, or sooner (``retry_at``). The receiver
answers the first part it gets, so parts lost before the ACCEPT would never be sent again:
after the ACCEPT an OFFER of several parts is repeated whole, at doubling intervals, until the receiver
shows it has the application data (a split's or local prefill's first computed tokens: it needs the
context's token ids) or ``REPEATS_AFTER_ACCEPT`` times (measured: a lost part of a split's OFFER failed
one demo in nine: "the OFFER's application data never arrived complete").
"""

from __future__ import annotations

from typing import Final

from pfec.common.codec.fec import Encoder
from pfec.common.wire.messages import NONCE_SIZE, OFFER_FIXED_SIZE, OVERHEAD, MsgType, Offer, split_app
from pfec.common.wire.seal import PacketProtector
from pfec.sender.transport.session_types import EARLY_OFFER_EVERY, SenderConfig

REPEATS_AFTER_ACCEPT: Final = 4


class OfferParts:
    """Seals the OFFER's parts for one session: again until the ACCEPT, and a multi-part one after it."""

    __slots__ = ("config", "encoder", "parts", "protector", "repeat_at", "repeat_gap_s", "repeats_left",
                 "retry_at")

    def __init__(self, config: SenderConfig, encoder: Encoder, protector: PacketProtector) -> None:
        self.config = config
        self.encoder = encoder
        self.protector = protector
        self.parts = split_app(config.app_blob, MsgType.OFFER)
        self.repeats_left = 0
        self.repeat_gap_s = config.offer_retry_s
        self.repeat_at: float | None = None  # when the next repeat after the ACCEPT is due (None: none)
        self.retry_at: float | None = None  # when the OFFER goes again before the ACCEPT (None: not armed)

    def first(self, deadline: float, now: float, slot_s: float) -> list[bytes]:
        """Every part, sealed now, and the retry armed (until the ACCEPT, or until sending stops)."""
        # The OFFER also goes again every EARLY_OFFER_EVERY data datagrams: a receiver that lost it holds
        # only its first 256 (unauthenticated) datagrams and drops the rest, which in utility order are the
        # most valuable (a lost OFFER cut a handoff to 0.27 of its utility).
        self.retry_at = now + min(self.config.offer_retry_s, EARLY_OFFER_EVERY * slot_s)
        return self.all(deadline, now)

    def on_accept(self, now: float, deadline: float) -> bytes:
        """The ACCEPT came: no more retries; a multi-part OFFER repeats from now on (see the module doc).
        The OFFER's last part again, under the session key: the receiver establishes the session on it."""
        self.retry_at = None
        if len(self.parts) > 1:
            self.repeats_left = REPEATS_AFTER_ACCEPT
            self.repeat_at = now + self.repeat_gap_s
        return self.part(len(self.parts) - 1, deadline, now)

    def proven(self) -> None:
        """The receiver has the application data: no more repeats."""
        self.repeats_left = 0
        self.repeat_at = None

    def repeats_due(self, deadline: float, now: float) -> list[bytes]:
        """Every part again, when a repeat is due at ``now``; else nothing."""
        if self.repeat_at is None or now < self.repeat_at:
            return []
        if now >= deadline:  # the receiver has started (or given up) by now
            self.proven()
            return []
        self.repeats_left -= 1
        self.repeat_gap_s *= 2
        self.repeat_at = now + self.repeat_gap_s if self.repeats_left > 0 else None
        return self.all(deadline, now)

    def all(self, deadline: float, now: float) -> list[bytes]:
        """Every part, sealed now."""
        return [self.part(index, deadline, now) for index in range(len(self.parts))]

    def part(self, index: int, deadline: float, now: float) -> bytes:
        """Part ``index``, sealed now for a handoff whose receiver must start by ``deadline``."""
        cfg = self.config
        app = self.parts[index]
        offer_bytes = OVERHEAD + NONCE_SIZE + OFFER_FIXED_SIZE + len(app)
        serialise = offer_bytes * 8 / cfg.rate_bps if cfg.rate_bps > 0 else 0.0
        budget = max(0.0, deadline - now - cfg.owd_s - serialise)
        offer = Offer(
            symbol_size=self.encoder.symbol_size,
            window_cap=cfg.window_cap,
            n_source=self.encoder.n_source,
            budget_us=min(int(budget * 1e6), 0xFFFFFFFF),
            fingerprint=cfg.fingerprint,
            part_index=index,
            part_count=len(self.parts),
            app=app,
            sender_random=self.protector.local_random,
            span=cfg.decoder_span,
        )
        return self.protector.seal(offer)
