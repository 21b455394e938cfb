"""The controller's phases, STARTUP, DRAIN and CRUISE: what each paces at, and the one table of transitions.

- **STARTUP** paces at the rate it was told (or remembers) until the first sample, then at
  ``STARTUP_GAIN`` times the estimate: the rate doubles per round while the link keeps up. A link 4x
  faster than told is found in two or three round trips, not the hundreds additive increase would take.
- STARTUP ends (``PIPE_FULL``) after ``STARTUP_MISSES`` rounds in a row whose estimate grew less than
  ``STARTUP_GROWTH`` (BBR's full-pipe test: one short round may be a burst of channel loss or a lost ACK).
- It also ends (``QUEUE_BUILT``) on a round that grew a standing queue, or whose ACKs came
  ``STARTUP_GROWTH`` times more spread out than its datagrams were sent: the link is slower than the pace.
  The second test holds only on a queue that was empty when the handoff began.
- A handoff that joined another flow's queue keeps doubling instead: that flow's datagrams spread its
  ACKs, and stopping there leaves a loss-based neighbour most of the link.
- **DRAIN** paces at ``DRAIN_GAIN`` of the estimate until the queue is gone. While the queue stands the
  link stays busy, so draining fast costs no delivery.
- **CRUISE** paces at the estimate in cycles of ``PROBE_GAINS``, one round each: probe, drain what the
  probe queued, cruise. The probe adds ``PROBE_STEP_PACKETS`` per min RTT: additive, so a bigger flow
  probes no harder than a smaller one.
- A probe that raised the estimate is repeated at once with twice the step (a link that speeds up is found
  in a few rounds), up to ``PROBE_MAX_GAIN`` of the estimate.
- Two CRUISE rounds in a row with a standing queue (``QUEUE_STOOD``) cut the estimate to ``STANDING_CUT``
  of itself and drain. Flows sharing the queue see it together, so their cuts are in step, and additive
  increase with multiplicative decrease converges to equal shares (Chiu and Jain).
- If the delivery rate while the queue stood is below ``LINK_SLOWED`` of the estimate, the cut starts
  from it: a link that slowed is followed at once. That drain ends in STARTUP (``DRAINED_LINK_FELL``), which
  finds the rate again when the link returns.
- A congestion cut (``CONGESTED``, see :mod:`.congestion`) restarts the probe cycle at a cruise round, and
  a controller idle for a while (``IDLE``) starts its next handoff in STARTUP.
"""

from __future__ import annotations

from enum import Enum
from typing import Final

from pfec.sender.transport.path_rate.delivery import DeliveryRate, RoundSample
from pfec.sender.transport.path_rate.rtt import MIN_ROUND_S, RttEstimate

STARTUP_GAIN: Final = 2.0  # STARTUP paces at this times the estimate (BBR's 2.885 queued more)
STARTUP_GROWTH: Final = 1.25  # a STARTUP round whose estimate grew less than this ...
STARTUP_MISSES: Final = 3  # ... this many times in a row: the pipe is full (BBR's full-bandwidth test)
DRAIN_GAIN: Final = 0.5  # while a queue stands the link stays busy: draining it fast costs no delivery
PROBE_GAINS: Final = (1.0, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)  # round 0 adds the probe step to its 1.0
PROBE_STEP_PACKETS: Final = 16  # the probe's first step: this many datagrams more per min RTT (additive) ...
PROBE_MAX_DOUBLINGS: Final = 10  # ... doubled after each probe that found the link faster, up to 2^this
PROBE_MAX_GAIN: Final = 1.25  # ... but never above this times the estimate (BBR's probe gain)
PROBE_FOUND: Final = 1.02  # a probe found room when the estimate rose by this factor and half the step
STANDING_CUT: Final = 0.85  # a standing queue in CRUISE cuts the estimate by this (the AIMD decrease) ...
LINK_SLOWED: Final = 0.5  # ... of the delivery rate while it stood, if below this share of the estimate
CRUISE_AFTER_CUT: Final = 2  # the probe cycle's index after a cut or a drain (no probe right away)
STANDING_ROUNDS: Final = 2  # rounds in a row with a standing queue before CRUISE cuts


class Phase(Enum):
    STARTUP = "startup"
    DRAIN = "drain"
    CRUISE = "cruise"


class PhaseEvent(Enum):
    """What a round (or an idle spell) can tell the phases."""

    CONGESTED = "congested"  # the congestion rule cut the estimate
    QUEUE_BUILT = "queue built"  # STARTUP: a round grew a standing queue, or the link spread its ACKs out
    PIPE_FULL = "pipe full"  # STARTUP: the estimate stopped growing
    QUEUE_STOOD = "queue stood"  # CRUISE: a queue stood for STANDING_ROUNDS (the estimate was cut)
    DRAINED = "drained"  # DRAIN: the queue is gone, or the time it needed is up
    DRAINED_LINK_FELL = "drained, link fell"  # ... after a cut for a link that fell below LINK_SLOWED
    IDLE = "idle"  # a new handoff after an idle spell


# The one place that says what can follow what. DRAIN has no CONGESTED: the rule is silent while draining.
TRANSITIONS: Final[dict[tuple[Phase, PhaseEvent], Phase]] = {
    (Phase.STARTUP, PhaseEvent.QUEUE_BUILT): Phase.DRAIN,
    (Phase.STARTUP, PhaseEvent.PIPE_FULL): Phase.DRAIN,
    (Phase.STARTUP, PhaseEvent.CONGESTED): Phase.CRUISE,
    (Phase.STARTUP, PhaseEvent.IDLE): Phase.STARTUP,
    (Phase.DRAIN, PhaseEvent.DRAINED): Phase.CRUISE,
    (Phase.DRAIN, PhaseEvent.DRAINED_LINK_FELL): Phase.STARTUP,
    (Phase.DRAIN, PhaseEvent.IDLE): Phase.STARTUP,
    (Phase.CRUISE, PhaseEvent.QUEUE_STOOD): Phase.DRAIN,
    (Phase.CRUISE, PhaseEvent.CONGESTED): Phase.CRUISE,
    (Phase.CRUISE, PhaseEvent.IDLE): Phase.STARTUP,
}

# After these, losses within a smoothed RTT answer the cut or the overshoot: no new congestion cut.
QUIETING: Final = frozenset({PhaseEvent.CONGESTED, PhaseEvent.QUEUE_BUILT, PhaseEvent.PIPE_FULL,
                             PhaseEvent.QUEUE_STOOD})


class Phases:
    """The phase, the probe cycle and the state each phase's tests keep across rounds."""

    __slots__ = ("_datagram_bytes", "_delivery", "_rtt", "cycle", "drain_until", "full_bw", "missed", "phase",
                 "probe_doublings", "probe_from", "refind", "standing", "standing_rate")

    def __init__(self, rtt: RttEstimate, delivery: DeliveryRate, datagram_bytes: int) -> None:
        self._rtt, self._delivery, self._datagram_bytes = rtt, delivery, datagram_bytes
        self.phase = Phase.STARTUP
        self.cycle = 0  # the probe cycle's round (an index into PROBE_GAINS)
        self.probe_doublings = 0
        self.probe_from = 0.0  # the estimate when the newest probe began
        self.full_bw = 0.0  # STARTUP: the estimate the last growing round reached
        self.missed = 0  # consecutive STARTUP rounds whose estimate did not grow
        self.drain_until = 0.0  # DRAIN ends then (or once the queue is gone)
        self.standing = 0  # consecutive CRUISE rounds with a standing queue
        self.standing_rate = 0.0  # the largest delivery-rate sample of those rounds (the link was busy)
        self.refind = False  # the drain ends in STARTUP (the link had slowed to below LINK_SLOWED)

    def on_round(self, now: float, sample: RoundSample, congested: bool,
                 pace_bps: float) -> tuple[float, PhaseEvent | None]:
        """The pace after a closed round (``pace_bps`` if unchanged), and the round's event, if any."""
        if congested:
            event: PhaseEvent | None = PhaseEvent.CONGESTED
        elif self.phase is Phase.STARTUP:
            rtt = self._rtt
            if rtt.queue_delay_s > rtt.standing_queue_s() or self._link_limited(sample):
                event = PhaseEvent.QUEUE_BUILT
            elif sample.app_limited:
                return pace_bps, None  # nothing learnt about the link's ceiling
            elif self._still_growing():
                return self._delivery.clamp(STARTUP_GAIN * self._delivery.estimate_bps), None
            else:
                event = PhaseEvent.PIPE_FULL
        elif self.phase is Phase.DRAIN:
            drained = self._rtt.standing_delay_s <= self._rtt.congested_queue_s() or now >= self.drain_until
            event = (PhaseEvent.DRAINED_LINK_FELL if self.refind else PhaseEvent.DRAINED) if drained else None
        else:
            event = self._cruise_round(sample)
        if event is not None:
            self._enter(event)
            if self.phase is Phase.DRAIN:  # as long as the round's queue takes to empty, one round at least
                rtt = self._rtt
                self.drain_until = now + max(rtt.round_len_s, rtt.queue_delay_s / (1 - DRAIN_GAIN))
        return self._delivery.clamp(self._cycle_rate()), event

    def restart(self) -> None:
        """A new handoff after an idle spell."""
        self._enter(PhaseEvent.IDLE)

    def _enter(self, event: PhaseEvent) -> None:
        self.phase = TRANSITIONS[(self.phase, event)]
        if event is PhaseEvent.CONGESTED:
            self.cycle, self.probe_doublings, self.refind = CRUISE_AFTER_CUT, 0, False
        elif event is PhaseEvent.QUEUE_BUILT or event is PhaseEvent.PIPE_FULL:
            self.refind = False  # STARTUP found the rate: the drain ends in CRUISE
        elif event is PhaseEvent.DRAINED:
            self.cycle = CRUISE_AFTER_CUT
        elif event is PhaseEvent.DRAINED_LINK_FELL:  # ``refind`` stays set: an LTE cell's bursts spread ACKs
            self.cycle, self.missed, self.full_bw = CRUISE_AFTER_CUT, 0, 0.0
        elif event is PhaseEvent.IDLE:
            self.missed, self.full_bw, self.probe_doublings = 0, 0.0, 0
        # QUEUE_STOOD: ``_cruise_round`` cut the estimate and set ``refind``

    def _link_limited(self, sample: RoundSample) -> bool:
        """The link spread the round's datagrams out: it delivers slower than they were sent (a start told
        too much). Not on a joined queue, nor while refinding a link that fell (its bursts spread ACKs)."""
        return (sample.ack_span_s > STARTUP_GROWTH * sample.send_span_s and self._rtt.joined is False
                and not self.refind)

    def _still_growing(self) -> bool:
        """BBR's full-pipe test. The estimate is a max filter: a round that lost a burst to the channel, or
        whose ACKs were lost (the next ones carry the count), does not lower it."""
        estimate = self._delivery.estimate_bps
        if estimate >= STARTUP_GROWTH * self.full_bw:
            self.full_bw, self.missed = estimate, 0
        else:
            self.missed += 1
        return self.missed < STARTUP_MISSES

    def _cruise_round(self, sample: RoundSample) -> PhaseEvent | None:
        """A standing queue for STANDING_ROUNDS: cut the estimate (multiplicative decrease) and drain. Else
        the probe cycle's next round; a probe that found the link faster is repeated with twice the step."""
        rtt, delivery = self._rtt, self._delivery
        if rtt.standing_delay_s > rtt.standing_queue_s():
            self.standing += 1
            self.standing_rate = max(self.standing_rate, sample.rate_bps)
        else:
            self.standing, self.standing_rate = 0, 0.0
        if self.standing >= STANDING_ROUNDS:
            # While the queue stood the link was busy: what it delivered is its rate (our share of it). The
            # max filter still holds the rate before a link slowed down; a cut from that leaves the queue.
            slowed = self.standing_rate < LINK_SLOWED * delivery.estimate_bps
            delivery.restart_from(STANDING_CUT * (self.standing_rate if slowed else delivery.estimate_bps))
            self.standing = self.probe_doublings = 0
            self.standing_rate = 0.0
            # A link that fell this far (an LTE cell's outage) comes back as fast: after the drain, find
            # its rate as a start does, not by additive probes from the outage's rate.
            self.refind = slowed
            return PhaseEvent.QUEUE_STOOD
        if self.cycle == 1:  # the probe's round trip is back: this round's sample saw it
            # Room, not a share taken: the probe raised the estimate with no queue above the base RTT (a
            # loss-based neighbour's standing queue hides from the recent floor, not from the base).
            found = delivery.estimate_bps > PROBE_FOUND * self.probe_from + self._probe_step_bps() / 2
            if found and rtt.queue_above_base_s() <= rtt.congested_queue_s():
                self.probe_doublings = min(self.probe_doublings + 1, PROBE_MAX_DOUBLINGS)
                self.cycle = len(PROBE_GAINS) - 1  # the next round probes again
            else:
                self.probe_doublings = 0
        self.cycle = (self.cycle + 1) % len(PROBE_GAINS)
        if self.cycle == 0:
            self.probe_from = delivery.estimate_bps
        return None

    def _cycle_rate(self) -> float:
        estimate = self._delivery.estimate_bps
        if self.phase is Phase.DRAIN:
            return DRAIN_GAIN * estimate
        rate = PROBE_GAINS[self.cycle] * estimate
        if self.phase is Phase.CRUISE and self.cycle == 0:
            # The doubled step stops at PROBE_MAX_GAIN of the estimate: on a bursty link (LTE) probe after
            # probe finds room, and an unbounded step reached 6x the estimate.
            step = self._probe_step_bps()
            room = max(step, (PROBE_MAX_GAIN - 1) * estimate)
            rate += min(step * 2 ** self.probe_doublings, room)
        return rate

    def _probe_step_bps(self) -> float:
        return PROBE_STEP_PACKETS * 8 * self._datagram_bytes / max(self._rtt.round_len_s, MIN_ROUND_S)
