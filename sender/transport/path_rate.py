"""``PathRate``: the sender's rate controller (sans-IO), after BBR's model (draft-ietf-ccwg-bbr) with the
changes a deadline stream needs. It plugs into the seam in :mod:`.rate`; the link adapters pace at its
``pacing_bps`` and the session plans on its cautious ``plan_slot_s``.

Theory of operation:

- **Rounds.** A round is one min RTT of ACK arrivals (at least ``MIN_ROUND_S``). When a round closes the
  controller takes one delivery-rate sample: the data datagrams the receiver counted (the ACKs' cumulative
  ``received``) between the ACK that opened the round and the one that closed it, over the time between
  the two ACKs, but never less than ``SEND_SPAN_SHARE`` of the time between the sending of the datagrams
  they newly acknowledged (after BBR's rate sample: ACKs bunched on the way back shorten the first). The
  random-loss floor's share is added back (the link carried those datagrams and lost them: the rate is
  the one the path carries, the FEC's repairs fill the loss). Counters, not send times: jitter on the
  return path moves a sample's ends, never the count. The same round gives its loss share and its
  queueing delay (its smallest RTT sample less the path's min RTT), and its standing delay: its smallest
  RTT less the recent floor (the smallest round RTT of the last ``FLOOR_ROUNDS``), which every flow
  through one queue measures alike, whatever min RTT it met when it started.
- **Estimate.** The bottleneck rate is the largest sample of the last ``BTL_ROUNDS`` rounds (a max filter:
  a sample understates the link when the sender was app-limited or a neighbour had a burst; only a queue
  lets it overstate, and the drain phases empty that). A round in which the sender sent less than
  ``APP_LIMITED_SHARE`` of what it may is app-limited: its sample counts only if it raises the estimate.
- **Phases.** STARTUP paces at the rate it was told (or remembers) until the first sample, then at
  ``STARTUP_GAIN`` times the estimate: the rate doubles per round while the link keeps up, so a link 4x
  faster than told is found in two or three round trips, not the hundreds additive increase would take.
  ``STARTUP_MISSES`` rounds in a row whose estimate grew less than ``STARTUP_GROWTH`` (BBR's full-pipe
  test: one short round may be a burst of channel loss or the count of a lost ACK), a round that grew
  a queue, or, on a link whose queue was empty when the handoff began, a round whose ACKs came
  ``STARTUP_GROWTH`` times more spread out than its datagrams were sent (the link is slower than the
  pace: a start told too much), end it. A handoff that joins another flow's queue keeps doubling: its
  ACKs are spread by that flow's datagrams, and stopping there left a CUBIC neighbour 75-79% of the link.
  DRAIN paces at ``DRAIN_GAIN`` of the estimate until the queue is gone (while it stands the link stays
  busy, so draining fast costs nothing). CRUISE paces at the estimate in cycles of
  ``PROBE_GAINS``, one round each: probe, drain what the probe queued, cruise. The probe adds a step of
  ``PROBE_STEP_PACKETS`` per min RTT (additive: a bigger flow probes no harder than a smaller one), and a
  probe that raised the estimate is repeated at once with twice the step (a link that speeds up is found
  in a few rounds), up to ``PROBE_MAX_GAIN`` of the estimate. Two rounds in a row with a standing delay
  cut the estimate to ``STANDING_CUT`` of itself, or of the largest delivery rate of those rounds if that
  is below ``LINK_SLOWED`` of it (the link was busy: a link that slowed down is followed at once, not from
  the max filter's old rate; the drain then ends in STARTUP, which finds the rate again when it returns),
  and send it back to DRAIN: flows sharing the queue see it together, so their cuts are in step,
  and additive increase with multiplicative decrease converges to equal shares (Chiu and Jain); BBR's
  multiplicative probing kept whatever split the start made (``pfec bench fairness``).
- **In-flight cap** (``pacing_bps`` falls to a trickle above it): a round trip at the rate plus
  ``CWND_EXTRA`` datagrams, the round trip being the recent floor plus ``CWND_QUEUE_SHARE`` of whatever
  of it stands above the base RTT (a loss-based neighbour's queue). The fixed count is what makes flows
  through one FIFO queue converge where the cap binds (each holds the same count queued, so each gets the
  same share: TCP Vegas); a cap in proportion to the rate keeps any split. STARTUP's cap is a round trip
  at its pace (twice the estimate); before the first sample, a round trip at the starting rate over the
  RTT prior (a first RTT measured through a link slower than told is inflated by that very start). A
  second cap, per ACK: what the ACKs of the last ``DELIVERY_WINDOW_ROUNDS`` rounds delivered, over the RTT
  plus ``QUEUE_BUDGET_S`` (the max filter holds a burst's rate: a round trip at it queued 50-100 ms in an
  LTE cell's stall after its burst); none under a neighbour's standing queue (it would yield CUBIC the link).
- **Congestion** (RFC 8085 3.1, RFC 9265): a round whose loss exceeds the random-loss floor by
  ``LOSS_MARGIN`` *while* a queue stands (``QUEUED_ROUNDS`` rounds in a row: a bursty link delays one
  round without any queue of ours) is congestion: the estimate is cut to ``CUT`` of the round's delivery
  rate (the link was busy all round), or of itself if that is lower (never below ``DEEPEST_CUT`` of it),
  and the probe cycle restarts at a cruise phase. Loss without a queue is the channel's, the FEC's
  business: those rounds set the floor (an average of their loss). Repaired losses count: the counters
  are the receiver's.
- **Forecast** (Sprout's cautious forecast): the ``FORECAST_QUANTILE`` of the last ``FORECAST_ROUNDS``
  samples that were not app-limited, never above the estimate; the starting rate until
  ``FORECAST_MIN_SAMPLES`` exist. The session counts the slots left before its deadline at this rate.
- **Circuit breaker** (RFC 8084): once the path has delivered, the breaker trips when nothing more is
  delivered for ``BREAKER_SILENCE_S`` (or four smoothed RTTs, if longer) while the sender kept sending,
  or when the last ``BREAKER_WINDOW_S`` lost at least ``BREAKER_LOSS`` of what it sent; the session then
  stops with the breaker's reason. Tripped stays tripped.

One controller may serve several sessions to one receiver (they share the uplink): every hook takes counts
(deltas), so each session reports its own growth and the controller sums them; a session that ends writes
off what it sent and its receiver never counted (``write_off``), so the datagrams after its last ACK do not
stay in flight for the next handoff. A controller idle for ``RESTART_IDLE_S`` starts its next handoff in
STARTUP from the estimate it remembers.
"""

from __future__ import annotations

import math
from collections import deque
from enum import Enum
from typing import Final

MIN_ROUND_S: Final = 0.01  # a round is at least this long (ACK spacing would dominate a shorter sample)
FIRST_ROUND_S: Final = 0.02  # the round length before the first RTT sample
BTL_ROUNDS: Final = 8  # max filter length, in rounds
STARTUP_GAIN: Final = 2.0  # STARTUP paces at this times the estimate (BBR's 2.885 queued more)
STARTUP_GROWTH: Final = 1.25  # a STARTUP round whose estimate grew less than this ...
STARTUP_MISSES: Final = 3  # ... this many times in a row: the pipe is full (BBR's full-bandwidth test)
DRAIN_GAIN: Final = 0.5  # while a queue stands the link stays busy: draining it fast costs no delivery
PROBE_GAINS: Final = (1.0, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)  # round 0 adds the probe step to its 1.0
PROBE_STEP_PACKETS: Final = 16  # the probe's first step: this many datagrams more per min RTT (additive) ...
PROBE_MAX_DOUBLINGS: Final = 10  # ... doubled after each probe that found the link faster, up to 2^this
PROBE_MAX_GAIN: Final = 1.25  # ... but never above this times the estimate (BBR's probe gain)
PROBE_FOUND: Final = 1.02  # a probe found room when the estimate rose by this factor and half the step
LINK_SLOWED: Final = 0.5  # ... or of the delivery rate while it stood, if below this share of the estimate
STANDING_CUT: Final = 0.85  # a standing queue in CRUISE cuts the estimate by this (the AIMD decrease)
SEND_SPAN_SHARE: Final = 0.5  # a round's sample is at most 1/this of the rate its datagrams were sent at
MAX_FLOOR_CREDIT: Final = 0.5  # a sample adds back at most this share of random loss
FLOOR_ROUNDS: Final = 16  # the recent floor: the smallest round RTT of this many rounds
CRUISE_AFTER_CUT: Final = 2  # the probe cycle's index after a congestion cut (no probe right away)
APP_LIMITED_SHARE: Final = 0.8
CWND_GAIN: Final = 1.0  # in flight: round trips at the rate, before the pacing rate falls to a trickle ...
CWND_EXTRA: Final = 48  # ... plus this many datagrams. Flows through one FIFO queue that each keep the same
# count queued get the same share (TCP Vegas), so a cap-bound split converges: with 1.5 round trips and no
# extra (a share of the queue in proportion to the rate) two handoffs kept 27/71 (pfec bench fairness).
# BBR keeps 2 round trips; a link that quarters its rate then holds 7 round trips of queue (bench traces).
CWND_QUEUE_SHARE: Final = 0.5  # ... and this share of a queue standing under the recent floor
FIRST_WINDOW_GAIN: Final = 0.5  # round trips at the starting rate before the first sample (a guess: a start
# told 4x the rate of a slow stretch put a round trip of it in the queue, 5% of pfec bench traces' datagrams)
JOINED_STARTUP_WINDOW: Final = 1.5  # STARTUP's cap in round trips at its pace, joining a standing queue
CWND_MIN_PACKETS: Final = 64  # the cap is never below this many datagrams
TRICKLE_GAIN: Final = 1 / 16
CUT: Final = 0.85  # the estimate after a congestion round (BBRv2's beta is 0.7 for inflight; we pace) ...
DEEPEST_CUT: Final = 0.5  # ... of the round's delivery rate, if lower, but not below this of the estimate
LOSS_MARGIN: Final = 0.02  # loss share above the random-loss floor that counts as congestion
FLOOR_GAIN: Final = 0.125  # weight of a queue-free round's loss in the random-loss floor
QUEUE_CONGESTED_S: Final = 0.01  # queueing delay above which loss may be congestion (a probe queues less) ...
QUEUE_CONGESTED_RTT: Final = 0.5  # ... or this share of the base RTT (``_base_rtt``), if more ...
QUEUED_ROUNDS: Final = 2  # ... in this many rounds in a row
QUEUE_JOINED_S: Final = 0.04  # the first RTT this far above the prior: the handoff joined a standing queue
QUEUE_JOINED_RTT: Final = 2.0  # ... or this many RTT priors, if more (an LTE link's gaps delay one packet
# by up to 28 ms above the prior in pfec bench traces' starts; a CUBIC neighbour's queue stood at 56-70)
QUEUE_STANDING_S: Final = 0.01  # a standing queue (two rounds above it: drain) ...
QUEUE_STANDING_RTT: Final = 0.5  # ... or this share of the base RTT, if more
FORECAST_ROUNDS: Final = 16
FORECAST_QUANTILE: Final = 0.2
FORECAST_MIN_SAMPLES: Final = 4
MIN_RTT_WINDOW_S: Final = 10.0  # a min RTT older than this is replaced by the newest round's
BREAKER_SILENCE_S: Final = 1.0
BREAKER_MIN_SENT: Final = 64  # datagrams sent into the silence before it can trip the breaker
BREAKER_WINDOW_S: Final = 1.0
BREAKER_LOSS: Final = 0.95
BREAKER_MIN_PACKETS: Final = 256  # datagrams the loss window must hold before it can trip the breaker
RESTART_IDLE_S: Final = 1.0
MIN_RATE_BPS: Final = 100e3  # the estimate never falls below this (a floor, not a target)
QUEUE_BUDGET_S: Final = 0.03  # the second in-flight cap's queue: this, or QUEUE_BUDGET_RTT base RTTs
QUEUE_BUDGET_RTT: Final = 1.0
DELIVERY_WINDOW_ROUNDS: Final = 4.0  # the second cap's delivery rate: the ACKs' count over these rounds


class Phase(Enum):
    STARTUP = "startup"
    DRAIN = "drain"
    CRUISE = "cruise"


class PathRate:
    """A delivery-rate and min-RTT rate controller for one path (see the module doc)."""

    __slots__ = (
        "_ack_base", "_ack_hist", "_acked_sent_at", "_budget_cap", "_budget_span_s", "_budget_window_s",
        "_cap_packets", "_capped", "_cycle", "_delivered", "_drain_until", "_forecast", "_full_bw", "_joined",
        "_lost", "_missed", "_packets_sent", "_probe_doublings", "_probe_from", "_queued", "_quiet_until",
        "_recent_floor", "_recent_loss", "_refind", "_round_delivered", "_round_lost", "_round_min_rtt",
        "_round_open", "_round_sent", "_round_sent_at", "_rtt_prior", "_samples", "_standing",
        "_standing_delay_s", "_standing_rate", "_warm", "breaker_reason", "bytes_sent", "congestion_events",
        "datagram_bytes", "estimate_bps", "last_delivery_at", "last_sent_at", "loss_floor", "max_bps",
        "min_rtt", "min_rtt_at", "pace_bps", "phase", "queue_delay_s", "rounds", "sent_since_delivery",
        "srtt", "start_bps",
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
        self.max_bps = max_bps
        self.start_bps = self._clamp(start_bps)
        self.estimate_bps = self.start_bps  # bottleneck rate: the max filter's value
        self.pace_bps = self.start_bps  # the phase's rate (``pacing_bps`` adds the in-flight cap)
        self._rtt_prior = rtt_prior_s  # the round trip before any sample (the caller's path prior)
        self._capped = False  # a datagram of this round left under the in-flight cap (not app-limited)
        self.phase = Phase.STARTUP
        self.loss_floor = loss_prior
        self.min_rtt = math.inf
        self.min_rtt_at = 0.0
        self.srtt = 0.0
        self.queue_delay_s = 0.0  # the newest round's
        self.rounds = 0
        self.congestion_events = 0
        self.breaker_reason: str | None = None
        self.bytes_sent = 0
        self.last_sent_at = -math.inf
        self.last_delivery_at: float | None = None  # None until the path first delivers
        self.sent_since_delivery = 0
        self._packets_sent = 0
        self._delivered = 0  # cumulative data datagrams the receivers counted
        self._lost = 0
        self._round_open: float | None = None  # the ACK time that opened the current round
        self._round_delivered = 0  # cumulative counts when it opened
        self._round_lost = 0
        self._round_sent = 0
        self._round_min_rtt = math.inf
        self._acked_sent_at = 0.0  # when the newest acknowledged datagram was sent (the newest RTT sample's)
        self._round_sent_at = 0.0  # ... as of the ACK that opened the round
        self._recent_floor: deque[float] = deque(maxlen=FLOOR_ROUNDS)  # the last rounds' smallest RTTs
        self._standing_delay_s = 0.0  # the newest round's RTT above the recent floor
        self._probe_doublings = 0
        self._probe_from = 0.0  # the estimate when the newest probe began
        self._full_bw = 0.0  # STARTUP: the estimate the last growing round reached
        self._joined: bool | None = None  # the handoff's first RTT met a queue (None: no RTT yet)
        self._samples: deque[tuple[float, bool]] = deque(maxlen=max(BTL_ROUNDS, FORECAST_ROUNDS))
        self._recent_loss: deque[tuple[float, int, int]] = deque()  # (round end, lost, delivered)
        self._forecast = self.start_bps
        self._cycle = 0
        self._missed = 0  # consecutive STARTUP rounds whose estimate did not grow
        self._drain_until = 0.0  # DRAIN ends then (or once the queue is gone)
        self._quiet_until = 0.0  # losses before then answer an earlier cut or overshoot: no new cut
        self._standing = 0  # consecutive rounds with a standing queue
        self._standing_rate = 0.0  # the largest delivery-rate sample of those rounds (the link was busy)
        self._refind = False  # the drain ends in STARTUP (the link had slowed to below LINK_SLOWED)
        self._queued = 0  # consecutive rounds whose queueing delay could make loss congestion
        self._warm = False  # the first round closed (its sample is not taken: see _close_round)
        self._cap_packets = 0.0  # in flight beyond this: trickle (pacing_bps)
        self._ack_hist: deque[tuple[float, int]] = deque()  # the second cap's (ACK time, delivered by then)
        self._ack_base = (math.inf, 0)  # its window's base (inf: none yet)
        self._budget_window_s = DELIVERY_WINDOW_ROUNDS * FIRST_ROUND_S
        self._budget_span_s = self._budget_cap = math.inf  # its round trip (inf: none), its cap
        self._refresh_cap()

    # ------------------------------------------------------------------ what the session and adapters read
    @property
    def pacing_bps(self) -> float:
        """The rate to send at now: the phase's, down to a trickle while more is in flight than a round trip
        at that rate and ``CWND_EXTRA`` datagrams (BBR's cwnd cap: what is sent before feedback says how
        fast the path is, a start told far too much above all, is bounded by it). Read per datagram: the
        cap in packets is kept current by ``_refresh_cap`` wherever its inputs move."""
        if self._packets_sent - self._delivered - self._lost < min(self._cap_packets, self._budget_cap):
            return self.pace_bps
        self._capped = True
        return self.pace_bps * TRICKLE_GAIN

    def _refresh_cap(self) -> None:
        # A handoff that joined another flow's standing queue must claim its share from it (a loss-based
        # flow yields only to loss): it starts as BBR would, a round trip at the guess over the RTT it met
        # and 1.5 at STARTUP's pace. On an empty queue a start told too much would flood a slower link: half
        # a round trip at the guess over the RTT prior (a first RTT through a slower link is inflated by
        # that very start), then one at STARTUP's pace.
        joined = bool(self._joined)
        if not self._samples:
            rtt = self.min_rtt if joined else min(self.min_rtt, self._rtt_prior)
            packets = (1.0 if joined else FIRST_WINDOW_GAIN) * self.pace_bps * rtt / self._bits()
        else:
            # The recent floor, if above the min RTT: a flow that started into another's queue holds an
            # inflated min RTT, and a cap on the true one would throttle only the flow that measured it.
            rtt = max(self.min_rtt, self._floor_rtt())
            if self.phase is Phase.STARTUP:
                packets = (JOINED_STARTUP_WINDOW if joined else 1.0) * self.pace_bps * rtt / self._bits()
            else:
                # A queue another flow keeps standing (the floor above the base RTT: a loss-based
                # neighbour's) gets a share in proportion, or the cap would hand that flow the link.
                rtt += CWND_QUEUE_SHARE * max(0.0, rtt - self._base_rtt())
                packets = CWND_GAIN * max(self.pace_bps, self.estimate_bps) * rtt / self._bits() + CWND_EXTRA
        self._cap_packets = max(CWND_MIN_PACKETS, packets)

    def _refresh_budget_span(self) -> None:
        """The second cap's window and round trip, per round (in STARTUP twice the RTT, as the first's)."""
        ref = max(self.min_rtt, self._floor_rtt())
        self._budget_window_s = DELIVERY_WINDOW_ROUNDS * self._round_len()
        if ref - self._base_rtt() > self._queue_standing():  # a neighbour's queue: no second cap
            self._budget_span_s = self._budget_cap = math.inf
            return
        budget = max(QUEUE_BUDGET_S, QUEUE_BUDGET_RTT * self._base_rtt())
        self._budget_span_s = ref * (STARTUP_GAIN if self.phase is Phase.STARTUP else 1.0) + budget

    def _bits(self) -> float:
        return 8.0 * self.datagram_bytes

    @property
    def slot_s(self) -> float:
        """Link time of one full-size datagram at the pacing rate."""
        return self.datagram_bytes * 8 / self.pacing_bps

    @property
    def plan_slot_s(self) -> float:
        """The same at the cautious forecast (the session counts the slots before its deadline in it)."""
        return self.datagram_bytes * 8 / self._forecast

    @property
    def forecast_bps(self) -> float:
        return self._forecast

    def breaker(self, now: float) -> str | None:
        """Why the path is given up (sticky), or None while it delivers."""
        if self.breaker_reason is None and self.last_delivery_at is not None:
            silence = now - self.last_delivery_at
            if (silence > max(BREAKER_SILENCE_S, 4 * self.srtt)
                    and self.sent_since_delivery >= BREAKER_MIN_SENT):
                self.breaker_reason = (f"circuit breaker: nothing delivered for {silence:.2f} s while "
                                       f"{self.sent_since_delivery} datagrams were sent")
        return self.breaker_reason

    # ------------------------------------------------------------------ what the session reports
    def on_packet_sent(self, now: float, size: int) -> None:
        if now - self.last_sent_at > RESTART_IDLE_S and self._packets_sent > 0:
            self._restart()
        self.last_sent_at = now
        self.bytes_sent += size
        self._packets_sent += 1
        self.sent_since_delivery += 1

    def on_packets_acked(self, now: float, count: int) -> None:
        pass  # delivery comes from the receiver's counters (on_packets_delivered), not from coverage

    def on_packets_lost(self, now: float, count: int) -> None:
        self._lost += count

    def write_off(self, count: int) -> None:
        """An ended session's datagrams its receiver never counted: out of flight as lost, the round's loss
        share untouched (kept in flight, they held the next handoff under the cap until an idle restart)."""
        count = max(0, count)
        self._lost += count
        self._round_lost += count

    def on_packets_delivered(self, now: float, count: int) -> None:
        """An ACK arriving at ``now`` counts ``count`` more data datagrams received than any before it."""
        self._delivered += count
        self.last_delivery_at = now
        self.sent_since_delivery = 0
        hist = self._ack_hist  # the second cap: what the window's ACKs delivered over its round trip
        hist.append((now, self._delivered))
        edge = now - self._budget_window_s
        while hist[0][0] <= edge:  # the newest ACK at or before the window's edge is its base
            self._ack_base = hist.popleft()
        acked_at, delivered = self._ack_base
        if self._budget_span_s < math.inf and acked_at <= edge:
            self._budget_cap = max(CWND_MIN_PACKETS,
                                   (self._delivered - delivered) * self._budget_span_s / (now - acked_at))
        if self._round_open is None:
            self._open_round(now)
        elif now - self._round_open >= self._round_len():
            self._close_round(now)
            self._open_round(now)

    def on_rtt_measurement(self, now: float, rtt: float, sent_at: float) -> None:
        """An RTT sample at ``now`` of the datagram sent at ``sent_at`` (the newest acknowledged); the session
        reports it before the same ACK's counts, so a round that closes on that ACK knows its send span."""
        self._acked_sent_at = sent_at
        if self._joined is None:
            self._joined = rtt - self._rtt_prior > max(QUEUE_JOINED_S, QUEUE_JOINED_RTT * self._rtt_prior)
            self._refresh_cap()
        if rtt < self.min_rtt or now - self.min_rtt_at > MIN_RTT_WINDOW_S:
            self.min_rtt, self.min_rtt_at = rtt, now
            self._refresh_cap()
        self.srtt = rtt if self.srtt == 0 else 0.875 * self.srtt + 0.125 * rtt
        self._round_min_rtt = min(self._round_min_rtt, rtt)

    # ------------------------------------------------------------------ rounds
    def _round_len(self) -> float:
        return FIRST_ROUND_S if self.min_rtt == math.inf else max(MIN_ROUND_S, self.min_rtt)

    def _open_round(self, now: float) -> None:
        self._round_open = now
        self._round_delivered = self._delivered
        self._round_lost = self._lost
        self._round_sent = self._packets_sent
        self._round_sent_at = self._acked_sent_at
        self._round_min_rtt = math.inf
        self._capped = False
        self._refresh_budget_span()

    def _close_round(self, now: float) -> None:
        assert self._round_open is not None
        # After BBR's rate sample: over the ACKs' span, but not shorter than SEND_SPAN_SHARE of the span in
        # which the datagrams they count were sent. ACKs bunched on the way back (a busy receiver, a loaded
        # event loop) shorten the first, and the max filter keeps what bunching overstates; a link that
        # speeds up drains its backlog faster than it was sent, so the bound is loose (pfec eval's trace
        # cells lost 2 points of the oracle with BBR's share of 1).
        ack_span, send_span = now - self._round_open, self._acked_sent_at - self._round_sent_at
        span = max(ack_span, SEND_SPAN_SHARE * send_span)
        # The link spread the datagrams out: it delivers slower than they were sent (a start told too much).
        link_limited = ack_span > STARTUP_GROWTH * send_span and self._joined is False and not self._refind
        bits = 8 * self.datagram_bytes
        delivered = self._delivered - self._round_delivered
        lost = self._lost - self._round_lost
        # The rate the path carries, channel loss included: the random-loss floor's share was sent and
        # lost on the link, not left unsent (an additive probe would otherwise settle below a lossy link).
        sample = delivered * bits / span / (1 - min(self.loss_floor, MAX_FLOOR_CREDIT))
        sent_bps = (self._packets_sent - self._round_sent) * bits / span
        if not self._warm:  # the receiver counts what it held before the handshake in a burst of ACKs
            self._warm = True
            return
        # An app-limited sample says only that the link carries at least that much: it counts where it
        # raises the estimate, and is then a full sample.
        app_limited = (sent_bps < APP_LIMITED_SHARE * self.pace_bps and not self._capped
                       and sample <= self.estimate_bps)
        self.rounds += 1
        if self._round_min_rtt < math.inf and self.min_rtt < math.inf:
            self.queue_delay_s = max(0.0, self._round_min_rtt - self.min_rtt)
            self._recent_floor.append(self._round_min_rtt)
            self._standing_delay_s = max(0.0, self._round_min_rtt - max(self.min_rtt, self._floor_rtt()))
        loss = lost / (lost + delivered) if lost + delivered else 0.0
        self._note_loss(now, lost, delivered)
        self._samples.append((sample, app_limited))
        self._update_estimate()
        queued = self.queue_delay_s > self._queue_congested()
        self._queued = self._queued + 1 if queued else 0
        congested = self._congested(loss, now)
        # A queue-free round's loss is the channel's; queue-free above the base RTT too: a CUBIC neighbour's
        # standing queue inflates the min RTT, and its drop-tail losses learnt as the floor (21%, pfec bench
        # fairness) were then credited to every sample as the link's.
        if not (congested or queued or self._queue_above_base_s() > self._queue_congested()):
            self.loss_floor += FLOOR_GAIN * (loss - self.loss_floor)
        self._step_phase(sample, app_limited, congested, now, link_limited)
        self._update_forecast()
        self._refresh_cap()

    def _note_loss(self, now: float, lost: int, delivered: int) -> None:
        window = self._recent_loss
        window.append((now, lost, delivered))
        while window and now - window[0][0] > BREAKER_WINDOW_S:
            window.popleft()
        total_lost = sum(entry[1] for entry in window)
        total = total_lost + sum(entry[2] for entry in window)
        if (self.breaker_reason is None and total >= BREAKER_MIN_PACKETS
                and total_lost >= BREAKER_LOSS * total):
            self.breaker_reason = (f"circuit breaker: {total_lost} of {total} datagrams lost in the last "
                                   f"{BREAKER_WINDOW_S:.1f} s")

    def _queue_above_base_s(self) -> float:
        """The newest round's smallest RTT above the base RTT (``_base_rtt``): a queue another flow keeps
        standing shows here, even from before this controller's first sample."""
        if self._round_min_rtt == math.inf or self.min_rtt == math.inf:
            return 0.0
        return max(0.0, self._round_min_rtt - self._base_rtt())

    def _floor_rtt(self) -> float:
        """The smallest round RTT of the last ``FLOOR_ROUNDS`` rounds (0 before any). Flows sharing a queue
        see the same floor whatever min RTT each measured when it started, so a standing queue measured
        from it drains them all at once, and their cuts and probes stay in step (AIMD converges)."""
        return min(self._recent_floor, default=0.0)

    def _probe_step_bps(self) -> float:
        return PROBE_STEP_PACKETS * 8 * self.datagram_bytes / max(self._round_len(), MIN_ROUND_S)

    def _queue_congested(self) -> float:
        return max(QUEUE_CONGESTED_S, QUEUE_CONGESTED_RTT * self._base_rtt())

    def _queue_standing(self) -> float:
        return max(QUEUE_STANDING_S, QUEUE_STANDING_RTT * self._base_rtt())

    def _base_rtt(self) -> float:
        """The round trip the queue thresholds scale with: the min RTT, never above the path's prior. A
        queue another flow (CUBIC) keeps standing from before our first sample inflates the min RTT, and
        thresholds scaled with it took that flow's drop-tail losses for the channel's (fairness bench)."""
        return 0.0 if self.min_rtt == math.inf else min(self.min_rtt, self._rtt_prior)

    def _congested(self, loss: float, now: float) -> bool:
        """Loss above the random floor with a queue standing, and not the echo of a cut or a drain."""
        if self.phase is Phase.DRAIN or now < self._quiet_until:
            return False
        # Two rounds in a row: a link that delivers in bursts (an LTE scheduler's gaps of tens of ms)
        # delays one round's packets without any queue of ours.
        return loss > self.loss_floor + LOSS_MARGIN and self._queued >= QUEUED_ROUNDS

    def _enter_drain(self, now: float) -> None:
        """Pace at DRAIN_GAIN for as long as the queue the newest round saw takes to empty (one round at
        least); losses within a smoothed RTT of now were caused before it."""
        if self.phase is Phase.STARTUP:
            self._refind = False  # STARTUP found the rate: the drain ends in CRUISE
        self.phase = Phase.DRAIN
        self._drain_until = now + max(self._round_len(), self.queue_delay_s / (1 - DRAIN_GAIN))
        self._quiet_until = now + self.srtt

    def _update_estimate(self) -> None:
        """The max of the recent full samples (none yet: the estimate stays)."""
        recent = list(self._samples)[-BTL_ROUNDS:]
        best = max((rate for rate, limited in recent if not limited), default=0.0)
        if best > 0:
            self.estimate_bps = self._clamp(best)

    def _step_phase(self, sample: float, app_limited: bool, congested: bool, now: float,
                    link_limited: bool) -> None:
        if congested:
            # Loss while a queue stands: the link was busy all round, so the round delivered its rate
            # (a burst of channel loss or a lost ACK may lower that count: never cut below DEEPEST_CUT).
            self.congestion_events += 1
            self.estimate_bps = self._clamp(CUT * min(self.estimate_bps,
                                                      max(sample, DEEPEST_CUT * self.estimate_bps)))
            self._samples.clear()
            self._samples.append((self.estimate_bps, False))
            self.phase, self._cycle = Phase.CRUISE, CRUISE_AFTER_CUT
            self._probe_doublings = 0
            self._refind = False
            self._quiet_until = now + self.srtt
        elif self.phase is Phase.STARTUP:
            if self.queue_delay_s > self._queue_standing() or link_limited:
                self._enter_drain(now)
            elif app_limited:
                return  # nothing learnt about the link's ceiling
            else:
                # The estimate is a max filter: a round that lost a burst to the channel, or whose ACKs
                # were lost (the next ones carry the count), does not lower it.
                if self.estimate_bps >= STARTUP_GROWTH * self._full_bw:
                    self._full_bw, self._missed = self.estimate_bps, 0
                else:
                    self._missed += 1
                if self._missed < STARTUP_MISSES:
                    self.pace_bps = self._clamp(STARTUP_GAIN * self.estimate_bps)
                    return
                self._enter_drain(now)
        elif self.phase is Phase.DRAIN:
            if self._standing_delay_s <= self._queue_congested() or now >= self._drain_until:
                self.phase, self._cycle = Phase.CRUISE, CRUISE_AFTER_CUT
                if self._refind:  # stays set through this STARTUP: an LTE cell's bursts spread its ACKs
                    self.phase, self._missed, self._full_bw = Phase.STARTUP, 0, 0.0
        else:
            self._step_cruise(now, sample)
        self.pace_bps = self._clamp(self._cycle_rate())

    def _step_cruise(self, now: float, sample: float) -> None:
        """Two rounds with a standing queue: cut the estimate (multiplicative decrease) and drain. Else the
        next round of the probe cycle, whose probe adds a step (additive increase: a bigger flow probes no
        harder than a smaller one, so flows sharing the link converge); a probe that found the link
        faster is repeated at once with twice the step (a link that grows is found in a few rounds)."""
        if self._standing_delay_s > self._queue_standing():
            self._standing += 1
            self._standing_rate = max(self._standing_rate, sample)
        else:
            self._standing, self._standing_rate = 0, 0.0
        if self._standing >= 2:
            # While the queue stood the link was busy: what it delivered is its rate (our share of it). The
            # max filter still holds the rate before a link slowed down, and a cut from that left the
            # queue standing round after round (pfec bench traces: P95s of 60-90 ms).
            slowed = self._standing_rate < LINK_SLOWED * self.estimate_bps
            self.estimate_bps = self._clamp(STANDING_CUT * (self._standing_rate if slowed
                                                            else self.estimate_bps))
            self._standing = self._probe_doublings = 0
            self._standing_rate = 0.0
            self._samples.clear()
            self._samples.append((self.estimate_bps, False))
            self._enter_drain(now)
            # A link that fell this far (an LTE cell's outage) comes back as fast: after the drain, find
            # its rate as a start does, not by additive probes from the outage's rate.
            self._refind = slowed
            return
        if self._cycle == 1:  # the probe's round trip is back: this round's sample saw it
            # Room, not a share taken: the probe raised the estimate with no queue above the base RTT (a
            # loss-based neighbour's standing queue hides from the recent floor, not from the base).
            found = self.estimate_bps > PROBE_FOUND * self._probe_from + self._probe_step_bps() / 2
            if found and self._queue_above_base_s() <= self._queue_congested():
                self._probe_doublings = min(self._probe_doublings + 1, PROBE_MAX_DOUBLINGS)
                self._cycle = len(PROBE_GAINS) - 1  # the next round probes again
            else:
                self._probe_doublings = 0
        self._cycle = (self._cycle + 1) % len(PROBE_GAINS)
        if self._cycle == 0:
            self._probe_from = self.estimate_bps

    def _cycle_rate(self) -> float:
        if self.phase is Phase.DRAIN:
            return DRAIN_GAIN * self.estimate_bps
        rate = PROBE_GAINS[self._cycle] * self.estimate_bps
        if self.phase is Phase.CRUISE and self._cycle == 0:
            # The doubled step stops at PROBE_MAX_GAIN of the estimate: a bursty link (LTE) lets probe
            # after probe find room, and an unbounded step reached 6x the estimate (pfec sim on the traces).
            step = self._probe_step_bps()
            room = max(step, (PROBE_MAX_GAIN - 1) * self.estimate_bps)
            rate += min(step * 2 ** self._probe_doublings, room)
        return rate

    def _update_forecast(self) -> None:
        rates = sorted(rate for rate, limited in list(self._samples)[-FORECAST_ROUNDS:] if not limited)
        if len(rates) < FORECAST_MIN_SAMPLES:
            # Too few samples since the start or the newest cut: the told rate until the path has taught
            # the estimate, then the estimate (a cut sets it cautiously). Never the drain's pace: at half
            # the estimate, a handoff that ended draining handed the next one's plan half the link
            # (pfec bench breakeven at 20 Mbit/s: predicted 2x the measured native handoff).
            told = self.start_bps if self.rounds < FORECAST_MIN_SAMPLES else math.inf
            self._forecast = min(told, self.estimate_bps)
        else:
            low = rates[int(FORECAST_QUANTILE * (len(rates) - 1))]
            self._forecast = self._clamp(min(low, self.estimate_bps))

    def _restart(self) -> None:
        """A new handoff after an idle spell: start from what was learnt, find the rate again."""
        self.start_bps = self.pace_bps = self._forecast = self.estimate_bps
        self.phase = Phase.STARTUP
        self._round_open, self._warm, self._missed, self._full_bw = None, False, 0, 0.0
        self._joined, self._ack_base, self._probe_doublings = None, (math.inf, 0), 0
        for history in (self._samples, self._recent_loss, self._recent_floor, self._ack_hist):
            history.clear()
        self._budget_span_s = self._budget_cap = math.inf
        self.last_delivery_at = None
        self.breaker_reason = None
        # What the last handoff sent that its receiver never counted (what followed its last ACK: the
        # tail's repairs, a split's front once the receiver started) will never be: not in flight. Kept
        # in flight, it piled up handoff after handoff until the cap held a slow path at a trickle.
        self._lost = self._packets_sent - self._delivered
        self._refresh_cap()

    def _clamp(self, rate_bps: float) -> float:
        rate = max(MIN_RATE_BPS, rate_bps)
        return rate if self.max_bps is None else min(rate, self.max_bps)
