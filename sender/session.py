"""Sender side of one handoff, sans-IO (aioquic style): bytes and ``now`` in; datagrams, timers, events out.

Theory of operation
-------------------
States: OFFERING -> STREAMING -> DRAINING -> DONE, or FAILED from any state.

- ``start(now)`` queues the OFFER (the receiver's time budget, never a timestamp) and moves to STREAMING
  at once: data follows the OFFER without waiting a round trip, because the deadline counts from the
  first transmission. The OFFER is repeated every ``offer_retry_s`` until an ACCEPT or ACK shows the
  receiver has the session.
- The link pacer calls ``next_datagram(now)`` whenever the link is free. Between bursts the session
  refreshes its ``SchedulerView`` from its own sends and the newest ACK, recomputes the hard masks (source
  left, estimated deficit for repair, repair budget, slots before the deadline) and asks the policy for
  an action; the burst is then sent one datagram per call.
- ACKs move the encoder's window (cumulative decoded prefix) and feed the loss, burst, RTT and deficit
  estimates. A deficit estimate is the receiver's reported window deficit, minus the repairs still in
  flight that the receiver had not seen when it wrote the ACK (each arrives with probability 1 - loss),
  plus the expected losses among in-flight sources that fall inside the window.
- When no slot is left before the deadline the session stops sending data (DRAINING) and waits for the
  receiver's RESULT, answering it with CLOSE (DONE); without a RESULT by ``deadline + result_wait_s`` it
  fails with a reason.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum

import numpy as np
import numpy.typing as npt

from pfec.common.codec.fec import DEFAULT_WINDOW, Encoder
from pfec.common.events import CpuMeter, DatagramDropped, Event, earliest
from pfec.common.sched.actions import REPAIR_SIZES, SOURCE_BURST, Action, SchedulerView
from pfec.common.sched.policies import Policy
from pfec.common.wire.messages import (
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
    max_app_chunk,
)
from pfec.common.wire.seal import PacketProtector
from pfec.sender.repair_plan import Plan, RepairPlanner, count_upto_kernel

MAX_SPAN = 4095  # largest RFC 8681 window the decoder could be asked to hold (12-bit NSS)


@dataclass(frozen=True, slots=True)
class SenderConfig:
    budget_s: float  # D: from start() until the receiver must start decoding
    slot_s: float  # link time of one full-size datagram (pacing unit)
    owd_s: float  # estimated forward one-way delay
    repair_budget: int  # B_rep, repair datagrams at most
    fingerprint: bytes  # 32-byte compatibility hash checked by the receiver
    window_cap: int = DEFAULT_WINDOW
    target_nonzeros: int | None = 8
    fixed_dt: int | None = None
    app_blob: bytes = b""  # application part of the OFFER (split over parts)
    offer_retry_s: float = 0.05
    result_wait_s: float = 2.0
    rate_bps: float = 0.0  # link rate for the OFFER's own serialisation time (0: ignore)

    def __post_init__(self) -> None:
        if self.budget_s <= 0:
            raise ValueError(f"budget_s must be positive, got {self.budget_s!r}")
        if self.slot_s <= 0:
            raise ValueError(f"slot_s must be positive, got {self.slot_s!r}")
        if self.owd_s < 0:
            raise ValueError(f"owd_s must be >= 0, got {self.owd_s!r}")
        if self.repair_budget < 0:
            raise ValueError(f"repair_budget must be >= 0, got {self.repair_budget!r}")
        if len(self.fingerprint) != 32:
            raise ValueError(f"fingerprint must be 32 bytes, got {len(self.fingerprint)}")


class SenderState(Enum):
    IDLE = "idle"
    STREAMING = "streaming"
    DRAINING = "draining"
    DONE = "done"
    FAILED = "failed"


# Events the sender emits.
@dataclass(frozen=True, slots=True)
class Accepted(Event):
    window_cap: int


@dataclass(frozen=True, slots=True)
class Refused(Event):
    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class ResultReceived(Event):
    decoded_count: int
    app_blob: bytes


@dataclass(frozen=True, slots=True)
class SendingStopped(Event):
    """No transmission slot is left before the deadline."""

    sources_sent: int
    repairs_sent: int


@dataclass(frozen=True, slots=True)
class Failed(Event):
    reason: str


SenderEvent = Accepted | Refused | ResultReceived | SendingStopped | Failed | DatagramDropped


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """Per-ESI KV context for the policy's application features (optional)."""

    block_of_esi: npt.NDArray[np.int64]  # block id of every source symbol, in send order
    block_utility: npt.NDArray[np.float64]  # utility of every block id

    UPCOMING_BLOCKS = 8

    def normalised(self) -> npt.NDArray[np.float64]:
        top = float(self.block_utility.max()) if len(self.block_utility) else 0.0
        return self.block_utility / top if top > 0 else np.zeros_like(self.block_utility)

    def per_esi_features(self) -> npt.NDArray[np.float64]:
        """(N, 3): block progress, normalised block utility, mean utility of the next blocks, per ESI.

        Computed once per handoff so a decision only indexes a row.
        """
        blocks = np.asarray(self.block_of_esi, dtype=np.int64)
        n = len(blocks)
        out = np.zeros((n, 3), dtype=np.float64)
        if n == 0:
            return out
        norm = self.normalised()
        # Runs of equal block ids are one block's fragments, contiguous in the queue.
        starts = np.flatnonzero(np.r_[True, blocks[1:] != blocks[:-1]])
        lengths = np.diff(np.r_[starts, n])
        run_of_esi = np.repeat(np.arange(len(starts)), lengths)
        out[:, 0] = (np.arange(n) - starts[run_of_esi]) / lengths[run_of_esi]
        run_utility = norm[blocks[starts]]
        out[:, 1] = run_utility[run_of_esi]
        k = self.UPCOMING_BLOCKS
        padded = np.r_[run_utility, np.zeros(k)]
        csum = np.r_[0.0, np.cumsum(padded)]
        nxt = np.arange(len(starts)) + 1
        upcoming = (csum[nxt + k] - csum[nxt]) / k
        out[:, 2] = upcoming[run_of_esi]
        return out


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
    ) -> None:
        self.session_id = session_id
        self.config = config
        self.policy = policy
        self.protector = protector
        self.cpu = cpu
        self.encoder = Encoder(
            symbols,
            window_cap=config.window_cap,
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
        self._offer_confirmed = False
        self._offer_timer: float | None = None
        self._result_timer: float | None = None
        self._last_prefix_change = 0.0
        self._ack_received = 0
        self._ack_lost = 0
        self._result_parts: dict[int, bytes] = {}
        self.datagrams_sent = {"source": 0, "repair": 0, "control": 0}
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
        self._last_prefix_change = now
        self.state = SenderState.STREAMING
        self._queue_offer(now)

    def next_datagram(self, now: float) -> bytes | None:
        """The next datagram to put on the link now, or None when there is nothing to send yet."""
        if self._control:
            return self._control.popleft()
        if self.state is not SenderState.STREAMING:
            return None
        if self._burst_left == 0 and not self._decide(now):
            return None
        self._burst_left -= 1
        if self._burst_action is Action.SOURCE:
            return self._send_source(now)
        return self._send_repair(now)

    def receive_datagram(self, data: bytes, now: float) -> None:
        try:
            _header, message = self.protector.open(data)
        except ParseError as exc:
            self._drop(exc.reason)
            return
        self._handle(message, now)

    def get_timer(self) -> float | None:
        send_deadline = self._send_deadline if self.state is SenderState.STREAMING else None
        return earliest(send_deadline, self._offer_timer, self._result_timer)

    def handle_timer(self, now: float) -> None:
        if self._offer_timer is not None and now >= self._offer_timer:
            if self.state is SenderState.STREAMING and not self._offer_confirmed:
                self._queue_offer(now)
            else:
                self._offer_timer = None
        if self.state is SenderState.STREAMING and now >= self._send_deadline:
            self._stop_sending(now)
        if self._result_timer is not None and now >= self._result_timer:
            self._result_timer = None
            if self.state is SenderState.DRAINING:
                self._fail("no RESULT from the receiver by the deadline plus result_wait_s")

    def next_event(self) -> SenderEvent | None:
        return self._events.popleft() if self._events else None

    def cancel(self, reason: str, now: float) -> None:
        if self.state in (SenderState.DONE, SenderState.FAILED):
            return
        self._control.append(self.protector.seal(Close(CloseCode.CANCELLED, clip_text(reason))))
        self._fail(f"cancelled: {reason}")

    @property
    def deadline(self) -> float:
        return self._deadline

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
        proactive = rtt > 0 and slots_left * self.config.slot_s < 1.5 * rtt
        self._proactive = proactive
        plan = self._fresh_plan = self.planner.plan(next_esi, loss, proactive)
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
        return datagram

    def _send_repair(self, now: float) -> bytes:
        cpu = self.cpu
        t0 = cpu.clock() if cpu is not None else 0
        planner = self.planner
        plan = self._fresh_plan
        if plan is None:
            plan = planner.plan(self.encoder.next_esi, self.view.loss_estimate, self._proactive)
        self._fresh_plan = None  # planner.sent() below changes what the next repair serves
        first, count, region = plan.first, plan.nss, plan.region
        rid = self.encoder.make_repair(
            self._repair_buf,
            count=count,
            dt=plan.dt,
            first=first,
            cover_last=planner.covers_both_ends(region),
        )
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

    def _queue_offer(self, now: float) -> None:
        cfg = self.config
        chunk = max_app_chunk(MsgType.OFFER)
        blob = cfg.app_blob
        parts = [blob[i : i + chunk] for i in range(0, len(blob), chunk)] or [b""]
        for index, part in enumerate(parts):
            # The receiver's budget runs from when it receives this OFFER.
            offer_bytes = 64 + len(part)
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
            )
            self._control.append(self.protector.seal(offer))
            self.datagrams_sent["control"] += 1
        self._offer_timer = now + cfg.offer_retry_s

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
            self._offer_confirmed = True
            self._offer_timer = None
            # ACCEPT carries the receiver's decoder span: how far past its prefix repairs may reach.
            self.planner.span = max(self.config.window_cap, min(message.window_cap, MAX_SPAN))
            self._fresh_plan = None
            self._events.append(Accepted(message.window_cap))
        elif isinstance(message, Refuse):
            self._fail_refused(message)
        elif isinstance(message, Result):
            self._on_result(message, now)
        elif isinstance(message, Close):
            if self.state not in (SenderState.DONE, SenderState.FAILED):
                self._fail(f"receiver closed the session ({message.code.name}): {message.text}")
        else:
            self._drop("unexpected_type")

    def _on_ack(self, ack: Ack, now: float) -> None:
        if self.state not in (SenderState.STREAMING, SenderState.DRAINING):
            return
        cpu = self.cpu
        t0 = cpu.clock() if cpu is not None else 0
        self._offer_confirmed = True
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
            self._plan_from_ack(ack)
        if sample_time >= 0:
            rtt = now - sample_time - ack.ack_delay_us * 1e-6
            if rtt > 0:
                view.rtt_estimate = rtt if view.rtt_estimate == 0 else 0.875 * view.rtt_estimate + 0.125 * rtt
        if cpu is not None:
            cpu.feedback_ns += cpu.clock() - t0
            cpu.acks += 1

    def _plan_from_ack(self, ack: Ack) -> None:
        self.planner.on_ack(
            ack.decoded_prefix,
            ack.holes,
            ack.hole_bits,
            ack.deficit,
            self.encoder.next_esi,
            self._rep_window,
            self._repairs_acked,
            self.view.repairs_sent,
        )

    def _on_result(self, result: Result, now: float) -> None:
        if self.state in (SenderState.DONE, SenderState.FAILED):
            return
        if result.part_index >= result.part_count:
            self._drop("bad_result_part")
            return
        self._result_parts[result.part_index] = bytes(result.app)
        if len(self._result_parts) < result.part_count:
            return
        blob = b"".join(self._result_parts[i] for i in range(result.part_count))
        self._control.append(self.protector.seal(Close(CloseCode.DONE, "")))
        self.datagrams_sent["control"] += 1
        self.state = SenderState.DONE
        self._result_timer = None
        self._offer_timer = None
        self._events.append(ResultReceived(result.decoded_count, blob))

    def _fail_refused(self, refuse: Refuse) -> None:
        if self.state in (SenderState.DONE, SenderState.FAILED):
            return
        self._events.append(Refused(int(refuse.code), refuse.text))
        self._fail(f"receiver refused the handoff ({refuse.code.name}): {refuse.text}")

    def _fail(self, reason: str) -> None:
        self.state = SenderState.FAILED
        self._burst_left = 0
        self._offer_timer = None
        self._result_timer = None
        self._events.append(Failed(reason))

    def _drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1
        self._events.append(DatagramDropped(reason))
