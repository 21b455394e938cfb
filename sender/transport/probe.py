"""The probe timeout (sans-IO): a sender that waits on feedback which does not come sends a probe.

A closed-loop sender counts the repairs in flight as arriving until an ACK says otherwise, and the
receiver ACKs only what it receives. When the last repairs of a round are lost (or the ACK that answered
them is), no ACK comes: the sender sees no deficit left and goes quiet with symbols missing, time and
budget left (measured: the default demo idled its last 740-900 ms holding 800-900 repairs, and 10% of
tiny relay handoffs ended with a symbol undecoded). As QUIC does (RFC 9002 section 6.2), a probe timer
runs from the newest data datagram sent while any is unacknowledged: PTO = smoothed RTT +
max(4 x RTT variation, granularity) + the receiver's ACK delay, before an RTT sample 3 x the RTT prior
plus the ACK delay, doubled on every expiry without an ACK in between. On expiry the sender owes
``PTO_PROBES`` repairs over what the receiver lacks most (``SendPath.repair(probe=True)``): useful
if the last round was lost, and whichever arrives elicits the ACK that says what is still missing.

The session asks only while it streams after the ACCEPT; ``expiry`` says whether the timer is armed.
"""

from __future__ import annotations

from pfec.common.sched.actions import SchedulerView
from pfec.sender.transport.inflight import InFlight

PTO_PROBES = 2  # repairs owed per expiry (RFC 9002 allows two: one may be lost)
GRANULARITY_S = 0.001  # RFC 9002's kGranularity: the timer's floor above the smoothed RTT
MAX_BACKOFF = 6  # expiries doubling the timer at most (64x): it stays within a handoff's deadline


class ProbeTimer:
    """When to probe: the newest data send plus the probe timeout, backed off per expiry."""

    __slots__ = ("expiries", "last_sent", "max_ack_delay_s", "owed", "rtt_prior_s", "sent")

    def __init__(self, max_ack_delay_s: float, rtt_prior_s: float) -> None:
        self.max_ack_delay_s = max_ack_delay_s
        self.rtt_prior_s = rtt_prior_s  # before an RTT sample (twice the configured one-way delay)
        self.last_sent = 0.0  # the newest data datagram's send time
        self.expiries = 0  # consecutive expiries without an ACK: the backoff exponent
        self.owed = 0  # probe repairs still to send
        self.sent = 0  # probe repairs sent in all

    def timeout(self, srtt: float, rttvar: float) -> float:
        """The probe timeout for the RTT estimates, backed off."""
        if srtt <= 0.0:
            srtt, rttvar = self.rtt_prior_s, self.rtt_prior_s / 2
        base = srtt + max(4.0 * rttvar, GRANULARITY_S) + self.max_ack_delay_s
        return base * (1 << min(self.expiries, MAX_BACKOFF))

    def deadline(self, srtt: float, rttvar: float) -> float:
        return self.last_sent + self.timeout(srtt, rttvar)

    def expiry(self, view: SchedulerView, inflight: InFlight, next_esi: int, ack_prefix: int, rttvar: float,
               send_deadline: float) -> float | None:
        """When the timer expires, or None while it is not armed: it runs only while the receiver lacks
        symbols (the ACKs' prefix), something is unacknowledged, a closed-loop repair is left, no probe
        is owed, and it would expire before the send deadline."""
        if view.open_loop or view.repairs_left <= 0 or self.owed or ack_prefix >= view.n_source:
            return None
        if inflight.repairs_acked >= view.repairs_sent and inflight.acked_source_end >= next_esi:
            return None  # everything sent is acknowledged: the ACK's deficit drives the next repair
        at = self.deadline(view.rtt_estimate, rttvar)
        return at if at < send_deadline else None

    def on_sent(self, now: float, probe: bool) -> None:
        """A data datagram went out (``probe``: a probe repair, counted)."""
        self.last_sent = now
        self.sent += probe

    def on_ack(self) -> None:
        """A plausible ACK arrived: the path answers, the backoff resets."""
        self.expiries = 0

    def expire(self) -> None:
        self.expiries += 1
        self.owed = PTO_PROBES

    def take(self) -> bool:
        """Whether a probe is owed (and takes it)."""
        if self.owed <= 0:
            return False
        self.owed -= 1
        return True

    def nothing_to_probe(self) -> None:
        """A probe found nothing to repair (an ACK that arrived after the expiry acknowledged everything
        sent): the probes still owed are dropped, and the slot goes to the policy (the next source elicits
        an ACK as well). Kept owed, each would take a decision and send nothing, and the sender, which
        then has nothing unacknowledged to time, would idle to its deadline (seen in CI: a handoff sent
        272 of its 1024 sources in 4 s at a rate that needed 1 s)."""
        self.owed = 0
