"""Sender side of one handoff, sans-IO (aioquic style): bytes and ``now`` in; datagrams, timers, events out.

Theory of operation
-------------------
States: IDLE -> STREAMING -> DRAINING -> DONE, or FAILED from any state.

- ``start(now)`` queues the OFFER (the receiver's time budget, never a timestamp; the sender's fresh R_s)
  and moves to STREAMING at once: a first flight of at most ``first_flight`` data datagrams (about one
  bandwidth-delay product) follows the OFFER under the sender's early key without waiting a round trip,
  because the deadline counts from the first transmission. Then the session waits for the receiver's
  ACCEPT (its R_r, and the R_s it authenticates), repeating the OFFER every ``offer_retry_s``; the ACCEPT
  gives the session keys (:mod:`pfec.common.wire.seal`) and streaming goes on under them. Without an
  ACCEPT by ``start + handshake_timeout_s`` the session fails and queues a CLOSE. Right after the
  ACCEPT the session sends the OFFER's last part again under the session key: the receiver establishes
  the session on it even when no data is left to send.
- The link pacer calls ``next_datagram(now)`` whenever the link is free. Between bursts the session
  refreshes its ``SchedulerView`` from its own sends and the newest ACK, recomputes the hard masks (source
  left, estimated deficit for repair, repair budget, slots before the deadline) and asks the policy for
  an action; the burst is then sent one datagram per call. The slots left are counted at the rate
  controller's forecast (``rate``: :mod:`.rate`'s ``FixedRate``, or :mod:`.path_rate`'s measured
  ``PathRate``, whose circuit breaker stops the stream with a DONE). An open-loop policy (a fixed-rate
  code) needs no deficit for a repair and its repairs cover the newest window (``send_path``).
- A closed-loop repair policy's sources sent with under 1.5 RTT left (the path's RTT prior before a
  sample) cannot be repaired from feedback: the session protects them open loop at the expected-loss rate
  (the loss prior until ACKs measure it) before asking the policy (``common/sched/open_loop_tail.py``),
  each repair over all of the tail's sources the decoder span reaches. When the first ACK (two round trips
  after the start) leaves no room for a closed-loop cycle, the whole handoff is that tail.
- ACKs move the encoder's window (cumulative decoded prefix) and feed the loss, burst, RTT and deficit
  estimates. A deficit estimate is the receiver's reported window deficit, minus the repairs still in
  flight that the receiver had not seen when it wrote the ACK (each counts as arriving while a lost one
  could still be replaced, with probability 1 - loss within ``RESEND_RTTS`` of the deadline), plus the
  expected losses among in-flight sources that fall inside the window.
- ACK fields are checked against what was sent (decoded prefix, seen end and decoded count within the
  sources sent, largest packet number within those sealed, counters within the datagrams sealed); an
  implausible ACK is dropped and counted (``bad_ack``), and no codec error escapes a session method.
- A split (``SplitInfo``: the receiver prefills the front while this session streams the back): an ACK's
  ``computed_tokens`` (past the context: dropped, ``bad_ack_computed``) moves the unsent symbols holding
  only computed blocks behind the others, never to be sent (``split``); once every source is out and all
  the receiver lacks holds only computed blocks, the session is done (DONE), repairing nothing more.
- Waiting on feedback that does not come (its last repairs lost, or the ACK that answered them), a
  closed-loop sender probes as QUIC does (RFC 9002 6.2, :mod:`.probe`): repairs where the receiver lacks
  most, whatever the deficit estimate says; the ACK they elicit says what is still missing.
- Once it will send nothing more the receiver could use (every source out, and all decoded, its repair
  cap spent, or no closed-loop repair in its scheme) it stops (DRAINING) and sends a DONE (the completion
  signal, :mod:`.completion`), on which the receiver starts generating rather than at its deadline.
- With no slot left before the deadline it stops sending data (DRAINING) and waits for the RESULT,
  answered with CLOSE (DONE); none by ``deadline + result_wait_s``: it fails with a reason. Giving up
  (no ACCEPT, no RESULT, ``cancel``) it queues a CLOSE for the receiver first.

Parts
-----
The session holds the states, the OFFER/ACCEPT/RESULT/CLOSE flow, timers, events and decision epochs, and
delegates the rest, each part sans-IO with a narrow interface:

- ``path`` (:mod:`.path`): ACK intake, plausibility check, path estimates (loss, burst, RTT, staleness);
- ``inflight`` (:mod:`.inflight`): what was sent and not yet ACKed; the newest ACKed one's RTT sample;
- ``send_path`` (:mod:`.send_path`): source and repair datagrams, the tail's window, and the
  repair planner (:mod:`.repair_plan`) fed from the ACKs' hole maps;
- ``split`` (:mod:`.split`): a split handoff's token ends, computed tokens and unsent reorder;
- ``probe`` (:mod:`.probe`): the probe timer's clock and backoff;
- ``completion`` (:mod:`.completion`): when the sender is done, and its DONE;
- ``rate`` (:mod:`.rate`): the rate controller (several sessions may share one): the session reads its
  slots and breaker; ``send_path``, ``inflight`` and ``path`` report sends, deliveries, losses, RTTs.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import numpy.typing as npt

from pfec.common.codec.fec import Encoder, FecError
from pfec.common.events import CpuMeter, DatagramDropped, earliest
from pfec.common.plan.receiver_speed import stated_receiver
from pfec.common.sched.actions import REPAIR_SIZES, SOURCE_BURST, Action, SchedulerView
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
from pfec.sender.transport.completion import Completion, ResultParts, done_reason
from pfec.sender.transport.inflight import InFlight
from pfec.sender.transport.offer import OfferParts
from pfec.sender.transport.path import PathEstimates, ack_plausible
from pfec.sender.transport.probe import ProbeTimer
from pfec.sender.transport.rate import FixedRate, RateController
from pfec.sender.transport.send_path import SendPath
from pfec.sender.transport.session_types import (
    EARLY_OFFER_EVERY,
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

# The session's inputs and outputs live in session_types; callers import them from here too.
__all__ = ["MAX_SPAN", "Accepted", "Failed", "PathBroken", "Refused", "ResultReceived", "SenderConfig",
           "SenderEvent", "SenderSession", "SenderState", "SendingStopped", "SourceInfo", "SplitInfo"]


class SenderSession:
    """The sending end of one handoff: OFFER, paced source and repair datagrams, ACK processing, the
    RESULT and CLOSE (see the module doc), assembled in ``transfer.py``. ``rate``: the rate controller
    (:mod:`.rate`); None paces at ``config.slot_s``."""

    def __init__(
        self,
        session_id: int,
        config: SenderConfig,
        symbols: npt.NDArray[np.uint8],
        policy: Policy,
        protector: PacketProtector,
        source_info: SourceInfo | None = None,
        cpu: CpuMeter | None = None,
        split: SplitInfo | None = None,
        rate: RateController | None = None,
    ) -> None:
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
        self.state = SenderState.IDLE
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
        self._events: deque[SenderEvent] = deque()
        self._control: deque[bytes] = deque()  # OFFER / CLOSE datagrams, sent before data
        self._burst_action, self._burst_left = Action.SOURCE, 0
        self._start = self._send_deadline = self._deadline = 0.0
        self._accepted = False  # the receiver's ACCEPT arrived: the session keys are set
        self._handshake_deadline = 0.0
        self._offer_timer: float | None = None
        self._result_timer: float | None = None
        self._result = ResultParts(config.max_result_parts)
        self.drops: dict[str, int] = {}

    # ----------------------------------------------------------------- public API
    def start(self, now: float) -> None:
        if self.state is not SenderState.IDLE:
            raise RuntimeError(f"start() called in state {self.state.value}")
        cfg = self.config
        self._start = now
        self._deadline = now + cfg.budget_s
        # The last datagram must be serialised and propagated before the receiver's deadline.
        self._send_deadline = self._deadline - cfg.owd_s
        self.view.slots_total = self._slots_left(now)
        self.path.start(now)
        self._handshake_deadline = now + cfg.handshake_timeout_s
        self.state = SenderState.STREAMING
        self._queue_offer(now)

    def next_datagram(self, now: float) -> bytes | None:
        """The next datagram to put on the link now, or None when there is nothing to send yet."""
        if self._control:
            return self._control.popleft()
        if self.state is not SenderState.STREAMING:
            return None
        if not self._accepted and self.encoder.next_esi + self.view.repairs_sent >= self.config.first_flight:
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
        send_deadline = self._send_deadline if self.state is SenderState.STREAMING else None
        handshake = (
            self._handshake_deadline
            if not self._accepted and self.state in (SenderState.STREAMING, SenderState.DRAINING)
            else None
        )
        repeat = self.offer.repeat_at if self.state in (SenderState.STREAMING, SenderState.DRAINING) else None
        return earliest(send_deadline, self._offer_timer, self._result_timer, handshake, self._probe_at(),
                        self.completion.timer, repeat)

    def handle_timer(self, now: float) -> None:
        live = self.state in (SenderState.STREAMING, SenderState.DRAINING)  # needed till the receiver starts
        if live and (repeats := self.offer.repeats_due(self._deadline, now)):
            self._control.extend(repeats)
            self.datagrams_sent["control"] += len(repeats)
        if self._offer_timer is not None and now >= self._offer_timer:
            if self.state is SenderState.STREAMING and not self._accepted:
                self._queue_offer(now)
            else:
                self._offer_timer = None
        if (
            not self._accepted
            and self.state in (SenderState.STREAMING, SenderState.DRAINING)
            and now >= self._handshake_deadline
        ):
            waited = self._handshake_deadline - self._start
            self._fail(f"no ACCEPT from the receiver within {waited:.3f} s", CloseCode.TIMEOUT)
            return
        if self.state is SenderState.STREAMING and now >= self._send_deadline:
            self._stop_sending(now)
        probe_at = self._probe_at()
        if probe_at is not None and now >= probe_at:
            self.probe.expire()
        done_at = self.completion.timer
        if done_at is not None and now >= done_at:
            self.completion.timer = None
            if self.state is SenderState.DRAINING and now < self._deadline:
                self._queue_done(now)
        if self._result_timer is not None and now >= self._result_timer:
            self._result_timer = None
            if self.state is SenderState.DRAINING:
                self._fail("no RESULT from the receiver by the deadline plus result_wait_s",
                           CloseCode.TIMEOUT)

    def next_event(self) -> SenderEvent | None:
        return self._events.popleft() if self._events else None

    def cancel(self, reason: str, now: float) -> None:
        """Give up: queue a CLOSE for the receiver and report the failure."""
        if self.state in (SenderState.DONE, SenderState.FAILED):
            return
        self._fail(f"cancelled: {reason}", CloseCode.CANCELLED, reason)

    @property
    def accepted(self) -> bool:
        """Whether the receiver's ACCEPT arrived (the session keys are set)."""
        return self._accepted

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
    def _probe_at(self) -> float | None:
        """When the probe timer expires (None: not armed; it runs only while streaming after the ACCEPT)."""
        if self.state is not SenderState.STREAMING or not self._accepted:
            return None
        enc = self.encoder
        return self.probe.expiry(self.view, self.inflight, enc.next_esi, enc.ack_prefix, self.path.rtt_var,
                                 self._send_deadline)

    def _done(self, reason: DoneReason, now: float) -> None:
        self.completion.reason = reason
        self._stop_sending(now)
        self._queue_done(now)

    def _queue_done(self, now: float) -> None:
        datagram = self.completion.datagram(self.protector, self.encoder.next_esi, self.view.repairs_sent,
                                            now, self.view.rtt_estimate)
        if datagram is not None:
            self._control.append(datagram)
            self.datagrams_sent["control"] += 1

    def _may_fill(self) -> bool:
        """Whether a slot that would idle carries a repair: the whole deadline is the budget, the policy
        repairs closed loop, and the newest ACK names symbols the receiver lacks (hole regions). Not on
        sources merely unacknowledged yet: on a clean link that filled the last round trip with repairs
        (measured, pfec bench transport: sender CPU per packet +30%, receiver lateness p99 0.2 -> 11 ms);
        a lost tail is the probe timeout's."""
        view = self.view
        return (
            self.config.fill_idle
            and self._accepted
            and not view.open_loop
            and view.repairs_left > 0
            and self.planner.regions > 0
        )

    def _slots_left(self, now: float) -> int:  # counted at the rate forecast, not the rate paced at
        return max(0, int((self._send_deadline - now) / self.rate.plan_slot_s))

    def _decide(self, now: float) -> bool:
        """A decision epoch: refresh the view, then choose the next burst (False: nothing to send now)."""
        cpu = self.cpu
        t0 = cpu.clock() if cpu is not None else 0
        self._refresh_view(now)
        if (broken := self.rate.breaker(now)) is not None:  # RFC 8084: the path stopped delivering
            self._events.append(PathBroken(broken))
            self._done(DoneReason.PATH_BROKEN, now)
            return False
        if self.view.slots_left == 0:
            self._stop_sending(now)
            return False
        chosen = self._choose_burst(now)
        if chosen and cpu is not None:
            cpu.policy_ns += cpu.clock() - t0
            cpu.decisions += 1
        return chosen

    def _choose_burst(self, now: float) -> bool:
        view, send_path = self.view, self.send_path
        # An owed probe goes first, then the open-loop tail's credit: one repair each (over what the
        # receiver lacks most, over the newest window). The policy decides the rest.
        if view.repairs_left > 0 and self.probe.take():
            send_path.take_probe()
            return self._one_repair()
        if send_path.take_tail_repair():
            return self._one_repair()
        if not view.update_mask():
            return self._nothing_allowed(now)
        action = self.policy.decide(view)
        if not view.mask[action]:
            raise ValueError(f"policy {self.policy.name!r} chose masked action {action.name}")
        self._burst_action = action
        if action is Action.SOURCE:
            self._burst_left = min(SOURCE_BURST, view.sources_left, view.slots_left)
        else:
            self._burst_left = REPAIR_SIZES[action]
        return True

    def _one_repair(self) -> bool:
        self._burst_action = Action.REPAIR_1
        self._burst_left = 1
        return True

    def _nothing_allowed(self, now: float) -> bool:
        """The masks allow nothing (every source sent, no deficit left): done (say so and stop), fill the
        slot with a repair (the whole deadline is the budget), or wait for feedback."""
        reason = done_reason(self.view, self.encoder.ack_prefix, self.policy.sends_repairs)
        if reason is not None and self._accepted:
            self._done(reason, now)
            return False
        if not self._may_fill():
            return False
        self.send_path.take_fill()
        return self._one_repair()

    def _refresh_view(self, now: float) -> None:
        view = self.view
        enc = self.encoder
        next_esi = enc.next_esi
        view.now = now
        view.sources_sent = next_esi
        slots_left = view.slots_left = self._slots_left(now)
        view.acked_prefix = enc.ack_prefix
        view.ack_staleness = now - self.path.last_prefix_change
        inflight = self.inflight
        view.repairs_in_flight = view.repairs_sent - inflight.repairs_acked
        view.sources_in_flight = next_esi - inflight.acked_source_end
        rtt = view.rtt_estimate
        since_start = None if rtt > 0 else now - self._start  # no RTT sample: no ACK yet
        self.send_path.plan_epoch(next_esi, view.loss_estimate, rtt, slots_left * self.rate.plan_slot_s,
                                  since_start)
        if self._utility_features is not None:
            self._utility_features.write(self.view, next_esi)

    # ------------------------------------------------------------------- control
    def _queue_offer(self, now: float) -> None:
        parts = self.offer.all(self._deadline, now)
        self._control.extend(parts)
        self.datagrams_sent["control"] += len(parts)
        # Until the ACCEPT, the OFFER also repeats every EARLY_OFFER_EVERY data datagrams: a receiver that
        # lost it holds only its first 256 (unauthenticated) datagrams and drops the rest, which in
        # utility order are the most valuable (measured: a lost OFFER cut a handoff to 0.27 of its utility).
        self._offer_timer = now + min(self.config.offer_retry_s, EARLY_OFFER_EVERY * self.rate.slot_s)

    def _stop_sending(self, now: float) -> None:
        if self.state is not SenderState.STREAMING:
            return
        self.state = SenderState.DRAINING
        self._burst_left = 0
        self._offer_timer = None
        self._result_timer = self._deadline + self.config.result_wait_s
        self._events.append(SendingStopped(self.encoder.next_esi, self.view.repairs_sent))

    # ----------------------------------------------------------------- receiving
    def _handle(self, message: Message, now: float) -> None:
        if isinstance(message, Ack):
            self._on_ack(message, now)
        elif isinstance(message, Accept):
            self._on_accept(message, now)
        elif isinstance(message, Refuse):
            self._fail_refused(message)
        elif isinstance(message, Result):
            self._on_result(message, now)
        elif isinstance(message, Close):
            if self.state not in (SenderState.DONE, SenderState.FAILED):
                self._fail(f"receiver closed the session ({message.code.name}): {message.text}")
        else:
            self._drop("unexpected_type")

    def _on_accept(self, accept: Accept, now: float) -> None:
        """The receiver's ACCEPT (its R_r; the open verified our R_s): the session keys, then streaming."""
        if self._accepted:
            if accept.receiver_random != self.protector.peer_random:
                self._drop("accept_mismatch")  # another ACCEPT for this attempt: a restarted receiver's
            return
        if self.state not in (SenderState.STREAMING, SenderState.DRAINING):
            return
        if accept.n_source != self.encoder.n_source or accept.window_cap == 0:
            self._drop("accept_mismatch")
            return
        self.protector.set_peer_random(accept.receiver_random)
        # The first OFFER's round trip: ahead of any queued data.
        self.rate.on_rtt_measurement(now, now - self._start, self._start)
        self._accepted = True
        self._offer_timer = None
        self.offer.on_accept(now)
        # The receiver establishes the session on our first datagram under the session key: send one now
        # (the OFFER's last, smallest part again) rather than wait for data, which may be over already.
        self._control.append(self.offer.part(len(self.offer.parts) - 1, self._deadline, now))
        self.datagrams_sent["control"] += 1
        self.send_path.on_accept(accept.window_cap)  # ACCEPT carries the receiver's decoder span
        try:  # and the receiver's stated prefill speed, checked before a planner may use it
            stated = stated_receiver(accept.prefill_a_us, accept.prefill_b_ns, accept.prefill_c_ps,
                                     accept.decode_us)
        except ValueError:
            self.drops["bad_prefill_speed"] = self.drops.get("bad_prefill_speed", 0) + 1
            stated = None
        self._events.append(Accepted(accept.window_cap, stated))

    def _on_ack(self, ack: Ack, now: float) -> None:
        if self.state not in (SenderState.STREAMING, SenderState.DRAINING):
            return
        enc = self.encoder
        if not ack_plausible(ack, enc.next_esi, self.protector.packets_sealed):
            self._drop("bad_ack")
            return
        if ack.computed_tokens > self.split.n_tokens:  # past the context (or any value but 0 unsplit)
            self._drop("bad_ack_computed")
            return
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
        streaming = self.state is SenderState.STREAMING and self._accepted
        if streaming and self.split.needs_nothing(ack, enc.next_esi):
            self._done(DoneReason.DECODED, now)  # a split's receiver lacks only what it computed itself

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

    def _on_result(self, result: Result, now: float) -> None:
        if self.state in (SenderState.DONE, SenderState.FAILED):
            return
        try:
            blob = self._result.add(result)
        except ValueError:
            self._drop("bad_result_part")
            return
        if blob is None:
            return
        self._queue_close(CloseCode.DONE, "")
        self.state = SenderState.DONE
        self._result_timer = self._offer_timer = self.completion.timer = None
        self.path.end(self.send_path.data_sent)
        self._events.append(ResultReceived(result.decoded_count, blob))

    def _fail_refused(self, refuse: Refuse) -> None:
        if self.state in (SenderState.DONE, SenderState.FAILED):
            return
        self._events.append(Refused(int(refuse.code), refuse.text))
        self._fail(f"receiver refused the handoff ({refuse.code.name}): {refuse.text}")

    def _queue_close(self, code: CloseCode, text: str) -> None:
        try:
            self._control.append(self.protector.seal(Close(code, clip_text(text))))
        except ValueError:  # the packet-number space is spent: the receiver reaps the session itself
            return
        self.datagrams_sent["control"] += 1

    def _fail(self, reason: str, close: CloseCode | None = None, close_text: str = "") -> None:
        """FAILED with ``reason``; with ``close`` a CLOSE goes to the receiver first (so its session ends)."""
        if close is not None:
            self._queue_close(close, close_text or reason)
        self.state = SenderState.FAILED
        self._burst_left = 0
        self._offer_timer = self._result_timer = self.completion.timer = None
        self.path.end(self.send_path.data_sent)
        self._events.append(Failed(reason))

    def _drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1
        self._events.append(DatagramDropped(reason))
