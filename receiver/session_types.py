"""The receiver session's inputs and outputs (sans-IO): its config, the events it emits and its stats.

:mod:`pfec.receiver.session` holds the session itself and re-exports every name here; its states and
their table are in :mod:`pfec.receiver.session_states`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from pfec.common.events import DatagramDropped, Event
from pfec.common.wire.messages import MAX_HOLE_BITS, Offer

__all__ = [
    "DeadlineReached", "OfferReceived", "ReceiverConfig", "ReceiverEvent", "ReceiverStats", "SessionClosed",
    "decoder_span", "same_handoff",
]


@dataclass(frozen=True, slots=True)
class ReceiverConfig:
    # An ACK per ~1.8 ms at 100 Mbit/s: feedback stays far below one RTT. 16 rather than 8 halves the
    # feedback CPU on both sides and the reverse traffic; recovered utility did not move (docs/RESULTS.md).
    ack_every: int = 16
    ack_delay_s: float = 0.002
    # Decoder span: undecoded symbols repairs may still reach past the prefix (>= the sender's window
    # cap); it sizes the ACK's hole map (span / 8 bytes). This is the floor and default: the endpoint
    # grants each session the span its OFFER asks for (about two bandwidth-delay products plus the
    # coding window, so every hole of a round trip can be repaired in the next), within 4095, n_source
    # and max_session_bytes.
    decoder_span: int = 512
    result_retry_s: float = 0.05
    result_retries: int = 20
    max_sessions: int = 64
    max_session_bytes: int = 1 << 30  # N x symbol size one session may allocate
    pending_sessions: int = 8  # unknown session ids whose early data is buffered
    pending_datagrams: int = 256  # per unknown session id (raw, unauthenticated: before any OFFER)
    # Early data opened under a verified OFFER's early key, held until the handshake completes: the
    # sender's first flight covers the handshake's round trip (about one bandwidth-delay product, 2,000
    # datagrams at 100 Mbit/s and 200 ms), so a per-handshake bound of 256 left a long link idle. The
    # total across pending handshakes bounds the memory (8192 x ~1.3 KB, about 11 MB).
    early_datagrams: int = 2048  # per pending handshake (= the sender's MAX_FIRST_FLIGHT)
    early_total: int = 8192  # across all pending handshakes and unknown session ids
    closed_memory: int = 1024  # recently closed session ids remembered (late data is counted, not buffered)
    # Bounds on what an OFFER may ask for (checked before anything is allocated; REFUSE otherwise).
    max_budget_s: float = 60.0  # the OFFER's time budget
    max_offer_parts: int = 64  # OFFER datagrams of one handoff (64 x 1294 B of application data)
    # Pending handshakes: OFFERs answered with an ACCEPT, not yet proven by a datagram under the session key.
    max_handshakes: int = 64  # the oldest is dropped (counted) when a new one would exceed this
    handshake_timeout_s: float = 3.0  # a pending handshake expires this long after its first OFFER

    def __post_init__(self) -> None:
        if self.ack_every < 1:
            raise ValueError(f"ack_every must be >= 1, got {self.ack_every!r}")
        if self.ack_delay_s <= 0:
            raise ValueError(f"ack_delay_s must be positive, got {self.ack_delay_s!r}")
        if not 1 <= self.decoder_span <= MAX_HOLE_BITS:
            raise ValueError(f"decoder_span must be in 1..{MAX_HOLE_BITS}, got {self.decoder_span!r}")
        for name in ("max_sessions", "max_session_bytes", "pending_sessions", "pending_datagrams",
                     "early_datagrams", "early_total", "closed_memory", "max_offer_parts", "max_handshakes",
                     "result_retries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0 < self.max_budget_s <= 0xFFFF_FFFF * 1e-6:
            raise ValueError(f"max_budget_s must be in (0, 4294.967295], got {self.max_budget_s!r}")
        if self.handshake_timeout_s <= 0:
            raise ValueError(f"handshake_timeout_s must be positive, got {self.handshake_timeout_s!r}")


def decoder_span(offer: Offer, config: ReceiverConfig) -> int:
    """The decoder span a session for ``offer`` keeps (told to the sender in the ACCEPT)."""
    return max(offer.window_cap, config.decoder_span)


def same_handoff(a: Offer, b: Offer) -> bool:
    """Whether two OFFER parts describe the same handoff attempt (every field but the part and budget)."""
    return (
        a.sender_random == b.sender_random
        and a.part_count == b.part_count
        and a.n_source == b.n_source
        and a.symbol_size == b.symbol_size
        and a.window_cap == b.window_cap
        and a.fingerprint == b.fingerprint
    )


# Events.
@dataclass(frozen=True, slots=True)
class OfferReceived(Event):
    session_id: int
    offer: Offer
    app_blob: bytes


@dataclass(frozen=True, slots=True)
class DeadlineReached(Event):
    session_id: int
    decoded_esis: npt.NDArray[np.int64]  # every decoded source symbol
    store: npt.NDArray[np.uint8]  # (N, S) decoded symbols by ESI (rows not in decoded_esis are garbage)
    have: npt.NDArray[np.bool_]
    stats: ReceiverStats
    ready: bool = False  # True: everything planned was decoded before the deadline (start when ready)
    at: float = 0.0  # when the session reached it (its deadline, when the last symbol decoded, the DONE)
    sender_done: bool = False  # True: the sender's DONE started it (nothing more it could use would come)

    @property
    def start(self) -> str:
        """What started generation: ``ready``, ``sender-done`` or ``deadline``."""
        return "ready" if self.ready else "sender-done" if self.sender_done else "deadline"

    @property
    def started_at(self) -> float:
        """When decoding closed: ``at`` unless the deadline closed it (then the deadline itself)."""
        return self.at if self.ready or self.sender_done else self.stats.deadline_at


@dataclass(frozen=True, slots=True)
class SessionClosed(Event):
    session_id: int
    reason: str


ReceiverEvent = OfferReceived | DeadlineReached | SessionClosed | DatagramDropped


@dataclass(slots=True)
class ReceiverStats:
    received: dict[str, int] = field(default_factory=lambda: {"source": 0, "repair": 0, "control": 0})
    lost: int = 0  # packet-number gaps
    loss_runs: int = 0
    duplicates: int = 0  # source symbols that were already known
    redundant_repairs: int = 0
    late: int = 0  # data after the deadline
    acks_sent: int = 0
    stalls: int = 0  # times the undecoded range outgrew the decoder span (repairs could not reach it)
    stall_time_s: float = 0.0
    first_data_at: float | None = None
    deadline_at: float = 0.0
