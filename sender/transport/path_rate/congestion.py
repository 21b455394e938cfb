"""The congestion rule (RFC 8085 section 3.1, RFC 9265): loss above the random floor while a queue stands.

- A round whose loss exceeds the random-loss floor by ``LOSS_MARGIN`` while a queue stands for
  ``QUEUED_ROUNDS`` rounds in a row is congestion. One round is not enough: a bursty link (an LTE
  scheduler's gaps of tens of ms) delays one round's packets without any queue of ours.
- The cut: the link was busy all round, so the round delivered its rate. The estimate becomes ``CUT`` of
  that rate, or of itself if lower, never below ``DEEPEST_CUT`` of it (a burst of channel loss or a lost
  ACK may lower the round's count).
- The rule is silent while draining, and for a smoothed RTT after a cut or a drain began: those losses
  answer the cut or the overshoot before it.
- Loss in a round **clear of queues** is the channel's, the FEC's business: it sets the random-loss floor,
  and the delivery-rate sample credits it (:mod:`.delivery`). Clear means no queue of ours above
  ``congested_queue_s`` and none above the base RTT: a loss-based neighbour's standing queue inflates the
  min RTT, and its drop-tail losses are not the channel's.
"""

from __future__ import annotations

from typing import Final

from pfec.sender.transport.path_rate.rtt import RttEstimate

LOSS_MARGIN: Final = 0.02  # loss share above the random-loss floor that counts as congestion
QUEUED_ROUNDS: Final = 2  # rounds in a row with a queue before loss may be congestion
CUT: Final = 0.85  # the estimate after a congestion round (BBRv2's beta is 0.7 for inflight; we pace) ...
DEEPEST_CUT: Final = 0.5  # ... of the round's delivery rate, if lower, but not below this of the estimate


class CongestionRule:
    """Judges each round's loss, and counts the cuts it made."""

    __slots__ = ("_queued", "_quiet_until", "events", "queued")

    def __init__(self) -> None:
        self.events = 0  # congestion cuts so far
        self.queued = False  # the newest round's queueing delay could make loss congestion
        self._queued = 0  # ... this many rounds in a row
        self._quiet_until = 0.0  # losses before then answer an earlier cut or overshoot: no new cut

    def judge(self, now: float, loss: float, loss_floor: float, rtt: RttEstimate, draining: bool) -> bool:
        """Whether the round that just closed was congested."""
        self.queued = rtt.queue_delay_s > rtt.congested_queue_s()
        self._queued = self._queued + 1 if self.queued else 0
        if draining or now < self._quiet_until:
            return False
        return loss > loss_floor + LOSS_MARGIN and self._queued >= QUEUED_ROUNDS

    @staticmethod
    def clear(rtt: RttEstimate) -> bool:
        """The round now closing stood no queue of ours or another's: nothing in it could drop, its loss is
        the channel's (read before the round's RTTs close)."""
        limit = rtt.congested_queue_s()
        return rtt.round_queue_s() <= limit and rtt.queue_above_base_s() <= limit

    def cut(self, estimate_bps: float, rate_bps: float) -> float:
        """The estimate after a congested round that delivered ``rate_bps`` (to be clamped)."""
        self.events += 1
        return CUT * min(estimate_bps, max(rate_bps, DEEPEST_CUT * estimate_bps))

    def quiet(self, until: float) -> None:
        """No cut before ``until``."""
        self._quiet_until = until
