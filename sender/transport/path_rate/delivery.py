"""The delivery rate: one sample per round, the bottleneck estimate (a max filter) and the random-loss floor.

- **Samples.** When a round closes it gives one sample of what the bottleneck carried. The receiver counts
  each data datagram that arrived or went missing (the ACKs' cumulative ``received`` and ``lost``). The
  sample is over the time between the ACKs that opened and closed the round. Counters, not send times:
  jitter on the return path moves a sample's ends, never the count.
- The span is never less than ``SEND_SPAN_SHARE`` of the time over which the newly acknowledged datagrams
  were sent (after BBR's rate sample): ACKs bunched on the way back shorten the first span.
- Random loss happens after the bottleneck: the link carried those datagrams. A sample that counted only
  what arrived would read a lossy link as a slower one (a 17% loss, a sixth of the link unused).
- A round **clear of queues** (ours and a neighbour's, see :mod:`.congestion`) had nothing that could drop
  at the bottleneck: its losses are the channel's, and all of them are credited. Its sample is the send
  rate the link carried without a queue, or, if a queue grew during the round, the rate it drained at.
- Where a queue stood, a loss may be a drop: only the random-loss floor's share is credited, never more
  than the round lost. Loss above the floor stays uncredited (RFC 9265: FEC does not hide congestion).
- No round credits more than ``MAX_LOSS_CREDIT`` of what it sent, whatever the loss or the floor.
- **Estimate.** The bottleneck rate is the largest sample of the last ``BTL_ROUNDS`` rounds. A sample
  understates the link when the sender was app-limited or a neighbour had a burst; only a queue lets it
  overstate, and the drain phases empty that.
- A round in which the sender sent less than ``APP_LIMITED_SHARE`` of its pace, never held by the
  in-flight cap, is **app-limited**: its sample counts only if it raises the estimate.
- **Random-loss floor.** The loss of rounds clear of queues is the channel's, the FEC's business: the
  floor is its running mean, then an average (weight ``FLOOR_GAIN``). The prior counts as one round, so a
  wrong prior is gone within a few rounds. Repaired losses count: the counters are the receiver's.
"""

from __future__ import annotations

from collections import deque
from typing import Final, NamedTuple

BTL_ROUNDS: Final = 8  # max filter length, in rounds
SEND_SPAN_SHARE: Final = 0.5  # a round's sample is at most 1/this of the rate its datagrams were sent at
MAX_LOSS_CREDIT: Final = 0.5  # a sample credits at most this share of what the round sent as lost
APP_LIMITED_SHARE: Final = 0.8  # a round that sent less than this share of its pace is app-limited
FLOOR_GAIN: Final = 0.125  # weight of a queue-free round's loss in the random-loss floor (once warm)
MAX_FLOOR: Final = 0.5  # the floor (and a prior) never above this
MIN_RATE_BPS: Final = 100e3  # no rate falls below this (a floor, not a target)


class RoundSample(NamedTuple):
    """What one closed round measured."""

    rate_bps: float  # what the bottleneck carried: the delivery rate, the loss credited back
    app_limited: bool
    delivered: int  # data datagrams the receiver counted in the round
    lost: int
    ack_span_s: float  # between the ACKs that opened and closed it
    send_span_s: float  # between the sending of the datagrams those ACKs were the newest of

    @property
    def loss(self) -> float:
        total = self.lost + self.delivered
        return self.lost / total if total else 0.0


class DeliveryRate:
    """Rounds of delivery counts, the max filter over their samples, and the random-loss floor."""

    __slots__ = ("_delivered_at_open", "_lost_at_open", "_newest_sent_at_open", "_sent_at_open",
                 "estimate_bps", "floor_rounds", "loss_floor", "max_bps", "opened_at",
                 "samples", "warm")

    def __init__(self, start_bps: float, max_bps: float | None, loss_prior: float, keep_rounds: int) -> None:
        self.max_bps = max_bps
        self.estimate_bps = self.clamp(start_bps)  # bottleneck rate: the max filter's value
        # A prior that is not a loss share (NaN, negative, 1 or more) is none: the rounds teach the floor.
        self.loss_floor = min(loss_prior, MAX_FLOOR) if 0.0 <= loss_prior < 1.0 else 0.0
        self.floor_rounds = 0  # rounds learnt into the floor
        self.samples: deque[tuple[float, bool]] = deque(maxlen=keep_rounds)  # (rate, app-limited)
        self.opened_at: float | None = None  # the ACK time that opened the current round
        self.warm = False  # the first round closed (its sample is not taken: see ``close``)
        self._delivered_at_open = 0  # the hooks' cumulative counts when the round opened
        self._lost_at_open = 0
        self._sent_at_open = 0
        self._newest_sent_at_open = 0.0  # the newest acknowledged datagram's send time then

    def clamp(self, rate_bps: float) -> float:
        rate = max(MIN_RATE_BPS, rate_bps)
        return rate if self.max_bps is None else min(rate, self.max_bps)

    def open(self, now: float, delivered: int, lost: int, sent: int, newest_sent_at: float) -> None:
        self.opened_at = now
        self._delivered_at_open = delivered
        self._lost_at_open = lost
        self._sent_at_open = sent
        self._newest_sent_at_open = newest_sent_at

    def write_off(self, count: int) -> None:
        """Datagrams an ended session wrote off: out of flight, but no loss of the open round's."""
        self._lost_at_open += count

    def close(self, now: float, delivered: int, lost: int, sent: int, newest_sent_at: float,
              datagram_bytes: int, pace_bps: float, capped: bool, clear: bool) -> RoundSample | None:
        """The round's sample, or None for the first round after a start: the receiver counts what it held
        before the handshake in a burst of ACKs. ``clear``: no queue stood in the round (its loss is the
        channel's)."""
        assert self.opened_at is not None
        ack_span, send_span = now - self.opened_at, newest_sent_at - self._newest_sent_at_open
        span = max(ack_span, SEND_SPAN_SHARE * send_span)
        bits = 8 * datagram_bytes
        delivered -= self._delivered_at_open
        lost -= self._lost_at_open
        rate = (delivered + self.credit(delivered, lost, clear)) * bits / span
        sent_bps = (sent - self._sent_at_open) * bits / span
        if not self.warm:
            self.warm = True
            return None
        app_limited = sent_bps < APP_LIMITED_SHARE * pace_bps and not capped and rate <= self.estimate_bps
        return RoundSample(rate, app_limited, delivered, lost, ack_span, send_span)

    def credit(self, delivered: int, lost: int, clear: bool) -> float:
        """The datagrams lost after the bottleneck that a sample counts as carried: all of a round clear of
        queues, else the floor's share; never more than lost, nor ``MAX_LOSS_CREDIT`` of what was sent."""
        total = delivered + lost
        share = MAX_LOSS_CREDIT if clear else min(self.loss_floor, MAX_LOSS_CREDIT)
        return float(min(lost, share * total)) if lost > 0 else 0.0

    def take(self, sample: RoundSample) -> None:
        """Into the max filter: the largest full sample of the last ``BTL_ROUNDS`` (none: it stays)."""
        self.samples.append((sample.rate_bps, sample.app_limited))
        recent = list(self.samples)[-BTL_ROUNDS:]
        best = max((rate for rate, limited in recent if not limited), default=0.0)
        if best > 0:
            self.estimate_bps = self.clamp(best)

    def learn_floor(self, loss: float) -> None:
        """A round's loss the channel made (no queue stood): into the random-loss floor. The first rounds take
        a running mean (the prior weighs one round), then ``FLOOR_GAIN``."""
        self.floor_rounds += 1
        gain = max(FLOOR_GAIN, 1 / (self.floor_rounds + 1))
        self.loss_floor = min(MAX_FLOOR, self.loss_floor + gain * (loss - self.loss_floor))

    def restart_from(self, rate_bps: float) -> None:
        """A cut: the estimate is ``rate_bps``, and the max filter starts over from it."""
        self.estimate_bps = self.clamp(rate_bps)
        self.samples.clear()
        self.samples.append((self.estimate_bps, False))

    def restart(self) -> None:
        """A new handoff after an idle spell: no round open, no sample, the estimate kept."""
        self.opened_at, self.warm = None, False
        self.samples.clear()
