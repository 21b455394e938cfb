"""Prometheus metrics of the sender daemon (one registry per instance; no global state).

The daemon owns one ``SenderMetrics`` and calls its methods from the event loop; ``exposition()`` renders
the text format and ``serve()`` / ``aiohttp_handler()`` publish it at ``/metrics``. Label values come from
fixed sets (below) so a hostile peer cannot grow the series count: unknown drop reasons are counted as
``other``, unknown datagram types and outcomes are programming errors (``ValueError``).
Every labelled series is created at zero up front, so ``rate()`` and alerts see it before the first event.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
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
    "HANDOFF_OUTCOMES",
    "SENDER_DROP_REASONS",
    "SenderMetrics",
]

HANDOFF_OUTCOMES: Final = ("done", "failed", "refused", "cancelled")
#: ``common.wire.PARSE_REASONS`` plus what the sender session and daemon drop for (see ``sender/session.py``).
SENDER_DROP_REASONS: Final = (
    *sorted(PARSE_REASONS),
    "unexpected_type",  # a valid datagram of a type the session does not expect in its state
    "bad_result_part",  # RESULT part out of order / inconsistent
    "unknown_session",  # session id of no active handoff
    "send_failed",  # sendto raised (ENOBUFS, EPERM by a firewall, ...)
    "other",
)

_DECISION_BUCKETS: Final = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3)
_UTILITY_BUCKETS: Final = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
_HANDOFF_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_PREFILL_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


def _check_in(value: str, allowed: Iterable[str], what: str) -> str:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(allowed)}")
    return value


class SenderMetrics(MetricsEndpoint, DatagramCounters):
    """All ``pfec_sender_*`` series, in a registry of their own (``self.registry``)."""

    def __init__(self, registry: CollectorRegistry | None = None, *, process_metrics: bool = True) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        if process_metrics:
            ProcessCollector(registry=r)  # process_cpu_seconds_total, RSS, open fds
        self._sent = Counter(
            "pfec_sender_datagrams_sent", "Datagrams sent, by message type.", ["type"], registry=r
        )
        self._bytes_sent = Counter(
            "pfec_sender_bytes_sent", "UDP payload bytes sent (sealed datagrams).", registry=r
        )
        self._received = Counter(
            "pfec_sender_datagrams_received",
            "Datagrams received from receivers, by type.",
            ["type"],
            registry=r,
        )
        self._bytes_received = Counter(
            "pfec_sender_bytes_received", "UDP payload bytes received.", registry=r
        )
        self._dropped = Counter(
            "pfec_sender_datagrams_dropped",
            "Received datagrams dropped (parse, authentication, replay, session state) and failed sends.",
            ["reason"],
            registry=r,
        )
        self._repairs = Counter("pfec_sender_repairs", "Repair symbols generated and sent.", registry=r)
        self._handoffs = Counter(
            "pfec_sender_handoffs", "Finished handoffs, by outcome.", ["outcome"], registry=r
        )
        self._handoff_duration = Histogram(
            "pfec_sender_handoff_duration_seconds",
            "From the control request to the handoff's end (RESULT, refusal, failure or cancel).",
            buckets=_HANDOFF_BUCKETS,
            registry=r,
        )
        self._decision = Histogram(
            "pfec_sender_scheduler_decision_seconds",
            "CPU time of one scheduler decision (view refresh + masks + policy).",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self._utility = Histogram(
            "pfec_sender_recovered_utility",
            "Recovered utility (0..1) reported in each handoff's RESULT.",
            buckets=_UTILITY_BUCKETS,
            registry=r,
        )
        self._active = Gauge("pfec_sender_active_handoffs", "Handoffs in progress.", registry=r)
        self._prefill = Histogram(
            "pfec_sender_prefill_seconds",
            "Model prefill time per handoff.",
            buckets=_PREFILL_BUCKETS,
            registry=r,
        )
        self._window = Gauge(
            "pfec_sender_window_symbols",
            "Coding window (un-ACKed source symbols) at the latest decision.",
            registry=r,
        )
        self._deficit = Gauge(
            "pfec_sender_deficit_symbols",
            "Estimated repair deficit (symbols) at the latest decision.",
            registry=r,
        )
        # Resolved once: .labels() costs several microseconds per call on the per-datagram path.
        self._sent_by_type = {t: self._sent.labels(t) for t in DATAGRAM_TYPES}
        self._received_by_type = {t: self._received.labels(t) for t in DATAGRAM_TYPES}
        for reason in SENDER_DROP_REASONS:
            self._dropped.labels(reason)
        for outcome in HANDOFF_OUTCOMES:
            self._handoffs.labels(outcome)

    # ------------------------------------------------------------------ datagrams

    def datagrams_sent(self, kind: str | enum.Enum, count: int, nbytes: int) -> str:
        """As DatagramCounters; REPAIRs also count in repairs_total."""
        label = super().datagrams_sent(kind, count, nbytes)
        if label == "repair":
            self._repairs.inc(count)
        return label

    def dropped(self, reason: str, count: int = 1) -> None:
        """Count ``count`` dropped datagrams; reasons outside ``SENDER_DROP_REASONS`` count as ``other``."""
        self._dropped.labels(reason if reason in SENDER_DROP_REASONS else "other").inc(count)

    # ------------------------------------------------------------------ handoffs

    def handoff_started(self) -> None:
        self._active.inc()

    def handoff_finished(
        self, outcome: str, duration_s: float, recovered_utility: float | None = None
    ) -> None:
        """End of a handoff begun with ``handoff_started``; ``recovered_utility`` from its RESULT, if any."""
        self._handoffs.labels(_check_in(outcome, HANDOFF_OUTCOMES, "handoff outcome")).inc()
        self._active.dec()
        self._handoff_duration.observe(max(0.0, duration_s))
        if recovered_utility is not None:
            self._utility.observe(min(1.0, max(0.0, recovered_utility)))

    def prefill_done(self, seconds: float) -> None:
        self._prefill.observe(max(0.0, seconds))

    def scheduler_decision(self, seconds: float, window_symbols: int, deficit_symbols: float) -> None:
        """One policy decision: its CPU time and the state it saw."""
        self._decision.observe(max(0.0, seconds))
        self._window.set(window_symbols)
        self._deficit.set(deficit_symbols)

    def scheduler_decisions(self, decision_ns: Iterable[int]) -> None:
        """Bulk form for ``CpuMeter.decision_ns`` (nanoseconds per decision) collected by a session."""
        for ns in decision_ns:
            self._decision.observe(ns * 1e-9)
