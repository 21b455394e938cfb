"""An idealised pacer for trace-driven cells (sans-IO): what a rate controller could do knowing the link.

``PathRate`` learns the path from ACKs, which report a round trip late what the link did. The pacer here
is told instead: it paces at the trace's own delivery rate over the round trip that ended a round trip
ago (the freshest rate an ACK could carry) and is otherwise PathRate (its forecast, counters and circuit
breaker: the session plans as it would). It is a reference for ``pfec eval``'s trace cells, not a
controller a sender could run: it says how much of the oracle's lead is the estimate's and how much is
the bound on what is in flight.

- ``known-rate`` holds in flight as PathRate's cruise does (a round trip at that rate plus
  ``CWND_EXTRA`` datagrams): its gap to ours is what estimating the rate costs.
- ``known-rate-unbounded`` sends at that rate whatever is in flight: it keeps a queue standing through
  an LTE cell's gaps, so the link's next burst finds datagrams waiting (what the oracle gets by knowing
  the future), and pays for it in queueing delay (each run's bottleneck P95 is in its RunResult).
"""

from __future__ import annotations

import math
from typing import Final

from pfec.lab.sim.handoff import Handoff
from pfec.lab.sim.path_link import sender_budget
from pfec.lab.sim.rate_trace import RateTrace
from pfec.sender.transport.path_rate import PathRate
from pfec.sender.transport.path_rate.caps import CWND_EXTRA, CWND_MIN_PACKETS, TRICKLE_GAIN
from pfec.sender.transport.path_rate.delivery import MIN_RATE_BPS

#: scheme name -> whether in flight is bounded as PathRate bounds it
KNOWN_RATE_SCHEMES: Final = {"known-rate": True, "known-rate-unbounded": False}
KNOWN_RATE_DEFINITIONS: Final = {
    "known-rate": "idealised: ours (whole deadline) paced at the trace's rate of a round trip ago, in "
                  "flight bounded as PathRate bounds it",
    "known-rate-unbounded": "idealised: the same pacing, nothing in flight bounded (queues through the "
                            "trace's gaps)",
}
LOOK_AGAIN_SHARE: Final = 0.25  # pacing never slower than a datagram per this share of a round trip


class KnownRatePacer(PathRate):
    """PathRate, paced at a rate read off the trace (see the module doc)."""

    __slots__ = ("_bounded", "_now", "_trace")

    def __init__(self, trace: RateTrace, start_bps: float, datagram_bytes: int, *, bounded: bool,
                 loss_prior: float = 0.0, rtt_prior_s: float = 0.1) -> None:
        super().__init__(start_bps, datagram_bytes, loss_prior=loss_prior, rtt_prior_s=rtt_prior_s)
        self._trace = trace
        self._bounded = bounded
        self._now = 0.0  # the newest send (the session sends, then reads the pace for the next slot)

    def on_packet_sent(self, now: float, size: int) -> None:
        super().on_packet_sent(now, size)
        self._now = now

    @property
    def pacing_bps(self) -> float:
        rtt = self.min_rtt if self.min_rtt < math.inf else self._rtt.prior_s
        if self._now < 2 * rtt:  # no ACK could yet have told a sender anything: the told rate
            rate = self.start_bps
        else:
            rate = self.trace_rate_bps(self._now - 2 * rtt, self._now - rtt)
        # In a gap of the trace the rate is 0: look again within a fraction of a round trip.
        rate = max(rate, MIN_RATE_BPS, 8 * self.datagram_bytes / (LOOK_AGAIN_SHARE * rtt))
        if self._bounded:
            in_flight = self._packets_sent - self._delivered - self._lost
            round_trip = max(rtt, self._rtt.floor_rtt())
            if in_flight >= max(CWND_MIN_PACKETS, rate * round_trip / (8 * self.datagram_bytes) + CWND_EXTRA):
                return rate * TRICKLE_GAIN
        return rate

    def trace_rate_bps(self, start_s: float, end_s: float) -> float:
        """The trace's delivery rate over [start_s, end_s) (the bytes of its opportunities there)."""
        trace = self._trace
        opportunities = trace.first_at_or_after(end_s) - trace.first_at_or_after(start_s)
        return opportunities * trace.bytes_per_opportunity * 8 / (end_s - start_s)


def known_rate_pacer(handoff: Handoff, name: str) -> KnownRatePacer:
    """The pacer of scheme ``name`` (``KNOWN_RATE_SCHEMES``) for one simulated handoff, as ``path_rate``
    builds PathRate; ValueError on a link without a trace or without ``rate_control = path``."""
    cfg = handoff.config
    if cfg.rate_trace is None or cfg.rate_control != "path":
        raise ValueError(f"{name} needs a trace-driven link measured by the sender "
                         "(--rate-trace PATH --rate-control path)")
    budget = sender_budget(handoff)
    return KnownRatePacer(cfg.rate_trace, budget.rate_bps, round(budget.slot_s * budget.rate_bps / 8),
                          bounded=KNOWN_RATE_SCHEMES[name], loss_prior=cfg.sender_loss_prior,
                          rtt_prior_s=cfg.rtt_ms / 1000)
