"""The two in-flight caps: above the lower of them, the pace falls to a trickle (``TRICKLE_GAIN`` of it).

- **The window cap** is a round trip at the rate plus ``CWND_EXTRA`` datagrams (BBR's cwnd, with a fixed
  count after TCP Vegas). Flows through one FIFO queue that each keep the same count queued get the same
  share, so flows converge where the cap binds; a cap in proportion to the rate keeps any split.
- Its round trip is the recent floor plus ``CWND_QUEUE_SHARE`` of whatever of it stands above the base
  RTT: a loss-based neighbour's standing queue gets a share in proportion, or the cap hands it the link.
- STARTUP's window is a round trip at its pace. Before the first sample it is ``FIRST_WINDOW_GAIN`` round
  trips at the starting rate over the RTT prior: a first RTT measured through a link slower than told is
  inflated by that very start.
- A handoff that joined a standing queue claims its share instead (a loss-based flow yields only to
  loss): a round trip over the RTT it met, then ``JOINED_STARTUP_WINDOW`` at STARTUP's pace.
- **The delivery cap**, per ACK: what the ACKs of the last ``DELIVERY_WINDOW_ROUNDS`` rounds say the
  link carried, over the RTT plus ``QUEUE_BUDGET_S``. The max filter holds a burst's rate: a round trip at
  it queues 50-100 ms in an LTE cell's stall after its burst.
- Carried is what arrived plus the random-loss floor's share of what went missing (never more than went
  missing): a 25% channel loss counted as a slower link shrank the cap's queue budget by half.
- Under a neighbour's standing queue there is no delivery cap: it would yield a loss-based flow the link.
- Neither cap is ever below ``CWND_MIN_PACKETS``.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Final

from pfec.sender.transport.path_rate.delivery import DeliveryRate
from pfec.sender.transport.path_rate.phases import STARTUP_GAIN, Phase, Phases
from pfec.sender.transport.path_rate.rtt import FIRST_ROUND_S, RttEstimate

CWND_GAIN: Final = 1.0  # in flight: round trips at the rate, before the pacing rate falls to a trickle ...
CWND_EXTRA: Final = 48  # ... plus this many datagrams: the same count queued per flow gives the same share
CWND_QUEUE_SHARE: Final = 0.5  # ... and this share of a queue standing under the recent floor
FIRST_WINDOW_GAIN: Final = 0.5  # round trips at the starting rate before the first sample, on an empty queue
JOINED_STARTUP_WINDOW: Final = 1.5  # STARTUP's cap in round trips at its pace, joining a standing queue
CWND_MIN_PACKETS: Final = 64  # no cap is below this many datagrams
TRICKLE_GAIN: Final = 1 / 16  # the pace's share while more is in flight than a cap allows
QUEUE_BUDGET_S: Final = 0.03  # the delivery cap's queue: this, or QUEUE_BUDGET_RTT base RTTs
QUEUE_BUDGET_RTT: Final = 1.0
DELIVERY_WINDOW_ROUNDS: Final = 4.0  # the delivery cap's rate: the ACKs' count over these rounds


class InFlightCaps:
    """Both caps in datagrams, and ``limit``, the lower: read for every datagram, so kept current."""

    __slots__ = ("_ack_base", "_acks", "_bits", "_budget_span_s", "_budget_window_s", "_delivery",
                 "_phases", "_rtt", "delivery_packets", "limit", "window_packets")

    def __init__(self, rtt: RttEstimate, delivery: DeliveryRate, phases: Phases, datagram_bytes: int,
                 pace_bps: float) -> None:
        self._rtt, self._delivery, self._phases = rtt, delivery, phases
        self._bits = 8.0 * datagram_bytes
        self.window_packets = 0.0
        self.delivery_packets = math.inf  # the delivery cap (inf: none)
        self.limit = 0.0
        self._acks: deque[tuple[float, int, int]] = deque()  # the delivery cap's (ACK time, delivered, lost)
        self._ack_base = (math.inf, 0, 0)  # its window's base (inf: none yet)
        self._budget_window_s = DELIVERY_WINDOW_ROUNDS * FIRST_ROUND_S
        self._budget_span_s = math.inf  # its round trip (inf: no delivery cap)
        self.refresh(pace_bps)

    def refresh(self, pace_bps: float) -> None:
        """The window cap, wherever its inputs moved (a sample, a closed round, a restart)."""
        rtt, joined = self._rtt, bool(self._rtt.joined)
        if not self._delivery.samples:
            round_trip = rtt.min_rtt if joined else min(rtt.min_rtt, rtt.prior_s)
            packets = (1.0 if joined else FIRST_WINDOW_GAIN) * pace_bps * round_trip / self._bits
        else:
            # The recent floor, if above the min RTT: a flow that started into another's queue holds an
            # inflated min RTT, and a cap on the true one would throttle only the flow that measured it.
            round_trip = max(rtt.min_rtt, rtt.floor_rtt())
            if self._phases.phase is Phase.STARTUP:
                packets = (JOINED_STARTUP_WINDOW if joined else 1.0) * pace_bps * round_trip / self._bits
            else:
                round_trip += CWND_QUEUE_SHARE * max(0.0, round_trip - rtt.base_rtt())
                rate = max(pace_bps, self._delivery.estimate_bps)
                packets = CWND_GAIN * rate * round_trip / self._bits + CWND_EXTRA
        self.window_packets = max(CWND_MIN_PACKETS, packets)
        self.limit = min(self.window_packets, self.delivery_packets)

    def on_round_open(self) -> None:
        """The delivery cap's window and round trip, per round (in STARTUP twice the RTT, as its pace)."""
        rtt = self._rtt
        ref = max(rtt.min_rtt, rtt.floor_rtt())
        self._budget_window_s = DELIVERY_WINDOW_ROUNDS * rtt.round_len_s
        if ref - rtt.base_rtt() > rtt.standing_queue_s():  # a neighbour's queue: no delivery cap
            self._budget_span_s = self.delivery_packets = math.inf
            self.limit = self.window_packets
            return
        budget = max(QUEUE_BUDGET_S, QUEUE_BUDGET_RTT * rtt.base_rtt())
        self._budget_span_s = ref * (STARTUP_GAIN if self._phases.phase is Phase.STARTUP else 1.0) + budget

    def on_ack(self, now: float, delivered: int, lost: int) -> None:
        """An ACK at ``now`` brought the receivers' counts to ``delivered`` and ``lost``: the delivery cap is
        what the window's ACKs say was carried, over its round trip."""
        acks = self._acks
        acks.append((now, delivered, lost))
        edge = now - self._budget_window_s
        while acks[0][0] <= edge:  # the newest ACK at or before the window's edge is its base
            self._ack_base = acks.popleft()
        acked_at, base, base_lost = self._ack_base
        if self._budget_span_s < math.inf and acked_at <= edge:
            arrived = delivered - base
            carried = arrived + self._delivery.credit(arrived, lost - base_lost, clear=False)
            packets = carried * self._budget_span_s / (now - acked_at)
            self.delivery_packets = max(CWND_MIN_PACKETS, packets)
            self.limit = min(self.window_packets, self.delivery_packets)

    def restart(self) -> None:
        """A new handoff after an idle spell: no delivery cap until its ACKs say how fast it delivers."""
        self._acks.clear()
        self._ack_base = (math.inf, 0, 0)
        self._budget_span_s = self.delivery_packets = math.inf
        self.limit = self.window_packets
