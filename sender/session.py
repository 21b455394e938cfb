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
  an action; the burst is then sent one datagram per call. An open-loop policy (a fixed-rate code) needs
  no deficit for a repair and its repairs cover the newest window: its planner takes the ACKs' prefix but
  not their hole maps, and moves to the window at the prefix only while an ACK reports the receiver's
  decoder stalled (undecoded range past its span: a newer window would be refused).
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
- A split handoff (``SplitInfo``: the receiver prefills the front of the context itself while this session
  streams the back) ends every source symbol's stake at a context token (the last block any of its pieces
  belongs to). An ACK's ``computed_tokens`` says how far the receiver's own prefill has got (beyond the
  context: dropped, ``bad_ack_computed``); the session then moves the not-yet-sent symbols that hold only
  computed blocks behind the others and never sends them (the receiver files each symbol by the stream
  index inside it, so an unsent symbol's ESI may carry any of them; no repair ever covers an unsent ESI).
  The meeting point so follows both sides' measured speeds.
- When no slot is left before the deadline the session stops sending data (DRAINING) and waits for the
  receiver's RESULT, answering it with CLOSE (DONE); without a RESULT by ``deadline + result_wait_s`` it
  fails with a reason. Whenever the session gives up (no ACCEPT, no RESULT, ``cancel``) it queues a
  CLOSE for the receiver first.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import numpy.typing as npt

from pfec.common.codec.fec import Encoder, FecError
from pfec.common.events import CpuMeter, DatagramDropped, earliest
from pfec.common.sched.actions import REPAIR_SIZES, SOURCE_BURST, Action, SchedulerView
from pfec.common.sched.open_loop_tail import OpenLoopTail
from pfec.common.sched.policies import Policy
from pfec.common.wire.messages import (
    NONCE_SIZE,
    OFFER_FIXED_SIZE,
    OVERHEAD,
    Accept,
    Ack,
    Close,
    CloseCode,
    Message,
    MsgType,
    Offer,
    ParseError,
    Refuse,
    Result,
    clip_text,
    split_app,
)
from pfec.common.wire.seal import PacketProtector, drop_reason
from pfec.sender.repair_plan import (
    RESEND_RTTS,
    SEEN_MIN_S,
    SEEN_RTTS,
    Plan,
    RepairPlanner,
    count_upto_kernel,
)
from pfec.sender.session_types import (
    EARLY_OFFER_EVERY,
    MAX_SPAN,
    Accepted,
    Failed,
    Refused,
    ResultReceived,
    SenderConfig,
    SenderEvent,
    SenderState,
    SendingStopped,
    SourceInfo,
    SplitInfo,
)

# The session's inputs and outputs live in session_types; callers import them from here too.
__all__ = [
    "MAX_SPAN",
    "Accepted",
    "Failed",
    "Refused",
    "ResultReceived",
    "SenderConfig",
    "SenderEvent",
    "SenderSession",
    "SenderState",
    "SendingStopped",
    "SourceInfo",
    "SplitInfo",
]


class SenderSession:
    """The sending end of one handoff: OFFER, paced source and repair datagrams, ACK processing, the
    RESULT and CLOSE (see the module doc). The daemon and the simulator assemble it in ``transfer.py``."""

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
    ) -> None:
        self.session_id = session_id
        if split is not None:  # its unsent rows get reordered: a copy of its own, the caller's stays as is
            symbols = symbols.copy()
        self.config = config
        self.policy = policy
        self.protector = protector
        self.cpu = cpu
        # Unless the cap was configured, the encoder may build windows as wide as an RFC 8681 window: the
        # open-loop tail's repairs reach back over the whole tail, as far as the decoder span allows
        # (``_tail_window``); the repair planner bounds every other window by the cap.
        self.encoder = Encoder(
            symbols,
            window_cap=config.window_cap if config.window_cap_strict else MAX_SPAN,
            target_nonzeros=config.target_nonzeros,
            fixed_dt=config.fixed_dt,
        )
        self._symbols = symbols
        self.planner = RepairPlanner(
            config.window_cap, config.window_cap, config.target_nonzeros, config.fixed_dt
        )
        self._count_upto = count_upto_kernel()
        self.state = SenderState.IDLE
        self.view = SchedulerView(n_source=self.encoder.n_source, repair_budget=config.repair_budget)
        self.view.repairs_left = config.repair_budget if policy.sends_repairs else 0
        # Open loop (a fixed-rate code): repairs need no deficit, and the planner never sees the ACKs' hole
        # maps, so every repair covers the newest window (see common/sched/policies.py).
        self._open_loop = self.view.open_loop = bool(getattr(policy, "open_loop", False))
        self._span = config.window_cap  # the receiver's decoder span (its ACCEPT says it)
        if self._open_loop:  # until an ACK says the receiver's decoder is stalled: the newest window
            self.planner.span = MAX_SPAN
        self._stalled = False  # the newest ACK's undecoded range outgrew the receiver's span
        # A closed-loop repair policy's sources that feedback cannot save are protected open loop
        # (common/sched/open_loop_tail.py); before an RTT sample, the path's prior: twice the one-way delay.
        self._tail = OpenLoopTail(policy.sends_repairs and not self._open_loop, config.loss_prior,
                                  2 * config.owd_s, config.window_cap)
        self._tail_burst = False  # the current burst is the tail's open-loop repair
        self._tail_first = -1  # the first source sent in the tail (-1: none yet)
        self._planner_loss = 0.0  # the loss the repair planner discounts repairs in flight by (see below)
        self._source_info = source_info
        # Per-ESI (progress, utility, upcoming) rows as Python lists: a decision reads three floats.
        self._utility_features: list[list[float]] | None = (
            source_info.per_esi_features().T.tolist() if source_info is not None else None
        )
        self._events: deque[SenderEvent] = deque()
        self._control: deque[bytes] = deque()  # OFFER / CLOSE datagrams, sent before data
        self._burst_action = Action.SOURCE
        self._burst_left = 0
        self._repair_buf = np.empty(self.encoder.symbol_size, dtype=np.uint8)
        # (packet number, esi or -1 for repairs, send time) of data datagrams not yet covered by an ACK.
        # What was sent, in send order (preallocated: one row per source / repair the session may send).
        # The newest ACK's largest packet number splits each into acknowledged and in flight.
        n = self.encoder.n_source
        self._src_pn = np.zeros(n, dtype=np.int64)
        self._src_time = np.zeros(n, dtype=np.float64)
        budget = config.repair_budget + 1
        self._rep_pn = np.zeros(budget, dtype=np.int64)
        self._rep_time = np.zeros(budget, dtype=np.float64)
        self._rep_window = np.zeros((budget, 2), dtype=np.int64)  # first, end
        self._repairs_acked = 0
        self._acked_source_end = 0  # every source ESI below this was sent before the newest ACKed packet
        self._proactive = False  # near the deadline: repairs may also protect the newest sources
        # The decision's repair plan, until an ACK or a sent repair changes the planner's state: the first
        # repair of a burst uses it rather than planning again.
        self._fresh_plan: Plan | None = None
        self._start = 0.0
        self._send_deadline = 0.0
        self._deadline = 0.0
        self._accepted = False  # the receiver's ACCEPT arrived: the session keys are set
        self._handshake_deadline = 0.0
        self._offer_timer: float | None = None
        self._result_timer: float | None = None
        self._last_prefix_change = 0.0
        self._ack_received = 0
        self._ack_lost = 0
        self._result_parts: dict[int, bytes] = {}
        self._result_part_count = 0
        self.datagrams_sent = {"source": 0, "repair": 0, "control": 0}
        self.drops: dict[str, int] = {}
        self.repairs_skipped = 0  # repairs a burst could not make (its window emptied under it)
        # Split handoff: each unsent ESI's token end (permuted with the symbols), the receiver's newest
        # computed_tokens, and the end of the sources still worth sending (the rest is computed there).
        self._split_n_tokens = 0 if split is None else split.n_tokens
        self._token_end: npt.NDArray[np.int64] | None = None
        if split is not None:
            if len(split.token_end_of_esi) != self.encoder.n_source:
                raise ValueError(f"split: {len(split.token_end_of_esi)} token ends for "
                                 f"{self.encoder.n_source} source symbols")
            self._token_end = np.array(split.token_end_of_esi, dtype=np.int64)
        self.computed_tokens = 0
        self.sources_dropped = 0  # unsent sources never sent: the receiver computed their blocks

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
        self._last_prefix_change = now
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
        if datagram is None:  # the repair window emptied under the burst (an ACK moved it): decide again
            self._burst_left = 0
            if not self._decide(now):
                return None
            datagram = self._send_burst(now)
        return datagram

    def _send_burst(self, now: float) -> bytes | None:
        self._burst_left -= 1
        if self._burst_action is Action.SOURCE:
            return self._send_source(now)
        return self._send_repair(now)

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
        return earliest(send_deadline, self._offer_timer, self._result_timer, handshake)

    def handle_timer(self, now: float) -> None:
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
        return self._tail.lost, self._tail.seen

    # ------------------------------------------------------------ decision epochs
    def _slots_left(self, now: float) -> int:
        return max(0, int((self._send_deadline - now) / self.config.slot_s))

    def _decide(self, now: float) -> bool:
        cpu = self.cpu
        t0 = cpu.clock() if cpu is not None else 0
        view = self.view
        self._refresh_view(now)
        if view.slots_left == 0:
            self._stop_sending(now)
            return False
        # The tail's credit goes first (one repair over the newest window), the policy decides the rest.
        self._tail_burst = tail = (
            self._tail.active and view.repairs_left > 0 and view.sources_sent > 0 and self._tail.take()
        )
        if tail:
            self._burst_action = Action.REPAIR_1
            self._burst_left = 1
            if cpu is not None:
                cpu.policy_ns += cpu.clock() - t0
                cpu.decisions += 1
            return True
        if not view.update_mask():
            return False  # nothing allowed until feedback changes (e.g. all sources sent, no deficit)
        action = self.policy.decide(view)
        if not view.mask[action]:
            raise ValueError(f"policy {self.policy.name!r} chose masked action {action.name}")
        if action is Action.SOURCE:
            burst = min(SOURCE_BURST, view.sources_left, view.slots_left)
        else:
            burst = REPAIR_SIZES[action]
        self._burst_action = action
        self._burst_left = burst
        if cpu is not None:
            cpu.policy_ns += cpu.clock() - t0
            cpu.decisions += 1
        return True

    def _refresh_view(self, now: float) -> None:
        view = self.view
        enc = self.encoder
        next_esi = enc.next_esi
        loss = view.loss_estimate
        view.now = now
        view.sources_sent = next_esi
        slots_left = max(0, int((self._send_deadline - now) / self.config.slot_s))
        view.slots_left = slots_left
        view.acked_prefix = enc.ack_prefix
        view.ack_staleness = now - self._last_prefix_change
        view.repairs_in_flight = view.repairs_sent - self._repairs_acked
        view.sources_in_flight = next_esi - self._acked_source_end
        # Proactive repair only pays when feedback about the newest sources cannot return in time.
        rtt = view.rtt_estimate
        time_left = slots_left * self.config.slot_s
        proactive = rtt > 0 and time_left < 1.5 * rtt
        self._tail.update(time_left, rtt, None if rtt > 0 else now - self._start)  # no RTT sample: no ACK yet
        self._proactive = proactive
        # Repairs in flight count as arriving until a lost one could no longer be replaced (RESEND_RTTS).
        self._planner_loss = loss if proactive or time_left < RESEND_RTTS * rtt else 0.0
        plan = self._fresh_plan = self.planner.plan(next_esi, self._planner_loss, proactive)
        view.window_size = plan.nss
        view.repair_effectiveness = plan.effectiveness
        view.deficit_estimate = plan.reactive_need
        if proactive:
            view.deficit_estimate += self.planner.proactive_need(next_esi, self._acked_source_end, loss)
        if self._utility_features is not None:
            self._refresh_utility_features(next_esi)

    def _refresh_utility_features(self, next_esi: int) -> None:
        view = self.view
        feats = self._utility_features
        assert feats is not None
        progress, utility, upcoming = feats
        if next_esi >= len(progress):
            view.block_progress = 1.0
            view.block_utility = 0.0
            view.upcoming_utility = 0.0
            return
        view.block_progress = progress[next_esi]
        view.block_utility = utility[next_esi]
        view.upcoming_utility = upcoming[next_esi]

    # ------------------------------------------------------------------- sending
    def _send_source(self, now: float) -> bytes:
        esi = self.encoder.take_source()
        datagram = self.protector.seal_source(esi, self._symbols[esi].data)
        self._src_pn[esi] = self.protector.packets_sealed
        self._src_time[esi] = now
        self.datagrams_sent["source"] += 1
        if self._tail.active and self._tail_first < 0:
            self._tail_first = esi
        self._tail.on_source()
        return datagram

    def _send_repair(self, now: float) -> bytes | None:
        cpu = self.cpu
        t0 = cpu.clock() if cpu is not None else 0
        planner = self.planner
        plan = self._fresh_plan
        if self._tail_burst:  # open loop: the newest window, as far as a stalled receiver's span allows
            plan = planner.plan_newest(self.encoder.next_esi, self._tail.loss,
                                       self._span if self._stalled else MAX_SPAN, *self._tail_window())
        elif plan is None:
            plan = planner.plan(self.encoder.next_esi, self._planner_loss, self._proactive)
        self._fresh_plan = None  # planner.sent() below changes what the next repair serves
        first, count, region = plan.first, plan.nss, plan.region
        if count <= 0 or first < 0 or first + count > self.encoder.next_esi:
            self.repairs_skipped += 1
            return None
        try:
            rid = self.encoder.make_repair(
                self._repair_buf,
                count=count,
                dt=plan.dt,
                first=first,
                cover_last=planner.covers_both_ends(region),
            )
        except (FecError, ValueError):  # no usable coefficient row: no repair this time
            self.repairs_skipped += 1
            return None
        planner.sent(region)
        if cpu is not None:
            cpu.encode_ns += cpu.clock() - t0
        datagram = self.protector.seal_repair(
            rid.repair_key, rid.dt, rid.nss, rid.fss_esi, self._repair_buf.data
        )
        sent = self.view.repairs_sent
        self._rep_pn[sent] = self.protector.packets_sealed
        self._rep_time[sent] = now
        self._rep_window[sent] = (first, first + count)
        self.view.repairs_left -= 1
        self.view.repairs_sent = sent + 1
        self.datagrams_sent["repair"] += 1
        return datagram

    def _tail_window(self) -> tuple[int, int]:
        """(first ESI, width) of the tail's repairs: every source sent in the tail, as wide as the decoder
        holds (its granted span once the ACCEPT says it; the window cap, the least any receiver grants,
        before). One code over the whole tail rather than over the newest window: the decoder then
        recovers the tail's sources in order as long as the repairs sent after any point outnumber the
        losses after it, so a burst that outruns a window's repairs is paid for by the surplus of the
        repairs after it, instead of leaving every overlapping window (the most useful sources first,
        in utility order) undecodable. Its sources are known to the receiver (received or not) from the
        start of the tail, so an undecoded hole costs no more than in a narrower window."""
        width = self._span if self._accepted and not self.config.window_cap_strict else self.config.window_cap
        return max(0, self._tail_first), width

    def _queue_offer(self, now: float) -> None:
        parts = split_app(self.config.app_blob, MsgType.OFFER)
        for index in range(len(parts)):
            self._queue_offer_part(parts, index, now)
        # Until the ACCEPT, the OFFER also repeats every EARLY_OFFER_EVERY data datagrams: a receiver that
        # lost it holds only its first 256 (unauthenticated) datagrams and drops the rest, which in
        # utility order are the most valuable (measured: a lost OFFER cut a handoff to 0.27 of its utility).
        cfg = self.config
        self._offer_timer = now + min(cfg.offer_retry_s, EARLY_OFFER_EVERY * cfg.slot_s)

    def _queue_offer_part(self, parts: list[bytes], index: int, now: float) -> None:
        cfg = self.config
        part = parts[index]
        # The receiver's budget runs from when it receives this OFFER.
        offer_bytes = OVERHEAD + NONCE_SIZE + OFFER_FIXED_SIZE + len(part)
        serialise = offer_bytes * 8 / cfg.rate_bps if cfg.rate_bps > 0 else 0.0
        budget = max(0.0, self._deadline - now - cfg.owd_s - serialise)
        offer = Offer(
            symbol_size=self.encoder.symbol_size,
            window_cap=cfg.window_cap,
            n_source=self.encoder.n_source,
            budget_us=min(int(budget * 1e6), 0xFFFFFFFF),
            fingerprint=cfg.fingerprint,
            part_index=index,
            part_count=len(parts),
            app=part,
            sender_random=self.protector.local_random,
            span=cfg.decoder_span,
        )
        self._control.append(self.protector.seal(offer))
        self.datagrams_sent["control"] += 1

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
        self._accepted = True
        self._offer_timer = None
        # The receiver establishes the session on our first datagram under the session key: send one now
        # (the OFFER's last, smallest part again) rather than wait for data, which may be over already.
        parts = split_app(self.config.app_blob, MsgType.OFFER)
        self._queue_offer_part(parts, len(parts) - 1, now)
        # ACCEPT carries the receiver's decoder span: how far past its prefix repairs may reach.
        self._span = max(self.config.window_cap, min(accept.window_cap, MAX_SPAN))
        if not self._open_loop:
            self.planner.span = self._span
        self._fresh_plan = None
        self._events.append(Accepted(accept.window_cap))

    def _ack_plausible(self, ack: Ack) -> bool:
        """Whether an ACK's fields fit what this session sent (a crafted one is dropped, not applied)."""
        sent = self.encoder.next_esi
        sealed = self.protector.packets_sealed
        return (
            ack.decoded_prefix <= sent
            and ack.seen_end <= sent
            and ack.decoded_count <= sent
            and ack.largest_pn <= sealed
            and ack.received <= sealed
            and ack.lost <= sealed
            and ack.loss_runs <= ack.lost
            and ack.hole_bits <= 8 * len(ack.holes)
        )

    def _on_computed(self, computed: int) -> None:
        """The receiver has prefilled [0, ``computed``) itself: stop spending bytes on what it computed.

        The unsent symbols of blocks entirely below ``computed`` move behind the others (a stable
        partition of the unsent range, only when the value passes a symbol's end) and the view's source
        count ends before them, so the scheduler never sends them."""
        if computed <= self.computed_tokens:
            return  # reordered or repeated
        self.computed_tokens = computed
        ends = self._token_end
        if ends is None:
            return
        first, end = self.encoder.next_esi, self.view.n_source
        unsent = ends[first:end]
        keep = unsent > computed
        kept = int(np.count_nonzero(keep))
        if kept == len(unsent):
            return
        order = np.concatenate((np.flatnonzero(keep), np.flatnonzero(~keep))) + first
        self._symbols[first:end] = self._symbols[order]
        ends[first:end] = ends[order]
        if self._utility_features is not None:
            feats = np.asarray(self._utility_features)
            feats[:, first:end] = feats[:, order]
            self._utility_features = feats.tolist()
        self.sources_dropped += len(unsent) - kept
        self.view.n_source = first + kept
        self._burst_left = min(self._burst_left, kept) if self._burst_action is Action.SOURCE else \
            self._burst_left

    def _on_ack(self, ack: Ack, now: float) -> None:
        if self.state not in (SenderState.STREAMING, SenderState.DRAINING):
            return
        if not self._ack_plausible(ack):
            self._drop("bad_ack")
            return
        if ack.computed_tokens > self._split_n_tokens:  # past the context (or any value but 0 unsplit)
            self._drop("bad_ack_computed")
            return
        if ack.computed_tokens:
            self._on_computed(ack.computed_tokens)
        cpu = self.cpu
        t0 = cpu.clock() if cpu is not None else 0
        self._fresh_plan = None  # the ACK moves the planner and the loss estimate
        enc = self.encoder
        if ack.decoded_prefix > enc.ack_prefix:
            self._last_prefix_change = now
        enc.on_ack(ack.decoded_prefix)
        view = self.view
        view.feedback_seen = True
        view.deficit_reported = ack.deficit
        view.window_at_feedback = ack.unknowns
        seen = ack.received + ack.lost
        if seen > 0:
            view.loss_estimate = ack.lost / seen
        if ack.loss_runs > 0:
            view.burst_estimate = ack.lost / ack.loss_runs
        self._tail.on_ack(ack.lost, seen, view.burst_estimate)
        # What the receiver has accounted for; the newest datagram it saw gives an RTT sample.
        largest = ack.largest_pn
        sample_time = -1.0
        acked = self._count_upto(self._src_pn, enc.next_esi, largest)
        if acked > self._acked_source_end:
            self._acked_source_end = acked
            if self._src_pn[acked - 1] == largest:
                sample_time = float(self._src_time[acked - 1])
        n_rep = view.repairs_sent
        acked = self._count_upto(self._rep_pn, n_rep, largest)
        if acked > self._repairs_acked:
            self._repairs_acked = acked
            if self._rep_pn[acked - 1] == largest:
                sample_time = float(self._rep_time[acked - 1])
        if ack.decoded_prefix == enc.ack_prefix:  # the newest ACK: its hole map is current
            self._plan_from_ack(ack, now)
        if sample_time >= 0:
            rtt = now - sample_time - ack.ack_delay_us * 1e-6
            if rtt > 0:
                view.rtt_estimate = rtt if view.rtt_estimate == 0 else 0.875 * view.rtt_estimate + 0.125 * rtt
        if cpu is not None:
            cpu.feedback_ns += cpu.clock() - t0
            cpu.acks += 1

    def _plan_from_ack(self, ack: Ack, now: float) -> None:
        open_loop = self._open_loop  # a fixed-rate code takes the prefix (the encoder's window), no holes
        self._stalled = ack.seen_end - ack.decoded_prefix > self._span
        if open_loop:
            # Its repairs cover the newest window, unless the receiver reports its decoder stalled (a loss
            # no repair reached holds the prefix and the undecoded range outgrew the span: it refuses
            # windows past prefix + span); then the window at the prefix, the only one that can move it.
            self.planner.span = self.config.window_cap if self._stalled else MAX_SPAN
        self.planner.on_ack(
            ack.decoded_prefix,
            b"" if open_loop else ack.holes,
            0 if open_loop else ack.hole_bits,
            0 if open_loop else ack.deficit,
            self.encoder.next_esi,
            self._rep_window,
            self._repairs_acked,
            self.view.repairs_sent,
            self._rep_time,
            now - max(SEEN_RTTS * self.view.rtt_estimate, SEEN_MIN_S),
        )

    def _on_result(self, result: Result, now: float) -> None:
        if self.state in (SenderState.DONE, SenderState.FAILED):
            return
        count = self._result_part_count or result.part_count
        if (
            result.part_index >= result.part_count
            or result.part_count != count
            or count > self.config.max_result_parts
        ):
            self._drop("bad_result_part")
            return
        self._result_part_count = count
        self._result_parts[result.part_index] = bytes(result.app)
        if len(self._result_parts) < count:
            return
        blob = b"".join(self._result_parts[i] for i in range(count))
        self._queue_close(CloseCode.DONE, "")
        self.state = SenderState.DONE
        self._result_timer = None
        self._offer_timer = None
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
        self._offer_timer = None
        self._result_timer = None
        self._events.append(Failed(reason))

    def _drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1
        self._events.append(DatagramDropped(reason))
