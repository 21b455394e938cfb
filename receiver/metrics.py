"""Prometheus metrics of the receiver daemon: the ``pfec_receiver_*`` series only it has (sessions,
decoding, deadline, time to first token). The shared families, the registry and the exposition are
``common/node/metrics.NodeMetrics``.

The daemon owns one ``ReceiverMetrics`` and calls its methods from the event loop; ``exposition()`` renders
the text format and ``serve()`` / ``aiohttp_handler()`` publish it at ``/metrics``.

Deadline metrics (all in the receiver's own monotonic clock):

* lateness = generation start - deadline (>= 0; an early start counts as 0). A lateness above
  ``overrun_threshold_s`` (default 5 ms) is also a deadline overrun.
* slack = deadline - when the last useful symbol was decoded (how much earlier the data was complete).
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry

from pfec.common.node.metrics import DATAGRAM_TYPES, NodeMetrics, check_label
from pfec.common.wire.messages import PARSE_REASONS

__all__ = [
    "DATAGRAM_TYPES",
    "DEADLINE_OVERRUN_THRESHOLD_S",
    "FEC_DROP_REASONS",
    "RECEIVER_DROP_REASONS",
    "SESSION_OUTCOMES",
    "ReceiverMetrics",
]

#: done: RESULT delivered; refused: OFFER refused (never active); cancelled: sender's CLOSE;
#: timeout: the sender went silent; failed: anything else (rebuild or generation error, ...).
SESSION_OUTCOMES: Final = ("done", "refused", "cancelled", "timeout", "failed")
_ACTIVE_OUTCOMES: Final = tuple(o for o in SESSION_OUTCOMES if o != "refused")
#: ``"fec_" + r`` for every ``common.fec.FEC_ERROR_REASONS`` (receiver/session.py prefixes them);
#: listed here so importing the metrics does not load the codec (a test keeps the two in step).
FEC_DROP_REASONS: Final = (
    "fec_bad_dt",
    "fec_bad_nss",
    "fec_bad_repair_key",
    "fec_bad_symbol_size",
    "fec_empty_window",
    "fec_esi_out_of_range",
    "fec_no_nonzero_row",
    "fec_window_overflow",
)
#: The endpoint's handshake and junk reasons (unauthenticated junk is counted as junk, never by the type
#: byte it claims; everything else after authentication by its reason).
HANDSHAKE_DROP_REASONS: Final = (
    "junk_header",  # no valid header
    "junk_auth",  # does not open under any key (forged or corrupt)
    "amplification_limit",  # a reply withheld: 3x what the unproven peer sent (RFC 9000 s8.1)
    "handshake_expired",  # data for a handshake that timed out
    "handshake_evicted",  # a pending handshake pushed out by newer ones
    "bad_offer",  # an authentic OFFER with a field out of bounds
    "offer_mismatch",  # an OFFER part that disagrees with the session's first OFFER
    "no_session",  # session-key data for no session (a replay after a restart, or late data)
    "malformed",  # an authentic body out of its domain (the key holder's bug)
)
RECEIVER_DROP_REASONS: Final = (
    *sorted(PARSE_REASONS),
    *FEC_DROP_REASONS,
    *HANDSHAKE_DROP_REASONS,
    "unexpected_type",  # valid datagram the session does not expect in its state
    "bad_offer_part",  # OFFER part out of order / inconsistent
    "bad_done",  # a DONE whose counts contradict what arrived (more sources than the handoff, ...)
    "closed_session",  # data for a recently closed session
    "early_evicted",  # early data of an unknown session evicted by newer ones
    "early_overflow",  # too much early data for one unknown session
    "send_failed",  # sendto raised
    # A fan-out group's stream (receiver/fanout): a datagram naming the group that did not open under its
    # key (another stream's, forged, a type the group never carries), or a replay of one that did.
    "group_junk_header",
    "group_junk_auth",
    "group_bad_version",
    "group_replay",
    "group_too_old",
    "group_malformed",
    "other",
)
DEADLINE_OVERRUN_THRESHOLD_S: Final = 0.005

_LATENESS_BUCKETS: Final = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1)
_SLACK_BUCKETS: Final = (1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)
_TTFT_BUCKETS: Final = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class ReceiverMetrics(NodeMetrics):
    """All ``pfec_receiver_*`` series, in a registry of their own (``self.registry``)."""

    ROLE = "receiver"
    PEERS = "senders"
    DROP_REASONS = RECEIVER_DROP_REASONS
    UTILITY_HELP = "Recovered utility (0..1) of each session at its deadline."

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        overrun_threshold_s: float = DEADLINE_OVERRUN_THRESHOLD_S,
        process_metrics: bool = True,
        shared: NodeMetrics | None = None,
    ) -> None:
        if not overrun_threshold_s >= 0:
            raise ValueError(f"overrun_threshold_s must be >= 0 seconds, got {overrun_threshold_s!r}")
        self.overrun_threshold_s = overrun_threshold_s
        super().__init__(registry, process_metrics=process_metrics, shared=shared)
        self._stalls = self.counter(
            "decoder_stalls", "Times the decoded prefix was blocked by a missing symbol."
        )
        self._stall_seconds = self.counter("decoder_stall_seconds", "Time the decoded prefix spent blocked.")
        self._overruns = self.counter(
            "deadline_overruns",
            "Generations that started more than the overrun threshold after their deadline.",
        )
        self._lateness = self.histogram(
            "deadline_lateness_seconds",
            "Generation start minus deadline (0 when on time).",
            _LATENESS_BUCKETS,
        )
        self._slack = self.histogram(
            "deadline_slack_seconds",
            "Deadline minus the time the last useful symbol was decoded.",
            _SLACK_BUCKETS,
        )
        self._ttft = self.histogram(
            "ttft_seconds",
            "Time to first token: from the OFFER's arrival to the first generated token.",
            _TTFT_BUCKETS,
        )
        self._active = self.gauge(
            "sessions_active", "Live sessions: established ones and pending handshakes (not yet accepted)."
        )
        self._pending = self.gauge(
            "sessions_pending", "Pending handshakes (authentic OFFERs not yet established)."
        )
        self._sessions = self.counter("sessions", "Sessions ended (or refused), by outcome.", ["outcome"])
        self._decoded = self.counter("decoded_symbols", "Source symbols recovered (received or decoded).")
        self._redundant = self.counter(
            "repairs_redundant", "Repair symbols that arrived when their window was already decoded."
        )
        self.precreate(self._sessions, SESSION_OUTCOMES)

    # ------------------------------------------------------------------ decoding

    def symbols_decoded(self, count: int) -> None:
        self._decoded.inc(count)

    def redundant_repairs(self, count: int) -> None:
        self._redundant.inc(count)

    def decoder_stall(self, seconds: float, count: int = 1) -> None:
        """``count`` stalls lasting ``seconds`` in total (e.g. a session's stats at its end)."""
        self._stalls.inc(count)
        self._stall_seconds.inc(max(0.0, seconds))

    # ------------------------------------------------------------------ deadline and generation

    def deadline_started(self, lateness_s: float) -> bool:
        """Generation began ``lateness_s`` after the deadline; returns True when it counts as an overrun."""
        late = max(0.0, lateness_s)
        self._lateness.observe(late)
        overrun = late > self.overrun_threshold_s
        if overrun:
            self._overruns.inc()
        return overrun

    def deadline_slack(self, slack_s: float) -> None:
        """The last useful symbol was decoded ``slack_s`` before the deadline (clamped at 0)."""
        self._slack.observe(max(0.0, slack_s))

    def ttft(self, seconds: float) -> None:
        self._ttft.observe(max(0.0, seconds))

    # ------------------------------------------------------------------ sessions

    def sessions_live(self, established: int, pending: int) -> None:
        """The live sessions now: ``established`` in the endpoint plus ``pending`` handshakes."""
        self._active.set(established + pending)
        self._pending.set(pending)

    def session_finished(self, outcome: str) -> None:
        """A session ended (outcome other than ``refused``)."""
        self._sessions.labels(check_label(outcome, _ACTIVE_OUTCOMES, "session outcome")).inc()

    def session_refused(self) -> None:
        """An OFFER was refused; the session never became active."""
        self._sessions.labels("refused").inc()
