"""A sender session's send path (sans-IO): the data datagrams, and where each repair's window goes.

Sources go out in ESI order, sealed from the session's rows. A repair covers the window the repair planner
(:mod:`.repair_plan`) picks for the decision (``plan_epoch``: reused by the burst's first
repair, planned again for the next), or, when the burst is the open-loop tail's
(:mod:`pfec.common.sched.open_loop_tail`), a window over the tail's sources. Every datagram leaves its
record in :class:`pfec.sender.transport.inflight.InFlight` and is reported to the rate controller.

The planner's side of the path lives here too: the receiver's decoder span (its ACCEPT grants it), whether
the newest ACK says its decoder stalled, and the ACKs' hole maps (``on_ack``). An open-loop policy (a
fixed-rate code) needs no deficit for a repair and its repairs cover the newest window: its planner takes
the ACKs' prefix but not their hole maps, and moves to the window at the prefix only while an ACK reports
the receiver's decoder stalled (undecoded range past its span: a newer window would be refused).

Runs per datagram: no allocation beyond the datagram itself, every buffer preallocated.

``Epochs`` decides, between bursts, what the next one is: an owed probe (:mod:`.probe`), the open-loop
tail's credit, the policy's action, or a repair in a slot that would idle; or that the session stops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, TypeAlias

import numpy as np
import numpy.typing as npt

from pfec.common.codec.fec import Encoder, FecError
from pfec.common.events import CpuMeter
from pfec.common.sched.actions import REPAIR_SIZES, SOURCE_BURST, Action, SchedulerView
from pfec.common.sched.open_loop_tail import FEEDBACK_RTTS, OpenLoopTail
from pfec.common.sched.policies import Policy
from pfec.common.wire.messages import Ack
from pfec.common.wire.seal import PacketProtector
from pfec.sender.transport.completion import done_reason
from pfec.sender.transport.inflight import InFlight
from pfec.sender.transport.path import PathEstimates
from pfec.sender.transport.probe import ProbeTimer
from pfec.sender.transport.rate import RateController
from pfec.sender.transport.repair_plan import RESEND_RTTS, SEEN_MIN_S, SEEN_RTTS, Plan, RepairPlanner
from pfec.sender.transport.session_types import MAX_SPAN, SenderConfig, UtilityFeatures
from pfec.sender.transport.states import Event


class SendPath:
    """Makes one session's source and repair datagrams and keeps the repair planner fed."""

    __slots__ = (
        "_repair_buf",
        "_src_pn",
        "_src_time",
        "_symbols",
        "cpu",
        "datagrams_sent",
        "encoder",
        "fill_burst",
        "fresh_plan",
        "inflight",
        "open_loop",
        "planner",
        "planner_loss",
        "proactive",
        "probe_burst",
        "protector",
        "rate",
        "repairs_filled",
        "repairs_skipped",
        "span",
        "stalled",
        "strict",
        "tail",
        "tail_burst",
        "tail_first",
        "tail_width",
        "view",
        "window_cap",
    )

    def __init__(self, config: SenderConfig, symbols: npt.NDArray[np.uint8], encoder: Encoder,
                 protector: PacketProtector, view: SchedulerView, inflight: InFlight, tail: OpenLoopTail,
                 open_loop: bool, rate: RateController, cpu: CpuMeter | None) -> None:
        self._symbols = symbols  # the encoder's rows (a split reorders the unsent ones in place)
        self.encoder = encoder
        self.protector = protector
        self.view = view
        self.inflight = inflight
        self._src_pn, self._src_time = inflight.src_pn, inflight.src_time  # its source rows, per datagram
        self.tail = tail
        self.rate = rate  # told of every data datagram
        self.cpu = cpu
        self.window_cap = config.window_cap
        self.strict = config.window_cap_strict
        self.planner = RepairPlanner(config.window_cap, config.window_cap, config.target_nonzeros,
                                     config.fixed_dt)
        self.open_loop = open_loop
        self.span = config.window_cap  # the receiver's decoder span (its ACCEPT says it)
        if open_loop:  # until an ACK says the receiver's decoder is stalled: the newest window
            self.planner.span = MAX_SPAN
        self.stalled = False  # the newest ACK's undecoded range outgrew the receiver's span
        # The tail's repairs: every source sent in the tail (from ``tail_first``), ``tail_width`` wide, as
        # wide as the decoder holds (its granted span once the ACCEPT says it, unless the cap was
        # configured; the window cap, the least any receiver grants, before). One code over the whole tail
        # rather than over the newest window: the decoder then recovers the tail's sources in order as long
        # as the repairs sent after any point outnumber the losses after it, so a burst that outruns a
        # window's repairs is paid for by the surplus of the repairs after it, instead of leaving every
        # overlapping window (the most useful sources first, in utility order) undecodable. Its sources are
        # known to the receiver (received or not) from the start of the tail, so an undecoded hole costs no
        # more than in a narrower window.
        self.tail_first = -1  # the first source sent in the tail (-1: none yet)
        self.tail_width = config.window_cap
        self.tail_burst = False  # the current burst is the tail's open-loop repair
        self.probe_burst = False  # the current burst is a probe (:mod:`.probe`)
        self.fill_burst = False  # the current burst fills a slot that would idle (``take_fill``)
        self.proactive = False  # near the deadline: repairs may also protect the newest sources
        self.planner_loss = 0.0  # the loss the planner discounts repairs in flight by (``plan_epoch``)
        # The decision's repair plan, until an ACK or a sent repair changes the planner's state: the first
        # repair of a burst uses it rather than planning again.
        self.fresh_plan: Plan | None = None
        self._repair_buf = np.empty(encoder.symbol_size, dtype=np.uint8)
        self.datagrams_sent = {"source": 0, "repair": 0, "control": 0}
        self.repairs_skipped = 0  # repairs a burst could not make (its window emptied under it)
        self.repairs_filled = 0  # fill bursts taken: repairs in slots that would have idled

    # ------------------------------------------------------------ decision epochs
    def plan_epoch(self, next_esi: int, loss: float, rtt: float, time_left: float,
                   since_start: float | None) -> None:
        """A decision epoch's repair plan and the view's repair features (window, effectiveness, deficit).

        ``since_start``: the time since the start while no RTT sample exists yet (None once one does)."""
        view = self.view
        # Proactive repair only pays when feedback about the newest sources cannot return in time.
        proactive = rtt > 0 and time_left < FEEDBACK_RTTS * rtt
        self.tail.update(time_left, rtt, since_start)
        self.proactive = proactive
        # Repairs in flight count as arriving until a lost one could no longer be replaced (RESEND_RTTS).
        self.planner_loss = loss if proactive or time_left < RESEND_RTTS * rtt else 0.0
        plan = self.fresh_plan = self.planner.plan(next_esi, self.planner_loss, proactive)
        view.window_size = plan.nss
        view.repair_effectiveness = plan.effectiveness
        view.deficit_estimate = plan.reactive_need
        if proactive:
            view.deficit_estimate += self.planner.proactive_need(next_esi, self.inflight.acked_source_end,
                                                                 loss)

    def take_tail_repair(self) -> bool:
        """Whether the next burst is one open-loop repair of the tail (its credit goes before the policy)."""
        tail, view = self.tail, self.view
        self.probe_burst = self.fill_burst = False
        self.tail_burst = burst = (
            tail.active and view.repairs_left > 0 and view.sources_sent > 0 and tail.take()
        )
        return burst

    def take_probe(self) -> None:
        """The next burst is a probe: a repair where the receiver lacks most, every repair in flight
        counted as lost (the feedback it waits on did not come), else over the newest window."""
        self.probe_burst = True
        self.tail_burst = self.fill_burst = False

    def take_fill(self) -> None:
        """The next burst fills a slot that would idle while the receiver lacks symbols (the whole deadline
        is the budget): a repair for the region that lacks most even though the repairs in flight cover
        it in expectation, or over the newest window when no region is open."""
        self.fill_burst = True
        self.tail_burst = self.probe_burst = False
        self.repairs_filled += 1

    # ------------------------------------------------------------------- sending
    @property
    def data_sent(self) -> int:
        """Source and repair datagrams sealed: every one the rate controller was told of."""
        return self.datagrams_sent["source"] + self.datagrams_sent["repair"]

    def source(self, now: float) -> bytes:
        """The next source symbol's datagram."""
        esi = self.encoder.take_source()
        protector = self.protector
        datagram = protector.seal_source(esi, self._symbols[esi].data)
        self._src_pn[esi] = protector.packets_sealed  # the in-flight records' row, written in place
        self._src_time[esi] = now
        self.datagrams_sent["source"] += 1
        tail = self.tail
        if tail.active:  # in the tail: its credit accrues per source
            if self.tail_first < 0:
                self.tail_first = esi
            tail.on_source()
        self.rate.on_packet_sent(now, len(datagram))
        return datagram

    def repair(self, now: float) -> bytes | None:
        """A repair datagram over the burst's window; None when no repair can be made (its window emptied
        under the burst, or no coefficient row was usable): counted in ``repairs_skipped``."""
        cpu = self.cpu
        t0 = cpu.clock() if cpu is not None else 0
        planner = self.planner
        plan = self.fresh_plan
        next_esi = self.encoder.next_esi
        if self.tail_burst:  # open loop: the newest window, as far as a stalled receiver's span allows
            plan = planner.plan_newest(next_esi, self.tail.loss, self.span if self.stalled else MAX_SPAN,
                                       max(0, self.tail_first), self.tail_width)
        elif self.probe_burst:
            plan = planner.plan(next_esi, 1.0, True)
        elif self.fill_burst:
            plan = planner.plan(next_esi, self.planner_loss, self.proactive, True)
        elif plan is None:
            plan = planner.plan(next_esi, self.planner_loss, self.proactive)
        self.fresh_plan = None  # planner.sent() below changes what the next repair serves
        first, count, region = plan.first, plan.nss, plan.region
        if count <= 0 or first < 0 or first + count > next_esi:
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
        protector = self.protector
        datagram = protector.seal_repair(rid.repair_key, rid.dt, rid.nss, rid.fss_esi, self._repair_buf.data)
        view = self.view
        sent = view.repairs_sent
        inflight = self.inflight  # its rows, written in place
        inflight.rep_pn[sent] = protector.packets_sealed
        inflight.rep_time[sent] = now
        inflight.rep_window[sent] = (first, first + count)
        view.repairs_left -= 1
        view.repairs_sent = sent + 1
        self.datagrams_sent["repair"] += 1
        self.rate.on_packet_sent(now, len(datagram))
        return datagram

    # ------------------------------------------------------------------ feedback
    def on_accept(self, granted_span: int) -> None:
        """The ACCEPT's decoder span: how far past its prefix repairs may reach (at least the window cap,
        at most an RFC 8681 window)."""
        self.span = max(self.window_cap, min(granted_span, MAX_SPAN))
        if not self.open_loop:
            self.planner.span = self.span
        if not self.strict:
            self.tail_width = self.span
        self.fresh_plan = None

    def on_ack(self, ack: Ack, now: float, current: bool) -> None:
        """A plausible ACK (its in-flight counts already applied); ``current``: its prefix is the encoder's,
        so its hole map is the newest and the planner regroups the holes. Called before the ACK's RTT
        sample moves the estimate: the repairs it has seen count back by the estimate it was sent under."""
        self.fresh_plan = None  # the ACK moves the planner and the loss estimate
        if not current:
            return
        open_loop = self.open_loop  # a fixed-rate code takes the prefix (the encoder's window), no holes
        self.stalled = ack.seen_end - ack.decoded_prefix > self.span
        if open_loop:
            # Its repairs cover the newest window, unless the receiver reports its decoder stalled (a loss
            # no repair reached holds the prefix and the undecoded range outgrew the span: it refuses
            # windows past prefix + span); then the window at the prefix, the only one that can move it.
            self.planner.span = self.window_cap if self.stalled else MAX_SPAN
        inflight = self.inflight
        self.planner.on_ack(
            ack.decoded_prefix,
            b"" if open_loop else ack.holes,
            0 if open_loop else ack.hole_bits,
            0 if open_loop else ack.deficit,
            self.encoder.next_esi,
            inflight.rep_window,
            inflight.repairs_acked,
            self.view.repairs_sent,
            inflight.rep_time,
            now - max(SEEN_RTTS * self.view.rtt_estimate, SEEN_MIN_S),
            # Sources past the receiver's seen end, sent before the packet it names as its largest: lost
            # (a lost last source leaves no hole in the map, and the receiver saw no deficit).
            0 if open_loop else ack.seen_end,
            0 if open_loop else min(inflight.acked_source_end, ack.decoded_prefix + self.planner.span),
        )


Burst: TypeAlias = tuple[Action, int]  # the action and how many datagrams it sends
ONE_REPAIR: Final[Burst] = (Action.REPAIR_1, 1)


class Epochs:
    """A session's decision epochs: between bursts, refresh the scheduler's view from its own sends and
    the newest ACK, then choose the next burst, or find that the session stops sending (an event it
    ``fire``s at the session's table: :mod:`.states`)."""

    __slots__ = ("config", "cpu", "encoder", "fire", "inflight", "path", "policy", "probe", "rate",
                 "send_path", "utility_features", "view")

    def __init__(self, config: SenderConfig, send_path: SendPath, policy: Policy, probe: ProbeTimer,
                 path: PathEstimates, utility_features: UtilityFeatures | None,
                 fire: Callable[[Event, float, object], bool]) -> None:
        self.config = config
        self.send_path = send_path
        self.view = send_path.view
        self.encoder = send_path.encoder
        self.inflight = send_path.inflight
        self.rate = send_path.rate
        self.cpu = send_path.cpu
        self.policy = policy
        self.probe = probe
        self.path = path
        self.utility_features = utility_features
        self.fire = fire

    def slots_left(self, now: float, send_deadline: float) -> int:
        """Slots before the send deadline, counted at the rate forecast, not the rate paced at."""
        return max(0, int((send_deadline - now) / self.rate.plan_slot_s))

    def decide(self, now: float, start: float, send_deadline: float, accepted: bool) -> Burst | None:
        """The next burst (None: nothing to send now). ``accepted``: the receiver's ACCEPT came."""
        cpu = self.cpu
        t0 = cpu.clock() if cpu is not None else 0
        self._refresh_view(now, start, send_deadline)
        if (broken := self.rate.breaker(now)) is not None:  # RFC 8084: the path stopped delivering
            self.fire(Event.PATH_BROKEN, now, broken)
            return None
        if self.view.slots_left == 0:
            self.fire(Event.NO_SLOT_LEFT, now, None)
            return None
        burst = self._choose(now, accepted)
        if burst is not None and cpu is not None:
            cpu.policy_ns += cpu.clock() - t0
            cpu.decisions += 1
        return burst

    def _choose(self, now: float, accepted: bool) -> Burst | None:
        view, send_path = self.view, self.send_path
        # An owed probe goes first, then the open-loop tail's credit: one repair each (over what the
        # receiver lacks most, over the newest window). The policy decides the rest.
        if view.repairs_left > 0 and self.probe.take():
            send_path.take_probe()
            return ONE_REPAIR
        if send_path.take_tail_repair():
            return ONE_REPAIR
        if not view.update_mask():
            return self._nothing_allowed(now, accepted)
        action = self.policy.decide(view)
        if not view.mask[action]:
            raise ValueError(f"policy {self.policy.name!r} chose masked action {action.name}")
        if action is Action.SOURCE:
            return action, min(SOURCE_BURST, view.sources_left, view.slots_left)
        return action, REPAIR_SIZES[action]

    def _nothing_allowed(self, now: float, accepted: bool) -> Burst | None:
        """The masks allow nothing (every source sent, no deficit left): done (say so and stop), fill the
        slot with a repair (the whole deadline is the budget), or wait for feedback."""
        reason = done_reason(self.view, self.encoder.ack_prefix, self.policy.sends_repairs)
        if reason is not None and self.fire(Event.FINISHED, now, reason):  # the table: not before the ACCEPT
            return None
        if not (accepted and self._may_fill()):
            return None
        self.send_path.take_fill()
        return ONE_REPAIR

    def _may_fill(self) -> bool:
        """Whether a slot that would idle carries a repair: the whole deadline is the budget, the policy
        repairs closed loop, and the newest ACK names symbols the receiver lacks (hole regions). Not on
        sources merely unacknowledged yet: repairs filling a clean link's last round trip cost sender CPU
        and receiver lateness for nothing; a lost tail is the probe timeout's."""
        view = self.view
        return (
            self.config.fill_idle
            and not view.open_loop
            and view.repairs_left > 0
            and self.send_path.planner.regions > 0
        )

    def _refresh_view(self, now: float, start: float, send_deadline: float) -> None:
        view = self.view
        enc = self.encoder
        next_esi = enc.next_esi
        view.now = now
        view.sources_sent = next_esi
        slots_left = view.slots_left = self.slots_left(now, send_deadline)
        view.acked_prefix = enc.ack_prefix
        view.ack_staleness = now - self.path.last_prefix_change
        inflight = self.inflight
        view.repairs_in_flight = view.repairs_sent - inflight.repairs_acked
        view.sources_in_flight = next_esi - inflight.acked_source_end
        rtt = view.rtt_estimate
        since_start = None if rtt > 0 else now - start  # no RTT sample: no ACK yet
        self.send_path.plan_epoch(next_esi, view.loss_estimate, rtt, slots_left * self.rate.plan_slot_s,
                                  since_start)
        if self.utility_features is not None:
            self.utility_features.write(view, next_esi)
