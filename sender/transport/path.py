"""A sender session's ACK intake: the plausibility check and the path estimates (sans-IO).

An ACK is first checked against what the session sent (``ack_plausible``); a crafted one is dropped before
anything reads it. A plausible ACK's cumulative counters give the loss rate and the mean loss-run length,
its feedback fields the scheduler's view of the receiver (deficit, unknowns), and its largest packet
number, through :class:`pfec.sender.transport.inflight.InFlight`, an RTT sample that ``PathEstimates`` smooths
(RFC 6298's 1/8 gain, and its variation at 1/4 for the probe timeout, :mod:`.probe`). The estimates
live where the policy reads them, in the session's ``SchedulerView``; the open-loop tail's loss rate
follows the same counters, and the rate controller (:mod:`.rate`) hears each new loss and delivery count
and every RTT sample.
"""

from __future__ import annotations

from pfec.common.sched.actions import SchedulerView
from pfec.common.sched.open_loop_tail import OpenLoopTail
from pfec.common.wire.messages import Ack
from pfec.sender.transport.rate import RateController

RTT_GAIN = 0.125  # weight of a new RTT sample in the smoothed estimate (RFC 6298's alpha)
_RTT_KEEP = 1.0 - RTT_GAIN  # 0.875, exactly
RTTVAR_GAIN = 0.25  # weight of a new sample's deviation in the RTT variation (RFC 6298's beta)


def ack_plausible(ack: Ack, sources_sent: int, packets_sealed: int) -> bool:
    """Whether an ACK's fields fit what the session sent: decoded prefix, seen end and decoded count
    within the sources sent, largest packet number and counters within the datagrams sealed, loss runs
    within the losses and the hole map's bits within its bytes."""
    return (
        ack.decoded_prefix <= sources_sent
        and ack.seen_end <= sources_sent
        and ack.decoded_count <= sources_sent
        and ack.largest_pn <= packets_sealed
        and ack.received <= packets_sealed
        and ack.lost <= packets_sealed
        and ack.loss_runs <= ack.lost
        and ack.hole_bits <= 8 * len(ack.holes)
    )


class PathEstimates:
    """The path as the ACKs measure it, written into the scheduler's view: loss, burst and RTT estimates,
    the receiver's reported deficit and unknowns, and when the decoded prefix last moved. New losses and
    every RTT sample also go to the rate controller."""

    __slots__ = ("ended", "last_prefix_change", "lost", "rate", "received", "rtt_var", "tail", "view")

    def __init__(self, view: SchedulerView, tail: OpenLoopTail, rate: RateController) -> None:
        self.view = view
        self.tail = tail  # its loss rate blends these counters with the prior
        self.rate = rate
        self.last_prefix_change = 0.0  # when the decoded prefix last advanced (the view's ack staleness)
        self.lost = 0  # the largest cumulative loss count any ACK reported
        self.received = 0  # the largest cumulative count of data datagrams received any ACK reported
        self.rtt_var = 0.0  # the RTT samples' smoothed mean deviation (RFC 6298's RTTVAR), seconds
        self.ended = False  # the session ended and wrote off what its receiver never counted

    def start(self, now: float) -> None:
        self.last_prefix_change = now

    def on_ack(self, ack: Ack, now: float, prefix_moved: bool, sample_time: float) -> None:
        """A plausible ACK's counters and feedback fields; ``sample_time``: the send time of the packet it
        newly acknowledges as its largest (-1: no RTT sample)."""
        if prefix_moved:
            self.last_prefix_change = now
        view = self.view
        view.feedback_seen = True
        view.deficit_reported = ack.deficit
        view.window_at_feedback = ack.unknowns
        lost = ack.lost
        seen = ack.received + lost
        if seen > 0:
            view.loss_estimate = lost / seen
        if ack.loss_runs > 0:
            view.burst_estimate = lost / ack.loss_runs
        self.tail.on_ack(lost, seen, view.burst_estimate)
        if sample_time >= 0:
            rtt = now - sample_time - ack.ack_delay_us * 1e-6
            if rtt > 0:  # the first sample sets the estimate, later ones move it by RTT_GAIN
                smoothed = view.rtt_estimate
                if smoothed == 0:
                    view.rtt_estimate, self.rtt_var = rtt, rtt / 2
                else:  # RFC 6298 2.3: the variation moves against the old estimate first
                    self.rtt_var += RTTVAR_GAIN * (abs(smoothed - rtt) - self.rtt_var)
                    view.rtt_estimate = _RTT_KEEP * smoothed + RTT_GAIN * rtt
                self.rate.on_rtt_measurement(now, rtt, sample_time)
        # The counts after the RTT sample: a round they close knows when its newest datagram was sent.
        if lost > self.lost:
            self.rate.on_packets_lost(now, lost - self.lost)
            self.lost = lost
        if ack.received > self.received:
            self.rate.on_packets_delivered(now, ack.received - self.received)
            self.received = ack.received

    def end(self, data_sent: int) -> None:
        """The session ended (done or failed; it reads no ACK after this): of its ``data_sent`` data
        datagrams, those no ACK counted as received or lost are written off the rate controller's count in
        flight, which other handoffs on the same path may share. Once."""
        if not self.ended:
            self.ended = True
            self.rate.write_off(max(0, data_sent - self.received - self.lost))

    @property
    def measured_loss(self) -> tuple[int, int]:
        """(lost, lost + received) by the newest ACK's counters (a reordered older ACK counts less)."""
        return self.tail.lost, self.tail.seen
