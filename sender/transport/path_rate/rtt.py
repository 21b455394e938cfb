"""The round trip as the ACKs measure it: the min RTT, the smoothed RTT, the recent floor and the queues.

- The **min RTT** is the smallest sample of the last ``MIN_RTT_WINDOW_S``; a round is one min RTT of ACK
  arrivals (at least ``MIN_ROUND_S``, ``FIRST_ROUND_S`` before any sample).
- Each round gives its **queueing delay** (its smallest RTT less the min RTT) and its **standing delay**
  (its smallest RTT less the recent floor, the smallest round RTT of the last ``FLOOR_ROUNDS``). Every
  flow through one queue measures the standing delay alike, whatever min RTT it met when it started.
- The **base RTT** scales the queue thresholds: the min RTT, never above the path's prior. A queue
  another flow kept standing before our first sample inflates the min RTT, not the base.
- A first sample far above the prior (``QUEUE_JOINED_S``, or ``QUEUE_JOINED_RTT`` priors) says the
  handoff **joined** a standing queue (a loss-based neighbour's): the in-flight caps then claim a share.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Final

MIN_ROUND_S: Final = 0.01  # a round is at least this long (ACK spacing would dominate a shorter sample)
FIRST_ROUND_S: Final = 0.02  # the round length before the first RTT sample
FLOOR_ROUNDS: Final = 16  # the recent floor: the smallest round RTT of this many rounds
MIN_RTT_WINDOW_S: Final = 10.0  # a min RTT older than this is replaced by the newest sample
QUEUE_JOINED_S: Final = 0.04  # the first RTT this far above the prior: the handoff joined a standing queue
QUEUE_JOINED_RTT: Final = 2.0  # ... or this many RTT priors, if more (an LTE link's gaps delay one packet
# by up to 28 ms above the prior; a CUBIC neighbour's queue stood at 56-70 ms)
QUEUE_CONGESTED_S: Final = 0.01  # queueing delay above which loss may be congestion (a probe queues less) ...
QUEUE_CONGESTED_RTT: Final = 0.5  # ... or this share of the base RTT, if more
QUEUE_STANDING_S: Final = 0.01  # a standing queue (two rounds above it: drain) ...
QUEUE_STANDING_RTT: Final = 0.5  # ... or this share of the base RTT, if more


class RttEstimate:
    """The path's round trips: min, smoothed, the recent floor, and the newest round's queues."""

    __slots__ = ("_recent_floor", "joined", "min_rtt", "min_rtt_at", "newest_sent_at", "prior_s",
                 "queue_delay_s", "round_len_s", "round_min_rtt", "srtt", "standing_delay_s")

    def __init__(self, prior_s: float) -> None:
        self.prior_s = prior_s  # the round trip before any sample (the caller's path prior)
        self.min_rtt = math.inf
        self.min_rtt_at = 0.0
        self.srtt = 0.0
        self.round_len_s = FIRST_ROUND_S  # kept current with the min RTT: read on every ACK
        self.joined: bool | None = None  # the handoff's first RTT met a queue (None: no RTT yet)
        self.newest_sent_at = 0.0  # when the newest acknowledged datagram was sent (the newest sample's)
        self.round_min_rtt = math.inf  # the current round's smallest sample
        self.queue_delay_s = 0.0  # the newest round's RTT above the min RTT
        self.standing_delay_s = 0.0  # the newest round's RTT above the recent floor
        self._recent_floor: deque[float] = deque(maxlen=FLOOR_ROUNDS)  # the last rounds' smallest RTTs

    def on_sample(self, now: float, rtt: float, sent_at: float) -> bool:
        """One RTT sample at ``now`` of the datagram sent at ``sent_at``; True when the first sample or a new
        min RTT moved what the in-flight caps are sized on."""
        self.newest_sent_at = sent_at
        moved = False
        if self.joined is None:
            self.joined = rtt - self.prior_s > max(QUEUE_JOINED_S, QUEUE_JOINED_RTT * self.prior_s)
            moved = True
        if rtt < self.min_rtt or now - self.min_rtt_at > MIN_RTT_WINDOW_S:
            self.min_rtt, self.min_rtt_at = rtt, now
            self.round_len_s = FIRST_ROUND_S if rtt == math.inf else max(MIN_ROUND_S, rtt)
            moved = True
        self.srtt = rtt if self.srtt == 0 else 0.875 * self.srtt + 0.125 * rtt  # RFC 6298
        self.round_min_rtt = min(self.round_min_rtt, rtt)
        return moved

    def open_round(self) -> None:
        self.round_min_rtt = math.inf

    def close_round(self) -> None:
        """The round's queueing and standing delays (unchanged by a round without a sample)."""
        if self.round_min_rtt < math.inf and self.min_rtt < math.inf:
            self.queue_delay_s = max(0.0, self.round_min_rtt - self.min_rtt)
            self._recent_floor.append(self.round_min_rtt)
            self.standing_delay_s = max(0.0, self.round_min_rtt - max(self.min_rtt, self.floor_rtt()))

    def restart(self) -> None:
        """A new handoff after an idle spell: its first sample says again whether it joined a queue."""
        self.joined = None
        self._recent_floor.clear()

    def floor_rtt(self) -> float:
        """The smallest round RTT of the last ``FLOOR_ROUNDS`` rounds (0 before any). Flows sharing a queue
        see the same floor, so a standing queue measured from it drains them all at once, and their cuts
        and probes stay in step (AIMD converges)."""
        return min(self._recent_floor, default=0.0)

    def base_rtt(self) -> float:
        """The round trip the queue thresholds scale with: the min RTT, never above the path's prior (0
        before any sample). Scaled with an inflated min RTT, they took a neighbour's drop-tail losses for
        the channel's."""
        return 0.0 if self.min_rtt == math.inf else min(self.min_rtt, self.prior_s)

    def round_queue_s(self) -> float:
        """The round now closing: its smallest RTT above the min RTT (what ``close_round`` will make the
        queueing delay; the last round's without a sample)."""
        if self.round_min_rtt == math.inf or self.min_rtt == math.inf:
            return self.queue_delay_s
        return max(0.0, self.round_min_rtt - self.min_rtt)

    def queue_above_base_s(self) -> float:
        """The newest round's smallest RTT above the base RTT: a queue another flow keeps standing shows
        here, even one from before the first sample."""
        if self.round_min_rtt == math.inf or self.min_rtt == math.inf:
            return 0.0
        return max(0.0, self.round_min_rtt - self.base_rtt())

    def congested_queue_s(self) -> float:
        """Queueing delay above which a round's loss may be congestion."""
        return max(QUEUE_CONGESTED_S, QUEUE_CONGESTED_RTT * self.base_rtt())

    def standing_queue_s(self) -> float:
        """Queueing delay that counts as a standing queue (STARTUP ends, CRUISE cuts after two rounds)."""
        return max(QUEUE_STANDING_S, QUEUE_STANDING_RTT * self.base_rtt())
