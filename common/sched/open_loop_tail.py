"""Open-loop protection of the sources no feedback can save (sans-IO, pure arithmetic).

A closed-loop policy repairs what an ACK reports missing. A source sent with less than
``FEEDBACK_RTTS`` round trips left before the send deadline cannot be repaired that way: its loss is
reported about a round trip later (plus the receiver's ACK interval), and the repair must still be sent
and may itself be lost. At a short deadline or a long RTT this tail is a large share of the handoff, or
all of it (the receiver establishes 1.5 RTT after the start; no ACK may ever arrive before the deadline).

So the session protects the tail *open loop*, as a fixed-rate code does: credit accrues with every
source sent in the tail, at ``rate`` repairs per source, and is spent on single repairs before the policy
is asked (the policy, and so the DDQN's features, are unchanged). Each repair covers every source sent in
the tail, as far as the receiver's decoder span reaches (the sender's ``SendPath.tail_width``): one code over
the tail, so a burst that outruns the repairs of a window is paid for by the repairs after it. Until the
first ACK, the handshake delays all feedback (``HANDSHAKE_RTTS``); when no closed-loop cycle fits after
it, the tail is the whole handoff (``OpenLoopTail.update``). The
rate covers the expected losses of a coding window plus ``MARGIN_SDS`` standard deviations of their
count: ``(p + MARGIN_SDS sqrt(p (2b - 1) / W)) / (1 - p)`` for loss rate ``p``, mean loss-run length
``b`` and window ``W``: the count of losses in ``W`` packets, runs of geometric length with mean ``b``,
has variance about ``p W (2b - 1)``; each repair is itself lost with probability ``p``. ``p`` is the
ACKs' loss count blended with the session's loss prior (``PRIOR_WEIGHT`` datagrams' worth), the prior
alone before any feedback; before the first RTT sample, the round trip is the path's prior (twice the
one-way delay).
"""

from __future__ import annotations

import math

#: The loss prior of a path the sender has no measurement of (the sender daemon's ``fec.loss_prior``):
#: 5%, the middle of the 1-10% datagram loss of the lossy edge links this transport is for. Erring high is
#: cheap: an unneeded tail repair displaces one of the least useful sources, while an unrepaired loss
#: loses the whole block it falls in. A daemon replaces it per receiver with what past handoffs measured.
DEFAULT_LOSS_PRIOR = 0.05
#: Round trips of time left below which feedback about a source sent now cannot bring its repair in time:
#: one for the report, half for the receiver's ACK interval and a repair lost on the way (as the session's
#: proactive repair window).
FEEDBACK_RTTS = 1.5
#: The mean loss-run length the rate assumes until an ACK measures it: two, a bursty edge link's (the
#: evaluation's main Gilbert-Elliott channel: 1.8). Assuming independent losses (one) instead would size
#: the rate for a spread a bursty channel's windows far exceed; as with the loss prior, erring high is
#: cheap: at a short deadline and long RTT no ACK may return before the deadline, so the whole handoff
#: runs on the priors (192 tokens at 200 ms RTT, rho 1.0: rate 0.12 with one, 0.14 with two).
BURST_PRIOR = 2.0
#: Round trips from the start before the first ACK can reach the sender: the ACCEPT returns after one,
#: the receiver establishes the session on the OFFER part the sender re-sends under the session key half a
#: round trip later, and its first ACK takes another half. No feedback about any source, however early it
#: was sent, comes back sooner.
HANDSHAKE_RTTS = 2.0
#: Round trips a closed loop needs after a loss is reported: one for the report of a lost repair, one for
#: its replacement, half for the ACK interval (the repair planner's ``RESEND_RTTS``).
CLOSED_LOOP_RTTS = 2.5
#: Datagrams' worth of weight the loss prior keeps against the ACKs' counts: a few coding windows, since
#: bursty channels (good / bad sojourns of tens of packets) say little about their long-run rate sooner.
PRIOR_WEIGHT = 256.0
#: Standard deviations of a window's loss count the rate covers beyond its mean: two, about 95% of windows
#: in a normal approximation, since the run-length model of the variance misses how a bursty channel's
#: runs cluster in its bad state (the evaluation's main Gilbert-Elliott channel, ge:0.001,0.5,0.02,0.1:
#: a 64-packet window's loss count has variance about 10 p W, the model says 2.6 p W).
MARGIN_SDS = 2.0
#: Highest loss rate and repair rate the tail plans for (a near-dead path is not worth the repairs).
MAX_LOSS = 0.5
MAX_RATE = 1.0


def tail_rate(loss: float, burst: float, window: int) -> float:
    """Repairs per source that cover a window's expected losses plus ``MARGIN_SDS`` standard deviations."""
    p = min(max(loss, 0.0), MAX_LOSS)
    if p <= 0.0 or window <= 0:
        return 0.0
    spread = math.sqrt(p * (2.0 * max(burst, 1.0) - 1.0) / window)
    return min(MAX_RATE, (p + MARGIN_SDS * spread) / (1.0 - p))


class OpenLoopTail:
    """The tail's state for one session: whether it has begun, its repair rate and its credit."""

    __slots__ = (
        "active", "credit", "enabled", "loss", "lost", "prior", "rate", "rtt_prior", "seen", "window",
    )

    def __init__(self, enabled: bool, loss_prior: float, rtt_prior: float, window: int) -> None:
        if not 0.0 <= loss_prior < 1.0:
            raise ValueError(f"loss prior must be in [0, 1), got {loss_prior!r}")
        self.enabled = enabled
        self.prior = loss_prior
        self.rtt_prior = rtt_prior
        self.window = window
        self.active = False
        self.credit = 0.0
        self.loss = loss_prior
        self.lost = self.seen = 0  # the newest ACK's cumulative counters (what the path measured)
        self.rate = tail_rate(loss_prior, BURST_PRIOR, window)

    def feedback_rtt(self, rtt_estimate: float) -> float:
        """The round trip feedback takes: the session's estimate, or the path's prior before a sample."""
        return rtt_estimate if rtt_estimate > 0.0 else self.rtt_prior

    def update(self, time_left: float, rtt_estimate: float, since_start: float | None = None) -> bool:
        """Whether sources sent now fall in the tail (once in, a session stays in: time only runs out).

        ``since_start``: the time since the session started while no ACK has arrived yet (None once one
        has). The first ACK then comes ``HANDSHAKE_RTTS`` after the start at the earliest, reporting every
        loss so far at once. Unless one whole closed-loop cycle (``CLOSED_LOOP_RTTS``: a repair, and the
        replacement of a lost one) fits between it and the tail's last ``FEEDBACK_RTTS``, the closed loop
        repairs nothing the tail's code would not, only later, and in one shot: then every source is in
        the tail, one open-loop code over the whole handoff. (Measured, ``pfec sim``-style cells, main GE,
        20 realizations, priorityfec's share of the oracle: 192 tokens at 50 ms RTT, rho 0.8, a send
        window of 5.7 RTT: 0.964 closed loop first, 0.970 open loop throughout; 384 at 100 ms: 0.969 and
        0.979.)"""
        if self.enabled and not self.active:
            rtt = self.feedback_rtt(rtt_estimate)
            if time_left < FEEDBACK_RTTS * rtt:
                self.active = True
            elif since_start is not None:
                first_ack = max(0.0, HANDSHAKE_RTTS * rtt - since_start)
                self.active = time_left < first_ack + (CLOSED_LOOP_RTTS + FEEDBACK_RTTS) * rtt
        return self.active

    def on_ack(self, lost: int, seen: int, burst: float) -> None:
        """An ACK's cumulative counters: the loss blended with the prior, and the rate for it."""
        if seen >= self.seen:  # a reordered older ACK counts less
            self.lost, self.seen = lost, seen
        self.loss = (lost + self.prior * PRIOR_WEIGHT) / (seen + PRIOR_WEIGHT)
        self.rate = tail_rate(self.loss, burst, self.window)

    def on_source(self) -> None:
        if self.active:
            self.credit += self.rate

    def take(self) -> bool:
        """Spend one repair's credit if there is one."""
        if self.credit >= 1.0:
            self.credit -= 1.0
            return True
        return False
