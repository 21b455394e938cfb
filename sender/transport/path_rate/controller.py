"""``PathRate``: the sender's rate controller (sans-IO), composed of the parts in this package.

Each ACK brings an RTT sample (:mod:`.rtt`) and the receivers' counts. Every min RTT a round closes with
one delivery-rate sample (:mod:`.delivery`). The round feeds, in this order: the circuit breaker's loss
window (:mod:`.breaker`), the max filter's estimate, the congestion rule (:mod:`.congestion`), the
random-loss floor, the phases (:mod:`.phases`), the forecast (:mod:`.forecast`) and the window cap
(:mod:`.caps`). Between rounds only counters move, and each ACK updates the delivery cap.

One controller may serve several sessions to one receiver (they share the uplink): every hook takes counts
(deltas), so each session reports its own growth and the controller sums them. A session that ends writes
off what it sent and its receiver never counted (``write_off``): those datagrams leave the flight.
A controller idle for ``RESTART_IDLE_S`` starts its next handoff in STARTUP from the estimate it remembers.
"""

from __future__ import annotations

import math
from typing import Final

from pfec.sender.transport.path_rate.breaker import CircuitBreaker
from pfec.sender.transport.path_rate.caps import TRICKLE_GAIN, InFlightCaps
from pfec.sender.transport.path_rate.congestion import CongestionRule
from pfec.sender.transport.path_rate.delivery import BTL_ROUNDS, DeliveryRate
from pfec.sender.transport.path_rate.forecast import FORECAST_ROUNDS, Forecast
from pfec.sender.transport.path_rate.phases import QUIETING, Phase, Phases
from pfec.sender.transport.path_rate.rtt import RttEstimate

RESTART_IDLE_S: Final = 1.0  # a send after this long idle starts a new handoff in STARTUP


class PathRate:
    """A delivery-rate and min-RTT rate controller for one path (after BBR, draft-ietf-ccwg-bbr, with what a
    deadline stream needs). It plugs into :mod:`pfec.sender.transport.rate`'s seam; the link adapters pace
    at ``pacing_bps`` and the session plans on ``plan_slot_s``."""

    __slots__ = (
        "_breaker", "_capped", "_caps", "_congestion", "_delivered", "_delivery", "_forecast", "_lost",
        "_packets_sent", "_phases", "_reported_lost", "_rtt", "bytes_sent", "datagram_bytes",
        "last_delivery_at", "last_sent_at", "pace_bps", "rounds", "sending_since", "sent_since_delivery",
        "start_bps",
    )

    def __init__(self, start_bps: float, datagram_bytes: int, *, max_bps: float | None = None,
                 loss_prior: float = 0.0, rtt_prior_s: float = 0.1) -> None:
        if not (math.isfinite(start_bps) and start_bps > 0):
            raise ValueError(f"the starting rate must be a positive number of bit/s, got {start_bps!r}")
        if datagram_bytes <= 0:
            raise ValueError(f"datagram_bytes must be positive, got {datagram_bytes!r}")
        if max_bps is not None and not (math.isfinite(max_bps) and max_bps > 0):
            raise ValueError(f"max_bps must be a positive number of bit/s, got {max_bps!r}")
        self.datagram_bytes = datagram_bytes  # a full-size data datagram: what a slot carries
        self._rtt = RttEstimate(rtt_prior_s)
        self._delivery = DeliveryRate(start_bps, max_bps, loss_prior, max(BTL_ROUNDS, FORECAST_ROUNDS))
        self.start_bps = self._delivery.estimate_bps
        self.pace_bps = self.start_bps  # the phase's rate (``pacing_bps`` adds the in-flight caps)
        self._phases = Phases(self._rtt, self._delivery, datagram_bytes)
        self._congestion = CongestionRule()
        self._forecast = Forecast(self.start_bps)
        self._breaker = CircuitBreaker()
        self._capped = False  # a datagram of this round left under an in-flight cap (not app-limited)
        self.rounds = 0
        self.bytes_sent = 0
        self.last_sent_at = -math.inf
        self.sending_since: float | None = None  # the first data datagram since the start or an idle restart
        self.last_delivery_at: float | None = None  # None until the path first delivers
        self.sent_since_delivery = 0
        self._packets_sent = 0
        self._delivered = 0  # cumulative data datagrams the receivers counted
        self._lost = 0
        self._reported_lost = 0  # what the receivers counted lost (``_lost`` less write-offs)
        self._caps = InFlightCaps(self._rtt, self._delivery, self._phases, datagram_bytes, self.pace_bps)

    # ------------------------------------------------------------------ what the session and adapters read
    @property
    def pacing_bps(self) -> float:
        """The rate to send at now: the phase's, down to a trickle while more is in flight than the caps
        allow. They bound what is sent before feedback says how fast the path is (a start told far too
        much above all). Read per datagram."""
        if self._packets_sent - self._delivered - self._lost < self._caps.limit:
            return self.pace_bps
        self._capped = True
        return self.pace_bps * TRICKLE_GAIN

    @property
    def slot_s(self) -> float:
        """Link time of one full-size datagram at the pacing rate."""
        return self.datagram_bytes * 8 / self.pacing_bps

    @property
    def plan_slot_s(self) -> float:
        """The same at the cautious forecast (the session counts the slots before its deadline in it)."""
        return self.datagram_bytes * 8 / self._forecast.bps

    @property
    def forecast_bps(self) -> float:
        return self._forecast.bps

    def breaker(self, now: float) -> str | None:
        """Why the path is given up (sticky), or None while it delivers."""
        return self._breaker.check(now, self.last_delivery_at, self.sent_since_delivery, self._rtt.srtt)

    # ------------------------------------------------------------------ the parts' state, read-only
    @property
    def estimate_bps(self) -> float:
        """The bottleneck rate: the max filter's value, or a cut's."""
        return self._delivery.estimate_bps

    @property
    def max_bps(self) -> float | None:
        return self._delivery.max_bps

    @property
    def loss_floor(self) -> float:
        return self._delivery.loss_floor

    @property
    def phase(self) -> Phase:
        return self._phases.phase

    @property
    def min_rtt(self) -> float:
        return self._rtt.min_rtt

    @property
    def min_rtt_at(self) -> float:
        return self._rtt.min_rtt_at

    @property
    def srtt(self) -> float:
        return self._rtt.srtt

    @property
    def queue_delay_s(self) -> float:
        """The newest round's smallest RTT above the min RTT."""
        return self._rtt.queue_delay_s

    @property
    def congestion_events(self) -> int:
        return self._congestion.events

    @property
    def breaker_reason(self) -> str | None:
        return self._breaker.reason

    # ------------------------------------------------------------------ what the session reports
    def on_packet_sent(self, now: float, size: int) -> None:
        if now - self.last_sent_at > RESTART_IDLE_S and self._packets_sent > 0:
            self._restart()
        if self.sending_since is None:
            self.sending_since = now
        self.last_sent_at = now
        self.bytes_sent += size
        self._packets_sent += 1
        self.sent_since_delivery += 1

    def on_packets_acked(self, now: float, count: int) -> None:
        pass  # delivery comes from the receiver's counters (on_packets_delivered), not from coverage

    def on_packets_lost(self, now: float, count: int) -> None:
        self._lost += count
        self._reported_lost += count

    def write_off(self, count: int) -> None:
        """An ended session's datagrams its receiver never counted: out of flight as lost, the round's loss
        share untouched (kept in flight, they held the next handoff under the cap until an idle restart)."""
        count = max(0, count)
        self._lost += count
        self._delivery.write_off(count)

    def on_packets_delivered(self, now: float, count: int) -> None:
        """An ACK arriving at ``now`` counts ``count`` more data datagrams received than any before it."""
        self._delivered += count
        self.last_delivery_at = now
        self.sent_since_delivery = 0
        self._caps.on_ack(now, self._delivered, self._reported_lost)
        opened_at = self._delivery.opened_at
        if opened_at is None:
            self._open_round(now)
        elif now - opened_at >= self._rtt.round_len_s:
            self._close_round(now)
            self._open_round(now)

    def on_rtt_measurement(self, now: float, rtt: float, sent_at: float) -> None:
        """An RTT sample at ``now`` of the datagram sent at ``sent_at`` (the newest acknowledged); the session
        reports it before the same ACK's counts, so a round that closes on that ACK knows its send span."""
        if self._rtt.on_sample(now, rtt, sent_at):
            self._caps.refresh(self.pace_bps)

    # ------------------------------------------------------------------ rounds
    def _open_round(self, now: float) -> None:
        self._delivery.open(now, self._delivered, self._lost, self._packets_sent, self._rtt.newest_sent_at)
        self._rtt.open_round()
        self._capped = False
        self._caps.on_round_open()

    def _close_round(self, now: float) -> None:
        """The algorithm, once per round: measure, judge, step the phase, forecast, cap."""
        rtt, delivery, congestion = self._rtt, self._delivery, self._congestion
        clear = congestion.clear(rtt)
        sample = delivery.close(now, self._delivered, self._lost, self._packets_sent, rtt.newest_sent_at,
                                self.datagram_bytes, self.pace_bps, self._capped, clear)
        if sample is None:  # the first round after a start: the receiver's burst of what it held
            return
        self.rounds += 1
        rtt.close_round()
        loss = sample.loss
        self._breaker.on_round(now, sample.lost, sample.delivered)
        delivery.take(sample)
        congested = congestion.judge(now, loss, delivery.loss_floor, rtt, self._phases.phase is Phase.DRAIN)
        if clear and not congested:
            delivery.learn_floor(loss)
        if congested:
            delivery.restart_from(congestion.cut(delivery.estimate_bps, sample.rate_bps))
        self.pace_bps, event = self._phases.on_round(now, sample, congested, self.pace_bps)
        if event in QUIETING:
            congestion.quiet(now + rtt.srtt)
        self._forecast.update(delivery, self.rounds, self.start_bps)
        self._caps.refresh(self.pace_bps)

    def _restart(self) -> None:
        """A new handoff after an idle spell: start from what was learnt, find the rate again."""
        self.start_bps = self.pace_bps = self._forecast.bps = self._delivery.estimate_bps
        self._phases.restart()
        self._delivery.restart()
        self._rtt.restart()
        self._caps.restart()
        self._breaker.restart()
        self.last_delivery_at = self.sending_since = None
        # What the last handoff sent that its receiver never counted (what followed its last ACK: the
        # tail's repairs, a split's front once the receiver started) will never be: not in flight. Kept
        # in flight, it piled up handoff after handoff until the cap held a slow path at a trickle.
        self._lost = self._packets_sent - self._delivered
        self._caps.refresh(self.pace_bps)
