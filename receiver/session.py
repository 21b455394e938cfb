"""Receiver side of one handoff, sans-IO: ``ReceiverSession`` (its config, stats and events are in
:mod:`pfec.receiver.session_types`, its states and their table in :mod:`pfec.receiver.session_states`;
both re-exported here).

:mod:`pfec.receiver.endpoint` keys the sessions of one receiver, answers OFFERs with an ACCEPT (a
pending handshake), establishes a session once the sender proves it saw the ACCEPT (a datagram that opens
under the session key) and feeds it the datagrams it has parsed and opened.

Theory of operation
-------------------
States: decoding (OFFER_PARTIAL, RECEIVING, and the two where the sender's DONE came) -> DEADLINE (decoding
closed) -> RESULT_SENT -> CLOSED; every transition is an entry of ``session_states.TRANSITIONS``.

- A session exists once the handshake is complete (see :mod:`pfec.common.wire.seal`); its deadline is
  ``first OFFER arrival + budget`` in the receiver's own clock (the OFFER carries a time budget, never a
  timestamp, at most ``max_budget_s``). The OFFER parts and early data that the endpoint held for the
  pending handshake are handed over in packet-number order.
- Every SOURCE/REPAIR goes straight into the decoder (partial delivery). An ACK (cumulative decoded
  prefix, deficit inside the sender's possible window, counters for loss and burst estimates, the largest
  packet number and how long ago it arrived) leaves after every ``ack_every`` data datagrams, or
  ``ack_delay_s`` after the first unacknowledged one.
- At the deadline the session stops decoding and emits ``DeadlineReached`` with every decoded source
  symbol. It does so before the deadline once the OFFER is whole and every source symbol is decoded
  (``ready``), or the sender's DONE says nothing more will come (``sender_done``); a DONE that contradicts
  what arrived is dropped (``bad_done``, see ``_done_checks_out``).
- A split handoff (``set_split``, ``set_computed``; :mod:`pfec.receiver.split`) computes its front here:
  a DONE does not start it; it is ready once every symbol it still needs is decoded. Its ACKs report
  ``computed_tokens``, and one leaves at once when they move.
- The application rebuilds and generates, then calls ``send_result``; the RESULT is repeated until the
  sender's CLOSE or ``result_retries`` run out (a vanished sender), then the session closes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import ClassVar, cast

import numpy as np
import numpy.typing as npt

from pfec.common.codec.fec import Decoder, FecError
from pfec.common.events import CpuMeter, DatagramDropped, earliest
from pfec.common.wire.messages import (
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
from pfec.receiver.session_states import (
    ARMABLE,
    DECODING,
    STREAM_OPEN,
    TRANSITIONS,
    Action,
    Input,
    ReceiverState,
    Timer,
)
from pfec.receiver.session_types import (
    DeadlineReached,
    OfferReceived,
    ReceiverConfig,
    ReceiverEvent,
    ReceiverStats,
    SessionClosed,
    decoder_span,
    same_handoff,
)
from pfec.receiver.split import SplitProgress, warm_up
from pfec.receiver.split import _file_stream_indices as _file_stream_indices  # (tests reach it here)

__all__ = [
    "DeadlineReached", "OfferReceived", "ReceiverConfig", "ReceiverEvent", "ReceiverSession", "ReceiverState",
    "ReceiverStats", "SessionClosed", "decoder_span", "same_handoff", "warm_up",
]

_NO_TIME = math.nan  # what ``refuse`` hands its actions, which read no clock
_Run = Callable[["ReceiverSession", float, object], None]  # an action: (session, now, the input's payload)


class ReceiverSession:
    """The receiving end of one handoff: the decoder, ACKs, the deadline and the RESULT (see the module
    doc). Built by the endpoint when a handshake completes, with a protector holding the session keys;
    ``offer_at`` is when the first OFFER part arrived (the budget runs from then; ``now`` if None)."""

    _ACTIONS: ClassVar[dict[Action, _Run]]
    # TRANSITIONS by state, each entry with its action (None: nothing): one lookup per input on the hot path.
    _ROWS: ClassVar[dict[ReceiverState, dict[Input, tuple[ReceiverState, _Run | None]]]]

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
        self.state = ReceiverState.OFFER_PARTIAL
        self._rows = self._ROWS[self.state]  # the current state's entries (``_fire`` keeps them in step)
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
        self._largest_pn = 0
        self._largest_pn_at = now
        # In a fan-out group the data comes in the stream's own packet numbers: only they count for loss,
        # from the first one this member opens (``follow_group``).
        self._group: bool | None = None  # None: unicast; False: joined, no group datagram yet; True: counting
        self._count_packet(offer_packet_number, now)
        self._unacked = 0
        self._timers: dict[Timer, float] = {Timer.DEADLINE: self.deadline}  # the armed ones: when each fires
        self._result_datagrams: list[bytes] = []
        self._result_tries = 0
        self._stalled_since: float | None = None
        self.close_reason = ""
        self._split = SplitProgress()
        self._on_offer(offer, now)

    # ----------------------------------------------------------------- public API
    def follow_group(self) -> None:
        """The session joined a fan-out group: its loss is counted in the group stream's packet numbers,
        from the first group datagram it opens. What the stream sent before the member joined is not the
        channel's loss (counted as such, a member that joined 40 ms late at 100 Mbit/s reported 97% loss and
        was dropped); its own unicast datagrams (a packet number space of their own) count for nothing."""
        self._group = False

    def handle_message(self, packet_number: int, message: Message, now: float, group: bool = False) -> None:
        """An authenticated, replay-checked message from the sender (``group``: it came on the fan-out
        stream, under the group key)."""
        if self._group is None:
            self._count_packet(packet_number, now)
        elif group:
            if not self._group:
                self._group = True
                self._largest_pn = packet_number - 1  # the stream starts here for this member
            self._count_packet(packet_number, now)
        if isinstance(message, Source | Repair):
            self._fire(Input.DATA, now, message)
            return
        if not isinstance(message, Offer | Close | Done):
            self._fire(Input.UNEXPECTED, now, "unexpected_type")
            return
        self.stats.received["control"] += 1
        if isinstance(message, Offer):
            self._on_offer(message, now)
        elif isinstance(message, Close):
            self._fire(Input.CLOSE, now, message)
        elif self._done_checks_out(message, packet_number):
            self._fire(Input.DONE, now)
        else:
            self._fire(Input.BAD_DONE, now, "bad_done")

    def send_result(self, app_blob: bytes, now: float) -> None:
        """Report the handoff's outcome to the sender (repeated until CLOSE)."""
        self._fire(Input.RESULT, now, app_blob)

    def set_split(self, token_end_of_index: npt.NDArray[np.int64] | None, n_tokens: int, front: int,
                  now: float) -> None:
        """This handoff is a split of a context of ``n_tokens``: the application computes its front
        [0, ``front``) (no symbol carries it; ``front`` = ``n_tokens``: a local prefill, nothing streams).
        ``token_end_of_index[i]`` is the token end of the symbol with stream index i (the plan the OFFER
        names, recomputed and checked by the application); None until it is known (computed tokens are
        reported meanwhile, and all of the context computed starts the session)."""
        split = self._split
        if split.plan(token_end_of_index, n_tokens, front, self.offer.n_source):
            split.file(self.decoder.store, self.decoder.decoded_esis())
            split.count_missing()
            self._fire(Input.PLAN, now)

    def set_computed(self, tokens: int, now: float) -> None:
        """The application has computed context tokens [0, ``tokens``) itself: report it (an ACK now) and
        start when nothing still needed is missing (or the whole context is computed)."""
        self._split.check_computed(tokens)
        if tokens > self._split.computed:
            self._fire(Input.COMPUTED, now, tokens)

    def front_chunk_end(self, done: int, end: int, seconds_per_token: float, now: float) -> int:
        """Where the application's front chunk from ``done`` (computed) should end, at most ``end``: where
        this stream, at the rate it has delivered so far, meets it (``prefill.meeting_chunk_end``); ``end``
        while that is not known (not a split, its plan not known yet, nothing decoded, no more stream)."""
        if self.state not in STREAM_OPEN:  # decoding closed, or the sender's DONE
            return end
        return self._split.chunk_end(done, end, seconds_per_token, self.decoder.decoded_count,
                                     self.stats.first_data_at, now)

    def refuse(self, code: RefuseCode, text: str) -> None:
        self._fire(Input.REFUSE, _NO_TIME, (code, text))

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
        return earliest(*self._timers.values())

    def deadline_timer(self) -> float | None:
        """The deadline while it can still start the session (decoding); None after."""
        return self._timers.get(Timer.DEADLINE)

    def timer(self, which: Timer) -> float | None:
        """When ``which`` fires (None: not armed)."""
        return self._timers.get(which)

    def handle_timer(self, now: float) -> None:
        """Each due timer fires its input through the table, in ``Timer`` order."""
        for timer in Timer:
            due = self._timers.get(timer)  # read afresh: an earlier timer's action may disarm it
            if due is not None and now >= due:
                self._fire(self._timer_input(timer), now)

    @property
    def computed_tokens(self) -> int:
        """Context tokens [0, this) the application computed itself (a split; the ACK reports it)."""
        return self._split.computed

    @property
    def decoding(self) -> bool:
        """Whether decoding is still open (the session has not started: no deadline, ready or DONE yet)."""
        return self.state in DECODING

    @property
    def closed(self) -> bool:
        return self.state is ReceiverState.CLOSED

    # ------------------------------------------------------------------ the table
    def _fire(self, inp: Input, now: float, arg: object = None) -> None:
        """The one place the state changes: ``inp``'s entry for this state, then its action."""
        next_state, run = self._rows[inp]
        if next_state is not self.state:
            self.state = next_state
            self._rows = self._ROWS[next_state]
            armable = ARMABLE[next_state]
            for timer in [t for t in self._timers if t not in armable]:
                del self._timers[timer]
        if run is not None:
            run(self, now, arg)

    def _timer_input(self, timer: Timer) -> Input:
        if timer is Timer.DEADLINE:
            return Input.DEADLINE
        if timer is Timer.ACK:
            return Input.ACK_TIMER
        spent = self._result_tries >= self.config.result_retries
        return Input.RESULT_GIVE_UP if spent else Input.RESULT_RETRY

    def _early_input(self) -> Input:
        """The deadline's early arm: could the session start now (see ``Input.READY``)?"""
        decoded_all = self.decoder.decoded_count >= self.offer.n_source
        if not self._split.n_tokens:
            return Input.READY if decoded_all else Input.MISSING
        return Input.READY if self._split.ready(decoded_all) else Input.SPLIT_MISSING

    def _on_offer(self, offer: Offer, now: float) -> None:
        if not same_handoff(offer, self.offer) or offer.part_index >= offer.part_count:
            self._fire(Input.OFFER_MISMATCH, now, "offer_mismatch")
        elif offer.part_index in self._app_parts:
            self._fire(Input.OFFER_REPEAT, now)
        elif len(self._app_parts) + 1 == offer.part_count:
            self._fire(Input.OFFER_WHOLE, now, offer)
        else:
            self._fire(Input.OFFER_PART, now, offer)

    def _done_checks_out(self, done: Done, packet_number: int) -> bool:
        """Whether the sender's DONE agrees with what arrived (else it is dropped as ``bad_done``)."""
        return not (
            done.sources_sent > self.offer.n_source
            or done.sources_sent < self.decoder.seen_end
            or done.repairs_sent < self.stats.received["repair"]
            or done.last_data_pn >= packet_number
        )

    # ------------------------------------------------------------------ actions (see ``Action``)
    def _check_early(self, now: float, arg: object = None) -> None:
        self._fire(self._early_input(), now)

    def _decode(self, now: float, arg: object) -> None:
        message: Source | Repair = arg  # type: ignore[assignment]  # the DATA input's payload; no cast() per datagram
        stats = self.stats
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
        if decoded and self._split.have is not None:
            self._split.file(decoder.store, decoder.newly_decoded)
        if is_source:
            if decoded == 0:
                stats.duplicates += 1
        else:
            stats.redundant_repairs = decoder.redundant
        self._track_stall(now)
        self._unacked += 1
        if self._unacked >= self.config.ack_every:
            self._send_ack(now)
        elif Timer.ACK not in self._timers:
            self._timers[Timer.ACK] = now + self.config.ack_delay_s
        self._fire(self._early_input(), now)  # the early arm (``_check_early``, one call less per datagram)

    def _count_late(self, now: float, arg: object) -> None:
        self.stats.late += 1

    def _hold_offer_part(self, now: float, arg: object) -> None:
        offer = cast(Offer, arg)
        self._app_parts[offer.part_index] = bytes(offer.app)

    def _announce_offer(self, now: float, arg: object) -> None:
        self._hold_offer_part(now, arg)
        blob = b"".join(self._app_parts[i] for i in range(self.offer.part_count))
        self._events.append(OfferReceived(self.session_id, self.offer, blob))
        self._check_early(now)

    def _drop_input(self, now: float, arg: object) -> None:
        self._drop(cast(str, arg))

    def _record_computed(self, now: float, arg: object) -> None:
        self._split.computed = cast(int, arg)
        self._split.count_missing()
        self._send_ack(now)
        self._check_early(now)

    def _send_result(self, now: float, arg: object) -> None:
        app_blob = cast(bytes, arg)
        chunk = max_app_chunk(MsgType.RESULT)
        parts = [app_blob[i : i + chunk] for i in range(0, len(app_blob), chunk)] or [b""]
        decoded = self.decoder.decoded_count
        self._result_datagrams = [
            self.protector.seal(Result(decoded, i, len(parts), part)) for i, part in enumerate(parts)
        ]
        self._outbox.extend(self._result_datagrams)
        self._result_tries = 1
        self._timers[Timer.RESULT] = now + self.config.result_retry_s

    def _resend_result(self, now: float, arg: object) -> None:
        self._outbox.extend(self._result_datagrams)
        self._result_tries += 1
        self._timers[Timer.RESULT] = now + self.config.result_retry_s

    def _close_by_sender(self, now: float, arg: object) -> None:
        message = cast(Close, arg)
        self._close(f"sender closed ({message.code.name}) {message.text}".strip())

    def _refuse(self, now: float, arg: object) -> None:
        self._send_refuse(now, arg)
        self._close(f"refused: {cast(tuple[RefuseCode, str], arg)[1]}")

    def _send_refuse(self, now: float, arg: object) -> None:
        code, text = cast(tuple[RefuseCode, str], arg)
        self._outbox.append(self.protector.seal(Refuse(code, clip_text(text))))

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
            # ...and a run it ended is one run fewer at most: loss runs never exceed the losses (the
            # sender refuses such an ACK as implausible).
            stats.loss_runs = min(stats.loss_runs, stats.lost)

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
        self._timers.pop(Timer.ACK, None)

    def _start(self, now: float, ready: bool = False, sender_done: bool = False) -> None:
        """Decoding closed (the table has moved the session to DEADLINE): every decoded symbol goes out."""
        if self._stalled_since is not None:
            self.stats.stall_time_s += now - self._stalled_since
            self._stalled_since = None
        if self._unacked:
            self._send_ack(now)
        dec = self.decoder
        self._events.append(
            DeadlineReached(self.session_id, dec.decoded_esis(), dec.store, dec.have, self.stats, ready, now,
                            sender_done)
        )

    def _close(self, reason: str) -> None:
        """The table has moved the session to CLOSED (which disarms its timers)."""
        self.close_reason = reason
        self._unacked = 0
        self._events.append(SessionClosed(self.session_id, reason))

    def _drop(self, reason: str) -> None:
        self._events.append(DatagramDropped(reason))


# Every action but NOTHING (nothing runs) and IMPOSSIBLE (``_run_of`` makes a refusal per input).
ReceiverSession._ACTIONS = {
    Action.DECODE: ReceiverSession._decode,
    Action.COUNT_LATE: ReceiverSession._count_late,
    Action.HOLD_OFFER_PART: ReceiverSession._hold_offer_part,
    Action.ANNOUNCE_OFFER: ReceiverSession._announce_offer,
    Action.DROP: ReceiverSession._drop_input,
    Action.CHECK_EARLY: ReceiverSession._check_early,
    Action.RECORD_COMPUTED: ReceiverSession._record_computed,
    Action.START_AT_DEADLINE: lambda session, now, arg: session._start(now),
    Action.START_READY: lambda session, now, arg: session._start(now, ready=True),
    Action.START_SENDER_DONE: lambda session, now, arg: session._start(now, sender_done=True),
    Action.SEND_ACK: lambda session, now, arg: session._send_ack(now),
    Action.SEND_RESULT: ReceiverSession._send_result,
    Action.RESEND_RESULT: ReceiverSession._resend_result,
    Action.CLOSE: ReceiverSession._close_by_sender,
    Action.GIVE_UP: lambda session, now, arg: session._close(
        "no CLOSE from the sender after the RESULT (sender gone?)"),
    Action.REFUSE: ReceiverSession._refuse,
    Action.SEND_REFUSE: ReceiverSession._send_refuse,
}


def _run_of(inp: Input, action: Action) -> _Run | None:
    """What ``_fire`` runs: nothing for NOTHING; for IMPOSSIBLE a refusal naming the input (its rows stay)."""
    if action is not Action.IMPOSSIBLE:
        return None if action is Action.NOTHING else ReceiverSession._ACTIONS[action]

    def impossible(session: ReceiverSession, now: float, arg: object) -> None:
        raise RuntimeError(f"session {session.session_id:016x}: no {inp.name} in state {session.state.name}")
    return impossible


ReceiverSession._ROWS = {
    state: {inp: (rows[state].next_state, _run_of(inp, rows[state].action))
            for inp, rows in TRANSITIONS.items()}
    for state in ReceiverState
}
