"""Prometheus metrics of the receiver daemon (one registry per instance; no global state).

The daemon owns one ``ReceiverMetrics`` and calls its methods from the event loop; ``exposition()`` renders
the text format and ``serve()`` / ``aiohttp_handler()`` publish it at ``/metrics``. Label values come from
fixed sets so a hostile peer cannot grow the series count: unknown drop reasons count as ``other``;
unknown datagram types and outcomes are programming errors (``ValueError``). Every labelled series is
created at zero up front, so ``rate()`` and alerts see it before the first event.

Deadline metrics (all in the receiver's own monotonic clock):

* lateness = generation start - deadline (>= 0; an early start counts as 0). A lateness above
  ``overrun_threshold_s`` (default 5 ms) is also a deadline overrun.
* slack = deadline - when the last useful symbol was decoded (how much earlier the data was complete).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.process_collector import ProcessCollector

from pfec.common.node.metrics import DATAGRAM_TYPES, DatagramCounters, MetricsEndpoint
from pfec.common.wire.frames import PARSE_REASONS

if TYPE_CHECKING:
    pass

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
RECEIVER_DROP_REASONS: Final = (
    *sorted(PARSE_REASONS),
    *FEC_DROP_REASONS,
    "unexpected_type",  # valid datagram the session does not expect in its state
    "bad_offer_part",  # OFFER part out of order / inconsistent
    "closed_session",  # data for a recently closed session
    "early_evicted",  # early data of an unknown session evicted by newer ones
    "early_overflow",  # too much early data for one unknown session
    "send_failed",  # sendto raised
    "other",
)
DEADLINE_OVERRUN_THRESHOLD_S: Final = 0.005

_LATENESS_BUCKETS: Final = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1)
_SLACK_BUCKETS: Final = (1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)
_TTFT_BUCKETS: Final = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
_UTILITY_BUCKETS: Final = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


class ReceiverMetrics(MetricsEndpoint, DatagramCounters):
    """All ``pfec_receiver_*`` series, in a registry of their own (``self.registry``)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        overrun_threshold_s: float = DEADLINE_OVERRUN_THRESHOLD_S,
        process_metrics: bool = True,
    ) -> None:
        if not overrun_threshold_s >= 0:
            raise ValueError(f"overrun_threshold_s must be >= 0 seconds, got {overrun_threshold_s!r}")
        self.overrun_threshold_s = overrun_threshold_s
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        if process_metrics:
            ProcessCollector(registry=r)
        self._received = Counter(
            "pfec_receiver_datagrams_received", "Datagrams received, by message type.", ["type"], registry=r
        )
        self._bytes_received = Counter(
            "pfec_receiver_bytes_received", "UDP payload bytes received (before parsing).", registry=r
        )
        self._sent = Counter(
            "pfec_receiver_datagrams_sent",
            "Datagrams sent to senders, by message type.",
            ["type"],
            registry=r,
        )
        self._bytes_sent = Counter("pfec_receiver_bytes_sent", "UDP payload bytes sent.", registry=r)
        self._dropped = Counter(
            "pfec_receiver_datagrams_dropped",
            "Datagrams dropped (parse, authentication, replay, codec, session state), by reason.",
            ["reason"],
            registry=r,
        )
        self._stalls = Counter(
            "pfec_receiver_decoder_stalls",
            "Times the decoded prefix was blocked by a missing symbol.",
            registry=r,
        )
        self._stall_seconds = Counter(
            "pfec_receiver_decoder_stall_seconds", "Time the decoded prefix spent blocked.", registry=r
        )
        self._overruns = Counter(
            "pfec_receiver_deadline_overruns",
            "Generations that started more than the overrun threshold after their deadline.",
            registry=r,
        )
        self._lateness = Histogram(
            "pfec_receiver_deadline_lateness_seconds",
            "Generation start minus deadline (0 when on time).",
            buckets=_LATENESS_BUCKETS,
            registry=r,
        )
        self._slack = Histogram(
            "pfec_receiver_deadline_slack_seconds",
            "Deadline minus the time the last useful symbol was decoded.",
            buckets=_SLACK_BUCKETS,
            registry=r,
        )
        self._ttft = Histogram(
            "pfec_receiver_ttft_seconds",
            "Time to first token: from the OFFER's arrival to the first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self._utility = Histogram(
            "pfec_receiver_recovered_utility",
            "Recovered utility (0..1) of each session at its deadline.",
            buckets=_UTILITY_BUCKETS,
            registry=r,
        )
        self._active = Gauge(
            "pfec_receiver_sessions_active", "Sessions accepted and not yet closed.", registry=r
        )
        self._sessions = Counter(
            "pfec_receiver_sessions", "Sessions ended (or refused), by outcome.", ["outcome"], registry=r
        )
        self._decoded = Counter(
            "pfec_receiver_decoded_symbols", "Source symbols recovered (received or decoded).", registry=r
        )
        self._redundant = Counter(
            "pfec_receiver_repairs_redundant",
            "Repair symbols that arrived when their window was already decoded.",
            registry=r,
        )
        # Resolved once: .labels() costs several microseconds per call on the per-datagram path.
        self._sent_by_type = {t: self._sent.labels(t) for t in DATAGRAM_TYPES}
        self._received_by_type = {t: self._received.labels(t) for t in DATAGRAM_TYPES}
        for reason in RECEIVER_DROP_REASONS:
            self._dropped.labels(reason)
        for outcome in SESSION_OUTCOMES:
            self._sessions.labels(outcome)

    # ------------------------------------------------------------------ datagrams

    def dropped(self, reason: str, count: int = 1) -> None:
        """Count ``count`` dropped datagrams; reasons outside ``RECEIVER_DROP_REASONS`` count as ``other``."""
        self._dropped.labels(reason if reason in RECEIVER_DROP_REASONS else "other").inc(count)

    def drops(self, counts: dict[str, int]) -> None:
        """Add a session's/endpoint's ``drops`` dict (reason -> count) at once."""
        for reason, n in counts.items():
            if n:
                self.dropped(reason, n)

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

    def recovered_utility(self, utility: float) -> None:
        self._utility.observe(min(1.0, max(0.0, utility)))

    # ------------------------------------------------------------------ sessions

    def session_started(self) -> None:
        self._active.inc()

    def session_finished(self, outcome: str) -> None:
        """A session begun with ``session_started`` ended (outcome other than ``refused``)."""
        if outcome not in SESSION_OUTCOMES or outcome == "refused":
            allowed = ", ".join(o for o in SESSION_OUTCOMES if o != "refused")
            raise ValueError(f"unknown session outcome {outcome!r}; expected one of {allowed}")
        self._sessions.labels(outcome).inc()
        self._active.dec()

    def session_refused(self) -> None:
        """An OFFER was refused; the session never became active."""
        self._sessions.labels("refused").inc()
