"""The sender's OFFER datagrams (sans-IO): the handoff's parameters and application blob, in parts.

Each part states the receiver's time budget as it will be when the part arrives (the deadline less the
one-way delay and the part's own serialisation), never a timestamp; the receiver's deadline runs from the
first part it receives. Parts are sealed in the handshake phase (an explicit random nonce) until the
ACCEPT, and the last part once more under the session key right after it (the receiver establishes the
session on that datagram: :mod:`pfec.receiver.endpoint`).
"""

from __future__ import annotations

from pfec.common.codec.fec import Encoder
from pfec.common.wire.messages import NONCE_SIZE, OFFER_FIXED_SIZE, OVERHEAD, MsgType, Offer, split_app
from pfec.common.wire.seal import PacketProtector
from pfec.sender.transport.session_types import SenderConfig


class OfferParts:
    """Seals the OFFER's parts for one session."""

    __slots__ = ("config", "encoder", "parts", "protector")

    def __init__(self, config: SenderConfig, encoder: Encoder, protector: PacketProtector) -> None:
        self.config = config
        self.encoder = encoder
        self.protector = protector
        self.parts = split_app(config.app_blob, MsgType.OFFER)

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
