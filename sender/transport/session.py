"""Sender side of one handoff, sans-IO (aioquic style): bytes and ``now`` in; datagrams, timers, events out.

Theory of operation
-------------------
Callers see IDLE -> STREAMING -> DRAINING -> DONE, or FAILED from any state. The handshake, the stop and
the end, the phases behind those states and every transition are one table in :mod:`.states`, which the
session follows: it changes phase nowhere else. What it sends meanwhile:

- The link pacer calls ``next_datagram(now)`` whenever the link is free. Between bursts a decision epoch
  (``epochs``: :mod:`.send_path`) refreshes the ``SchedulerView`` from the session's sends and the newest
  ACK, recomputes the hard masks (source left, estimated deficit for repair, repair budget, slots before
  the deadline) and asks the policy for an action; the burst is then sent one datagram per call. The
  slots left are counted at the rate controller's forecast (``rate``: :mod:`.rate`'s ``FixedRate``, or
  :mod:`.path_rate`'s measured ``PathRate``, whose circuit breaker stops the stream with a DONE).
- A closed-loop repair policy's sources sent too late for feedback to save them are protected open loop
  (``common/sched/open_loop_tail.py``); an open-loop policy (a fixed-rate code) needs no deficit for a
  repair, and its repairs cover the newest window (:mod:`.send_path`).
- ACKs are checked against what was sent (:mod:`.path`: an implausible one is dropped and counted, and
  no codec error escapes a session method), move the encoder's window (cumulative decoded prefix) and
  feed the loss, burst, RTT and deficit estimates (:mod:`.repair_plan`: the reported deficit less the
  repairs in flight, plus the expected losses among the sources in flight).
- A split (``SplitInfo``): an ACK's ``computed_tokens`` moves the unsent symbols holding only computed
  blocks behind the others, never to be sent; once all the receiver lacks is computed, it is done
  (:mod:`.split`).
- Waiting on feedback that does not come, a closed-loop sender probes as QUIC does (:mod:`.probe`).

Parts
-----
The session holds the OFFER/ACCEPT/RESULT/CLOSE flow, its timers and events, and follows the table
(:mod:`.states`); it delegates the rest, each part sans-IO with a narrow interface:

- ``path`` (:mod:`.path`): ACK intake, plausibility check, path estimates (loss, burst, RTT, staleness);
- ``inflight`` (:mod:`.inflight`): what was sent and not yet ACKed; the newest ACKed one's RTT sample;
- ``send_path`` (:mod:`.send_path`): source and repair datagrams, the tail's window, and the
  repair planner (:mod:`.repair_plan`) fed from the ACKs' hole maps; ``epochs``: the decision epochs;
- ``split`` (:mod:`.split`): a split handoff's token ends, computed tokens and unsent reorder;
- ``probe`` (:mod:`.probe`): the probe timer's clock and backoff;
- ``completion`` (:mod:`.completion`): when the sender is done, and its DONE;
- ``rate`` (:mod:`.rate`): the rate controller (several sessions may share one): the session reads its
  slots and breaker; ``send_path``, ``inflight`` and ``path`` report sends, deliveries, losses, RTTs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import suppress
from operator import attrgetter

import numpy as np
import numpy.typing as npt

from pfec.common.codec.fec import Encoder, FecError
from pfec.common.events import CpuMeter, DatagramDropped, earliest
from pfec.common.plan.receiver_speed import stated_receiver, statement_of
from pfec.common.sched.actions import Action, SchedulerView
from pfec.common.sched.open_loop_tail import OpenLoopTail
from pfec.common.sched.policies import Policy
from pfec.common.wire.messages import (
    Accept,
    Ack,
    Close,
    CloseCode,
    DoneReason,
    Message,
    ParseError,
    Refuse,
    Result,
    clip_text,
)
from pfec.common.wire.seal import PacketProtector, drop_reason
from pfec.sender.transport.completion import Completion, ResultParts
from pfec.sender.transport.inflight import InFlight
from pfec.sender.transport.offer import OfferParts
from pfec.sender.transport.path import PathEstimates, ack_plausible
from pfec.sender.transport.probe import ProbeTimer
from pfec.sender.transport.rate import FixedRate, RateController
from pfec.sender.transport.send_path import Epochs, SendPath
from pfec.sender.transport.session_types import (
    MAX_SPAN,
    Accepted,
    Failed,
    PathBroken,
    Refused,
    ResultReceived,
    SenderConfig,
    SenderEvent,
    SenderState,
    SendingStopped,
    SourceInfo,
    SplitInfo,
    UtilityFeatures,
)
from pfec.sender.transport.split import SplitBookkeeping
from pfec.sender.transport.states import ARMED, INITIAL, TRANSITIONS, Event, Invalid, Move, Stay, Timer, acts

# The session's inputs and outputs live in session_types; callers import them from here too.
__all__ = ["MAX_SPAN", "Accepted", "Failed", "PathBroken", "Refused", "ResultReceived", "SenderConfig",
           "SenderEvent", "SenderSession", "SenderState", "SendingStopped", "SourceInfo", "SplitInfo"]

_TIMERS = tuple(Timer)  # in firing order; a tuple iterates faster than the enum
# The receiver's messages as the table's events (any other type is dropped).
_EVENT_OF_MESSAGE: dict[type, Event] = {Accept: Event.ACCEPT, Refuse: Event.REFUSE, Ack: Event.ACK,
                                        Result: Event.RESULT, Close: Event.CLOSE}


class SenderSession:
    """The sending end of one handoff: OFFER, paced source and repair datagrams, ACK processing, the
    RESULT and CLOSE (see the module doc), assembled in ``transfer.py``. ``rate``: the rate controller
    (:mod:`.rate`); None paces at ``config.slot_s``."""

    def __init__(self, session_id: int, config: SenderConfig, symbols: npt.NDArray[np.uint8], policy: Policy,
                 protector: PacketProtector, source_info: SourceInfo | None = None,
                 cpu: CpuMeter | None = None, split: SplitInfo | None = None,
                 rate: RateController | None = None) -> None:
        self.session_id = session_id
        self.config = config
        self.policy = policy
        self.protector = protector
        self.cpu = cpu
        self.rate: RateController = FixedRate(config.slot_s) if rate is None else rate
        self.split = SplitBookkeeping(split, symbols)
        symbols = self.split.symbols  # a split's copy of its own: its unsent rows get reordered
        # Unless the cap was configured, the encoder may build windows as wide as an RFC 8681 window: the
        # open-loop tail's repairs reach back over the whole tail, as far as the decoder span allows
        # (``SendPath.tail_width``); the repair planner bounds every other window by the cap.
        self.encoder = Encoder(
            symbols,
            window_cap=config.window_cap if config.window_cap_strict else MAX_SPAN,
            target_nonzeros=config.target_nonzeros,
            fixed_dt=config.fixed_dt,
        )
        self._phase = INITIAL  # moved only by _fire, as the table (states.py) says
        self.view = view = SchedulerView(n_source=self.encoder.n_source, repair_budget=config.repair_budget)
        view.repairs_left = config.repair_budget if policy.sends_repairs else 0
        # Open loop (a fixed-rate code): repairs need no deficit, and the planner never sees the ACKs' hole
        # maps, so every repair covers the newest window (see common/sched/policies.py).
        open_loop = view.open_loop = bool(getattr(policy, "open_loop", False))
        # A closed-loop repair policy's sources that feedback cannot save are protected open loop
        # (common/sched/open_loop_tail.py); before an RTT sample, the path's prior: twice the one-way delay.
        tail = OpenLoopTail(policy.sends_repairs and not open_loop, config.loss_prior, 2 * config.owd_s,
                            config.window_cap)
        self.inflight = InFlight(self.encoder.n_source, config.repair_budget, self.rate)
        self.path = PathEstimates(view, tail, self.rate)
        self.send_path = SendPath(config, symbols, self.encoder, protector, view, self.inflight, tail,
                                  open_loop, self.rate, cpu)
        self.planner = self.send_path.planner
        self.probe = ProbeTimer(config.max_ack_delay_s, 2 * config.owd_s)
        self.offer = OfferParts(config, self.encoder, protector)
        self.completion = Completion()  # the DONE: why, how many, the next repeat
        self.datagrams_sent = self.send_path.datagrams_sent  # source / repair / control datagrams sealed
        self._utility_features = None if source_info is None else UtilityFeatures(source_info)
        self.epochs = Epochs(config, self.send_path, policy, self.probe, self.path, self._utility_features,
                             self._fire)
        self._events: deque[SenderEvent] = deque()
        self._control: deque[bytes] = deque()  # OFFER / CLOSE datagrams, sent before data
        self._burst_action, self._burst_left = Action.SOURCE, 0
        self._start = self._send_deadline = self._deadline = self._handshake_deadline = 0.0
        self._result_timer: float | None = None
        self._result = ResultParts(config.max_result_parts)
        self.drops: dict[str, int] = {}

    # ----------------------------------------------------------------- public API
    @property
    def state(self) -> SenderState:
        """Where the session stands, as callers see it (its phase in :mod:`.states` refines it)."""
        return self._phase.public

    def start(self, now: float) -> None:
        self._fire(Event.START, now)

    def _begin(self, now: float, _arg: None) -> bool:
        cfg = self.config
        self._start = now
        self._deadline = now + cfg.budget_s
        # The last datagram must be serialised and propagated before the receiver's deadline.
        self._send_deadline = self._deadline - cfg.owd_s
        self.view.slots_total = self.epochs.slots_left(now, self._send_deadline)
        self.path.start(now)
        self._handshake_deadline = now + cfg.handshake_timeout_s
        return self._retry_offer(now, None)  # the OFFER, then the first flight

    def next_datagram(self, now: float) -> bytes | None:
        """The next datagram to put on the link now, or None when there is nothing to send yet."""
        if self._control:
            return self._control.popleft()
        phase = self._phase
        if not phase.sends:
            return None
        if phase.awaits_accept and self.encoder.next_esi + self.view.repairs_sent >= self.config.first_flight:
            return None  # the first flight is out: wait for the ACCEPT
        if self._burst_left == 0 and not self._decide(now):
            return None
        datagram = self._send_burst(now)
        if datagram is None:  # its window emptied under the burst (an ACK moved it): decide again
            self._burst_left = 0
            if self.send_path.probe_burst:
                self.probe.nothing_to_probe()
            if not self._decide(now):
                return None
            datagram = self._send_burst(now)
        return datagram

    def _send_burst(self, now: float) -> bytes | None:
        self._burst_left -= 1
        if self._burst_action is Action.SOURCE:
            datagram: bytes | None = self.send_path.source(now)
        else:
            datagram = self.send_path.repair(now)
        if datagram is not None:
            self.probe.on_sent(now, self.send_path.probe_burst)
            self.completion.last_data_pn = self.protector.packets_sealed
        return datagram

    def receive_datagram(self, data: bytes, now: float) -> None:
        """One datagram from the receiver: applied, or dropped and counted by reason (never raises for
        what a peer sends)."""
        try:
            _header, message = self.protector.open(data)
        except ParseError as exc:
            self._drop(drop_reason(exc))
            return
        try:
            self._handle(message, now)
        except (FecError, ValueError, IndexError, OverflowError):  # a safety net: validation should stop it
            self._drop("bad_feedback")

    def get_timer(self) -> float | None:
        return earliest(*[clock(self) for clock in _ARMED_CLOCKS[self._phase]])

    def handle_timer(self, now: float) -> None:
        """Fire each timer the phase arms that is due, in ``Timer`` order: one may move the phase (the send
        deadline stops the sending), which arms or disarms the next."""
        for timer in _TIMERS:
            if timer in ARMED[self._phase] and (due := CLOCKS[timer](self)) is not None and now >= due:
                self._fire(timer, now)

    def _fire(self, trigger: Event | Timer, now: float, arg: object = None) -> bool:
        """Apply the table's row for ``trigger`` in this phase, with its input ``arg``: the session changes
        phase only here. Whether the row acted (False: ignored, or its move did not go through)."""
        row = TRANSITIONS[self._phase][trigger]
        if isinstance(row, Move):
            if not getattr(self, row.action)(now, arg):
                return False
            self._phase = row.to
            return True
        if isinstance(row, Stay):
            return bool(getattr(self, row.action)(now, arg))
        if isinstance(row, Invalid):
            raise RuntimeError(f"{trigger.value} called in state {self.state.value}")
        return False

    def next_event(self) -> SenderEvent | None:
        return self._events.popleft() if self._events else None

    def cancel(self, reason: str, now: float) -> None:
        """Give up: queue a CLOSE for the receiver and report the failure."""
        self._fire(Event.CANCEL, now, reason)

    @property
    def accepted(self) -> bool:
        """Whether the receiver's ACCEPT arrived (the session keys are set)."""
        return self.protector.has_session_keys

    @property
    def deadline(self) -> float:
        return self._deadline

    @property
    def measured_loss(self) -> tuple[int, int]:
        """(lost, lost + received) datagrams by the newest ACK's counters: the path's measured loss."""
        return self.path.measured_loss

    @property
    def repairs_skipped(self) -> int:
        """Repairs a burst could not make (its window emptied under it)."""
        return self.send_path.repairs_skipped

    @property
    def computed_tokens(self) -> int:
        """A split handoff: the context tokens the receiver's newest ACK says it has computed itself."""
        return self.split.computed_tokens

    @property
    def sources_dropped(self) -> int:
        """A split handoff: unsent sources never sent, because the receiver computed their blocks."""
        return self.split.sources_dropped

    # ------------------------------------------------------------ decision epochs
    def _finish(self, now: float, reason: DoneReason) -> bool:
        """Nothing more the receiver could use: stop sending, and say why with a DONE."""
        self.completion.reason = reason
        self._stop_sending(now, None)
        self._queue_done(now)
        return True

    def _path_broken(self, now: float, reason: str) -> bool:
        self._events.append(PathBroken(reason))
        return self._finish(now, DoneReason.PATH_BROKEN)

    def _repeat_done(self, now: float, _arg: None) -> bool:
        self.completion.timer = None
        if now < self._deadline:  # past it the receiver has started anyway
            self._queue_done(now)
        return True

    def _probe(self, now: float, _arg: None) -> bool:
        self.probe.expire()
        return True

    def _probe_expiry(self) -> float | None:
        return self.probe.expiry(self.view, self.inflight, self.encoder.next_esi, self.encoder.ack_prefix,
                                 self.path.rtt_var, self._send_deadline)

    def _queue_done(self, now: float) -> None:
        datagram = self.completion.datagram(self.protector, self.encoder.next_esi, self.view.repairs_sent,
                                            now, self.view.rtt_estimate)
        if datagram is not None:
            self._send_control([datagram])

    def _decide(self, now: float) -> bool:
        """A decision epoch (``epochs``): the next burst, or False with nothing to send now."""
        burst = self.epochs.decide(now, self._start, self._send_deadline, not self._phase.awaits_accept)
        if burst is None:
            return False
        self._burst_action, self._burst_left = burst
        return True

    # ------------------------------------------------------------------- control
    def _send_control(self, datagrams: list[bytes]) -> None:
        self._control.extend(datagrams)  # sent before data
        self.datagrams_sent["control"] += len(datagrams)

    def _retry_offer(self, now: float, _arg: None) -> bool:
        self._send_control(self.offer.first(self._deadline, now, self.rate.slot_s))
        return True

    def _repeat_offer(self, now: float, _arg: None) -> bool:
        self._send_control(self.offer.repeats_due(self._deadline, now))
        return True

    def _stop_sending(self, now: float, _arg: None) -> bool:
        self._burst_left = 0
        self.offer.retry_at = None
        self._result_timer = self._deadline + self.config.result_wait_s
        self._events.append(SendingStopped(self.encoder.next_esi, self.view.repairs_sent))
        return True

    # ----------------------------------------------------------------- receiving
    def _handle(self, message: Message, now: float) -> None:
        event = _EVENT_OF_MESSAGE.get(type(message))
        if event is None:
            self._drop("unexpected_type")
            return
        self._fire(event, now, message)

    def _take_accept(self, now: float, accept: Accept) -> bool:
        """The receiver's ACCEPT (its R_r; the open verified our R_s): the session keys, then streaming."""
        if accept.n_source != self.encoder.n_source or accept.window_cap == 0:
            self._drop("accept_mismatch")
            return False
        self.protector.set_peer_random(accept.receiver_random)
        # The first OFFER's round trip: ahead of any queued data.
        self.rate.on_rtt_measurement(now, now - self._start, self._start)
        # The receiver establishes the session on our first datagram under the session key: send one now
        # (the OFFER's last, smallest part again) rather than wait for data, which may be over already.
        self._send_control([self.offer.on_accept(now, self._deadline)])
        self.send_path.on_accept(accept.window_cap)  # ACCEPT carries the receiver's decoder span
        try:  # and the receiver's stated prefill speed, checked before a planner may use it
            stated = stated_receiver(*statement_of(accept))
        except ValueError:
            self.drops["bad_prefill_speed"] = self.drops.get("bad_prefill_speed", 0) + 1
            stated = None
        self._events.append(Accepted(accept.window_cap, stated))
        return True

    def _check_accept(self, now: float, accept: Accept) -> bool:
        """Another ACCEPT once the keys are set (a restarted receiver's): dropped unless it is ours again."""
        if self.accepted and accept.receiver_random != self.protector.peer_random:
            self._drop("accept_mismatch")
        return True

    def _take_ack(self, now: float, ack: Ack) -> bool:
        enc = self.encoder
        if not ack_plausible(ack, enc.next_esi, self.protector.packets_sealed):
            self._drop("bad_ack")
            return False
        if ack.computed_tokens > self.split.n_tokens:  # past the context (or any value but 0 unsplit)
            self._drop("bad_ack_computed")
            return False
        if ack.computed_tokens:
            self.offer.proven()  # the receiver computes from the context the OFFER carries: it has it
            self._on_computed(ack.computed_tokens)
        self.probe.on_ack()
        cpu = self.cpu
        t0 = cpu.clock() if cpu is not None else 0
        prefix = ack.decoded_prefix
        prefix_moved = prefix > enc.ack_prefix
        enc.on_ack(prefix)
        # What the receiver has accounted for; the newest datagram it saw gives an RTT sample.
        sample_time = self.inflight.on_ack(now, ack.largest_pn, enc.next_esi, self.view.repairs_sent)
        # The planner first (the newest ACK: its hole map is current): it looks back by the RTT estimate
        # before this ACK's sample moves it.
        self.send_path.on_ack(ack, now, prefix == enc.ack_prefix)
        self.path.on_ack(ack, now, prefix_moved, sample_time)
        if cpu is not None:
            cpu.feedback_ns += cpu.clock() - t0
            cpu.acks += 1
        # A split's receiver may lack only what it computed itself: done (where the phase lets it finish).
        if acts(self._phase, Event.FINISHED) and self.split.needs_nothing(ack, enc.next_esi):
            self._fire(Event.FINISHED, now, DoneReason.DECODED)
        return True

    def _on_computed(self, computed: int) -> None:
        """The receiver has prefilled [0, ``computed``) itself: stop spending bytes on what it computed
        (``split`` reorders the unsent symbols; the per-ESI features follow and the view's source count
        ends before the computed ones, so the scheduler never sends them)."""
        first = self.encoder.next_esi
        order = self.split.on_computed(computed, first)
        if order is None:
            return
        if self._utility_features is not None:
            self._utility_features.reorder(first, order)
        view = self.view
        view.n_source = self.split.source_end
        if self._burst_action is Action.SOURCE:
            self._burst_left = min(self._burst_left, view.n_source - first)

    def _take_result(self, now: float, result: Result) -> bool:
        """A RESULT part: the move to DONE goes through with the part that completes the RESULT."""
        try:
            blob = self._result.add(result)
        except ValueError:
            self._drop("bad_result_part")
            return False
        if blob is None:
            return False
        self._queue_close(CloseCode.DONE, "")
        self._result_timer = self.offer.retry_at = self.completion.timer = None
        self.path.end(self.send_path.data_sent)
        self._events.append(ResultReceived(result.decoded_count, blob))
        return True

    def _refused(self, now: float, refuse: Refuse) -> bool:
        self._events.append(Refused(int(refuse.code), refuse.text))
        return self._fail(f"receiver refused the handoff ({refuse.code.name}): {refuse.text}")

    def _closed(self, now: float, close: Close) -> bool:
        return self._fail(f"receiver closed the session ({close.code.name}): {close.text}")

    def _cancelled(self, now: float, reason: str) -> bool:
        return self._fail(f"cancelled: {reason}", CloseCode.CANCELLED, reason)

    def _handshake_timeout(self, now: float, _arg: None) -> bool:
        waited = self._handshake_deadline - self._start
        return self._fail(f"no ACCEPT from the receiver within {waited:.3f} s", CloseCode.TIMEOUT)

    def _result_timeout(self, now: float, _arg: None) -> bool:
        return self._fail("no RESULT from the receiver by the deadline plus result_wait_s", CloseCode.TIMEOUT)

    def _queue_close(self, code: CloseCode, text: str) -> None:
        with suppress(ValueError):  # the packet-number space is spent: the receiver reaps the session itself
            self._send_control([self.protector.seal(Close(code, clip_text(text)))])

    def _fail(self, reason: str, close: CloseCode | None = None, close_text: str = "") -> bool:
        """Failing with ``reason`` (the table moves to FAILED); with ``close`` a CLOSE goes to the receiver
        first (so its session ends)."""
        if close is not None:
            self._queue_close(close, close_text or reason)
        self._burst_left = 0
        self.offer.retry_at = self._result_timer = self.completion.timer = None
        self.path.end(self.send_path.data_sent)
        self._events.append(Failed(reason))
        return True

    def _drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1
        self._events.append(DatagramDropped(reason))


# When each timer is due (None: not set), read from a session; the table says in which phases it counts.
# Getters, not per-session lambdas: ``get_timer`` runs once per datagram the pacer sends.
CLOCKS: dict[Timer, Callable[[SenderSession], float | None]] = {
    Timer.OFFER_REPEAT: attrgetter("offer.repeat_at"),
    Timer.OFFER_RETRY: attrgetter("offer.retry_at"),
    Timer.HANDSHAKE: attrgetter("_handshake_deadline"),
    Timer.SEND_DEADLINE: attrgetter("_send_deadline"),
    Timer.PROBE: SenderSession._probe_expiry,
    Timer.DONE_REPEAT: attrgetter("completion.timer"),
    Timer.RESULT_WAIT: attrgetter("_result_timer"),
}
_ARMED_CLOCKS = {phase: tuple(CLOCKS[timer] for timer in timers) for phase, timers in ARMED.items()}
