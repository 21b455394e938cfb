"""Receiver side of one handoff, sans-IO: ``ReceiverSession``, its config, stats and events.

:mod:`pfec.receiver.endpoint` keys the sessions of one receiver, answers OFFERs with an ACCEPT (a
pending handshake), establishes a session once the sender proves it saw the ACCEPT (a datagram that opens
under the session key) and feeds it the datagrams it has parsed and opened.

Theory of operation
-------------------
Session states: RECEIVING -> DEADLINE (decoding closed) -> RESULT_SENT -> CLOSED.

- A session exists once the handshake is complete (see :mod:`pfec.common.wire.seal`); its deadline is
  ``first OFFER arrival + budget`` in the receiver's own clock (the OFFER carries a time budget, never a
  timestamp, at most ``max_budget_s``). The OFFER parts and early data that the endpoint held for the
  pending handshake are handed over in packet-number order.
- Every SOURCE/REPAIR goes straight into the decoder (partial delivery). An ACK (cumulative decoded
  prefix, deficit inside the sender's possible window, counters for loss and burst estimates, the largest
  packet number and how long ago it arrived) leaves after every ``ack_every`` data datagrams, or
  ``ack_delay_s`` after the first unacknowledged one.
- At the deadline the session stops decoding and emits ``DeadlineReached`` with every decoded source
  symbol; it does so at once, before the deadline, when every source symbol is decoded and the OFFER is
  complete (start when ready: nothing more can arrive that the receiver could use; ``ready`` says which).
  The sender's DONE (the completion signal: it will send nothing more this session could use) starts it
  at once too (``sender_done``), once the OFFER is whole; not a split, whose front computes what the
  stream left missing (start when ready, or at the deadline). A DONE
  whose counts contradict what arrived (more sources than the handoff has, fewer than an ESI seen, more
  repairs received than it says were sent, a last data packet at or after its own) is dropped
  (``bad_done``); one after the session stopped decoding changes nothing. The deadline stays the last
  resort.
  A split handoff (the application computes the front of the context itself, ``set_split`` and
  ``set_computed``): ready once every symbol still needed is decoded, a symbol being needed while its
  token end (``stream.symbol_token_ends``, by the stream index inside it) lies past the tokens computed
  here. The ACK reports ``computed_tokens``, and one leaves at once when it moves.
  The application rebuilds and generates, then calls ``send_result``; the RESULT is repeated
  until the sender's CLOSE or ``result_retries`` run out (a vanished sender), then the session closes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import numpy.typing as npt

from pfec.common.codec.fec import Decoder, FecError
from pfec.common.codec.gf256 import njit_cached
from pfec.common.events import CpuMeter, DatagramDropped, Event, earliest
from pfec.common.plan.prefill import meeting_chunk_end
from pfec.common.wire.messages import (
    MAX_HOLE_BITS,
    Ack,
    Close,
    Done,
    Message,
    MsgType,
    Offer,
    Refuse,
    RefuseCode,
    Repair,
    Result,
    Source,
    clip_text,
    max_app_chunk,
)
from pfec.common.wire.seal import PacketProtector


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


class ReceiverState(Enum):
    RECEIVING = "receiving"
    DEADLINE = "deadline"
    RESULT_SENT = "result_sent"
    CLOSED = "closed"


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


class ReceiverSession:
    """The receiving end of one handoff: the decoder, ACKs, the deadline and the RESULT (see the module
    doc). Built by the endpoint when a handshake completes, with a protector holding the session keys;
    ``offer_at`` is when the first OFFER part arrived (the budget runs from then; ``now`` if None)."""

    def __init__(
        self,
        session_id: int,
        protector: PacketProtector,
        offer: Offer,
        offer_packet_number: int,
        now: float,
        config: ReceiverConfig,
        cpu: CpuMeter | None = None,
        offer_at: float | None = None,
    ) -> None:
        self.session_id = session_id
        self.protector = protector
        self.offer = offer
        self.config = config
        self.cpu = cpu
        self.state = ReceiverState.RECEIVING
        start = now if offer_at is None else offer_at
        self.deadline = start + min(offer.budget_us * 1e-6, config.max_budget_s)
        self.span = decoder_span(offer, config)
        self.decoder = Decoder(offer.n_source, offer.symbol_size, self.span)
        self._hole_buf = np.zeros((self.span + 7) // 8, dtype=np.uint8)
        # Fault the output buffer in now rather than one page per symbol on the receive path.
        self.decoder.store.fill(0)
        self.stats = ReceiverStats(deadline_at=self.deadline)
        self._outbox: deque[bytes] = deque()
        self._events: deque[ReceiverEvent] = deque()
        self._app_parts: dict[int, bytes] = {}
        self._app_part_count = offer.part_count
        self._offer_complete = False
        self._largest_pn = 0
        self._largest_pn_at = now
        self._count_packet(offer_packet_number, now)
        self._unacked = 0
        self._ack_timer: float | None = None
        self._result_datagrams: list[bytes] = []
        self._result_timer: float | None = None
        self._result_tries = 0
        self._stalled_since: float | None = None
        self.close_reason = ""
        # Split handoff: token end per stream index, which indices are decoded, the tokens computed here,
        # and how many needed indices are still missing (None: not a split, or not known yet).
        self._split_ends: npt.NDArray[np.int64] | None = None
        self._split_have: npt.NDArray[np.bool_] | None = None
        self._split_tokens = 0
        self._split_front = 0
        self.computed_tokens = 0
        self._missing_needed = -1
        self._sender_done = False  # a valid DONE arrived: start as soon as the OFFER (and front) allow
        self._on_offer_part(offer)

    # ----------------------------------------------------------------- public API
    def handle_message(self, packet_number: int, message: Message, now: float) -> None:
        """An authenticated, replay-checked message from the sender."""
        self._count_packet(packet_number, now)
        if isinstance(message, Source | Repair):
            self._on_data(message, now)
        elif isinstance(message, Offer):
            self.stats.received["control"] += 1
            self._on_offer_part(message)
            self._start_if_ready(now)
        elif isinstance(message, Close):
            self.stats.received["control"] += 1
            self._close(f"sender closed ({message.code.name}) {message.text}".strip())
        elif isinstance(message, Done):
            self.stats.received["control"] += 1
            self._on_done(message, packet_number, now)
        else:
            self._drop("unexpected_type")

    def send_result(self, app_blob: bytes, now: float) -> None:
        """Report the handoff's outcome to the sender (repeated until CLOSE)."""
        if self.state is ReceiverState.CLOSED:
            return
        chunk = max_app_chunk(MsgType.RESULT)
        parts = [app_blob[i : i + chunk] for i in range(0, len(app_blob), chunk)] or [b""]
        decoded = self.decoder.decoded_count
        self._result_datagrams = [
            self.protector.seal(Result(decoded, i, len(parts), part)) for i, part in enumerate(parts)
        ]
        self._outbox.extend(self._result_datagrams)
        self.state = ReceiverState.RESULT_SENT
        self._result_tries = 1
        self._result_timer = now + self.config.result_retry_s

    def set_split(self, token_end_of_index: npt.NDArray[np.int64] | None, n_tokens: int, front: int,
                  now: float) -> None:
        """This handoff is a split of a context of ``n_tokens``: the application computes its front
        [0, ``front``) (no symbol carries it; ``front`` = ``n_tokens``: a local prefill, nothing streams).
        ``token_end_of_index[i]`` is the token end of the symbol with stream index i (the plan the OFFER
        names, recomputed and checked by the application); None until it is known (computed tokens are
        reported meanwhile, and all of the context computed starts the session)."""
        if not 0 < n_tokens <= 0xFFFF_FFFF or not 0 <= front <= n_tokens:
            raise ValueError(f"split: a front of {front!r} tokens in a context of {n_tokens!r}")
        self._split_tokens = n_tokens
        self._split_front = front
        if token_end_of_index is None:
            return
        ends = np.asarray(token_end_of_index, dtype=np.int64)
        if ends.ndim != 1 or len(ends) != self.offer.n_source:
            raise ValueError(f"split: {ends.shape} token ends for {self.offer.n_source} source symbols")
        self._split_ends = ends
        self._split_have = np.zeros(len(ends), dtype=np.bool_)
        self._file_split(self.decoder.decoded_esis())
        self._count_missing()
        self._start_if_ready(now)

    def set_computed(self, tokens: int, now: float) -> None:
        """The application has computed context tokens [0, ``tokens``) itself: report it (an ACK now) and
        start when nothing still needed is missing (or the whole context is computed)."""
        if not 0 <= tokens <= self._split_tokens:
            raise ValueError(f"computed tokens {tokens!r} outside the context 0..{self._split_tokens}")
        if tokens <= self.computed_tokens or self.state is not ReceiverState.RECEIVING:
            return
        self.computed_tokens = tokens
        self._count_missing()
        self._send_ack(now)
        self._start_if_ready(now)

    def front_chunk_end(self, done: int, end: int, seconds_per_token: float, now: float) -> int:
        """Where the application's front chunk from ``done`` (computed) should end, at most ``end``: where
        this stream, at the rate it has delivered so far, meets it (``prefill.meeting_chunk_end``); ``end``
        while that is not known (not a split, its plan not known yet, nothing decoded, decoding closed)."""
        have, ends, first = self._split_have, self._split_ends, self.stats.first_data_at
        decoded = self.decoder.decoded_count
        if have is None or ends is None or first is None or now <= first or decoded == 0 or (
                self.state is not ReceiverState.RECEIVING or self._sender_done):  # DONE: no more stream
            return end
        missing = np.sort(ends[~have])
        return meeting_chunk_end(done, end, seconds_per_token, missing, decoded / (now - first))

    def _file_split(self, esis: npt.NDArray[np.int64]) -> None:
        """Newly decoded ESIs -> their stream indices (the first 4 bytes of the symbol), marked decoded."""
        have, ends = self._split_have, self._split_ends
        if have is None or ends is None or len(esis) == 0:
            return
        needed = _file_stream_indices(self.decoder.store, esis, have, ends, self.computed_tokens)
        if self._missing_needed > 0:
            self._missing_needed -= needed

    def _count_missing(self) -> None:
        have, ends = self._split_have, self._split_ends
        if have is not None and ends is not None:
            self._missing_needed = int(np.count_nonzero(~have & (ends > self.computed_tokens)))

    def refuse(self, code: RefuseCode, text: str) -> None:
        self._outbox.append(self.protector.seal(Refuse(code, clip_text(text))))
        self._close(f"refused: {text}")

    @property
    def has_output(self) -> bool:
        return bool(self._outbox)

    def datagrams_to_send(self) -> list[bytes]:
        out = list(self._outbox)
        self._outbox.clear()
        return out

    def next_event(self) -> ReceiverEvent | None:
        return self._events.popleft() if self._events else None

    def get_timer(self) -> float | None:
        if self.state is ReceiverState.CLOSED:
            return None
        return earliest(self.deadline_timer(), self._ack_timer, self._result_timer)

    def deadline_timer(self) -> float | None:
        """The deadline while it can still start the session (receiving); None after."""
        return self.deadline if self.state is ReceiverState.RECEIVING else None

    def handle_timer(self, now: float) -> None:
        if self.state is ReceiverState.RECEIVING and now >= self.deadline:
            self._reach_deadline(now)
        if self._ack_timer is not None and now >= self._ack_timer:
            self._send_ack(now)
        if self._result_timer is not None and now >= self._result_timer:
            if self._result_tries >= self.config.result_retries:
                self._result_timer = None
                self._close("no CLOSE from the sender after the RESULT (sender gone?)")
            else:
                self._outbox.extend(self._result_datagrams)
                self._result_tries += 1
                self._result_timer = now + self.config.result_retry_s

    @property
    def closed(self) -> bool:
        return self.state is ReceiverState.CLOSED

    # ------------------------------------------------------------------ receiving
    def _count_packet(self, pn: int, now: float) -> None:
        stats = self.stats
        if pn > self._largest_pn:
            gap = pn - self._largest_pn - 1
            if gap > 0:
                stats.lost += gap
                stats.loss_runs += 1
            self._largest_pn = pn
            self._largest_pn_at = now
        elif stats.lost > 0:
            stats.lost -= 1  # a reordered packet fills a gap counted as lost

    def _on_data(self, message: Source | Repair, now: float) -> None:
        stats = self.stats
        if self.state is not ReceiverState.RECEIVING:
            stats.late += 1
            return
        if stats.first_data_at is None:
            stats.first_data_at = now
        decoder = self.decoder
        cpu = self.cpu
        is_source = isinstance(message, Source)
        stats.received["source" if is_source else "repair"] += 1
        t0 = cpu.clock() if cpu is not None else 0
        try:
            if isinstance(message, Source):
                decoded = decoder.add_source(message.esi, message.symbol)
            else:
                decoded = decoder.add_repair_fields(
                    message.repair_key, message.dt, message.nss, message.fss_esi, message.symbol
                )
        except FecError as exc:
            self._drop(f"fec_{exc.reason}")
            return
        finally:
            if cpu is not None:
                cpu.decode_ns += cpu.clock() - t0
        if self._split_have is not None and decoded:
            self._file_split(decoder.newly_decoded)
        if is_source:
            if decoded == 0:
                stats.duplicates += 1
        else:
            stats.redundant_repairs = decoder.redundant
        self._track_stall(now)
        self._unacked += 1
        if self._unacked >= self.config.ack_every:
            self._send_ack(now)
        elif self._ack_timer is None:
            self._ack_timer = now + self.config.ack_delay_s
        self._start_if_ready(now)

    def _on_done(self, done: Done, packet_number: int, now: float) -> None:
        """The sender's completion signal, checked against what arrived before it is believed."""
        if self.state is not ReceiverState.RECEIVING:
            return  # decoding already closed: a repeat, or late
        decoder, stats = self.decoder, self.stats
        if (
            done.sources_sent > self.offer.n_source
            or done.sources_sent < decoder.seen_end
            or done.repairs_sent < stats.received["repair"]
            or done.last_data_pn >= packet_number
        ):
            self._drop("bad_done")
            return
        self._sender_done = True
        self._start_if_ready(now)

    def _start_if_ready(self, now: float) -> None:
        """Everything planned is decoded (or the sender says nothing more will come) and the OFFER is
        whole: no need to wait for the deadline."""
        if self.state is not ReceiverState.RECEIVING or not self._offer_complete:
            return
        decoded_all = self.decoder.decoded_count >= self.offer.n_source
        if self._split_tokens:  # a split: the front computed here, and what is still needed decoded
            computed = self.computed_tokens
            front_done = computed >= self._split_front
            if computed >= self._split_tokens or (front_done and (decoded_all or self._missing_needed == 0)):
                self._reach_deadline(now, ready=True)
            # A DONE does not start a split: its front goes on computing what the stream left missing
            # (a sender that gave up left the whole context to it), until ready or the deadline.
        elif decoded_all:
            self._reach_deadline(now, ready=True)
        elif self._sender_done:
            self._reach_deadline(now, sender_done=True)

    def _track_stall(self, now: float) -> None:
        # Stalled: undecoded symbols reach past the decoder span, where no repair can help them until
        # the cumulative prefix moves (the paper's cumulative decoding stall).
        blocked = self.decoder.seen_end - self.decoder.decoded_prefix > self.span
        if blocked and self._stalled_since is None:
            self._stalled_since = now
            self.stats.stalls += 1
        elif not blocked and self._stalled_since is not None:
            self.stats.stall_time_s += now - self._stalled_since
            self._stalled_since = None

    def _send_ack(self, now: float) -> None:
        cpu = self.cpu
        t0 = cpu.clock() if cpu is not None else 0
        stats = self.stats
        received = stats.received
        # Decoder state and the hole map over the decoder span from the prefix: what repairs can fix.
        prefix, seen_end, decoded, unknowns, deficit, hole_bits = self.decoder.ack_snapshot(
            self.span, self._hole_buf
        )
        ack = Ack(
            decoded_prefix=prefix,
            seen_end=seen_end,
            decoded_count=decoded,
            deficit=deficit,
            unknowns=unknowns,
            largest_pn=self._largest_pn,
            ack_delay_us=min(max(0, int((now - self._largest_pn_at) * 1e6)), 0xFFFFFFFF),
            received=received["source"] + received["repair"],
            lost=stats.lost,
            loss_runs=stats.loss_runs,
            hole_bits=hole_bits,
            holes=self._hole_buf[: (hole_bits + 7) >> 3].tobytes(),
            computed_tokens=self.computed_tokens,
        )
        if cpu is not None:  # sealing (framing + AEAD) is transport cost, as for data datagrams
            cpu.feedback_ns += cpu.clock() - t0
            cpu.acks += 1
        self._outbox.append(self.protector.seal(ack))
        stats.acks_sent += 1
        self._unacked = 0
        self._ack_timer = None

    def _on_offer_part(self, offer: Offer) -> None:
        if not same_handoff(offer, self.offer) or offer.part_index >= offer.part_count:
            self._drop("offer_mismatch")
            return
        if self._offer_complete or offer.part_index in self._app_parts:
            return
        self._app_parts[offer.part_index] = bytes(offer.app)
        if len(self._app_parts) == self._app_part_count:
            self._offer_complete = True
            blob = b"".join(self._app_parts[i] for i in range(self._app_part_count))
            self._events.append(OfferReceived(self.session_id, self.offer, blob))

    def _reach_deadline(self, now: float, ready: bool = False, sender_done: bool = False) -> None:
        self.state = ReceiverState.DEADLINE
        if self._stalled_since is not None:
            self.stats.stall_time_s += now - self._stalled_since
            self._stalled_since = None
        if self._unacked:
            self._send_ack(now)
        self._ack_timer = None
        dec = self.decoder
        self._events.append(
            DeadlineReached(self.session_id, dec.decoded_esis(), dec.store, dec.have, self.stats, ready, now,
                            sender_done)
        )

    def _close(self, reason: str) -> None:
        if self.state is ReceiverState.CLOSED:
            return
        self.state = ReceiverState.CLOSED
        self.close_reason = reason
        self._unacked = 0
        self._ack_timer = None
        self._result_timer = None
        self._events.append(SessionClosed(self.session_id, reason))

    def _drop(self, reason: str) -> None:
        self._events.append(DatagramDropped(reason))


@njit_cached
def _file_stream_indices(store: npt.NDArray[np.uint8], esis: npt.NDArray[np.int64],
                         have: npt.NDArray[np.bool_], ends: npt.NDArray[np.int64], computed: int) -> int:
    """Mark the stream index each decoded row of ``esis`` carries (its first 4 bytes, big-endian) in
    ``have``, once (an index outside it is ignored: an authenticated sender's bug); returns how many newly
    marked indices end past ``computed`` (no longer missing and needed). Compiled: it runs per datagram."""
    needed = 0
    for k in range(esis.shape[0]):
        row = esis[k]
        idx = (np.int64(store[row, 0]) << 24) | (np.int64(store[row, 1]) << 16) | (
            np.int64(store[row, 2]) << 8) | np.int64(store[row, 3])
        if idx < have.shape[0] and not have[idx]:
            have[idx] = True
            if ends[idx] > computed:
                needed += 1
    return needed


def warm_up() -> None:
    """Compile (or load from numba's cache) the split's filing kernel before any datagram needs it."""
    store = np.zeros((2, 8), dtype=np.uint8)
    _file_stream_indices(store, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.bool_),
                         np.ones(1, dtype=np.int64), 0)
