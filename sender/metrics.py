"""Prometheus metrics of the sender daemon: the ``pfec_sender_*`` series only it has (handoffs, prefill,
scheduler decisions, repairs). The shared families, the registry and the exposition are
``common/node/metrics.NodeMetrics``.

The daemon owns one ``SenderMetrics`` and calls its methods from the event loop; ``exposition()`` renders
the text format and ``serve()`` / ``aiohttp_handler()`` publish it at ``/metrics``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Final

from prometheus_client import CollectorRegistry

from pfec.common.node.metrics import DATAGRAM_TYPES, NodeMetrics, check_label
from pfec.common.plan.breakeven import DEFAULT_PRECISION_LEVELS
from pfec.common.wire.messages import PARSE_REASONS

__all__ = [
    "DATAGRAM_TYPES",
    "HANDOFF_OUTCOMES",
    "PRECISION_LEVELS",
    "SENDER_DROP_REASONS",
    "SenderMetrics",
]

HANDOFF_OUTCOMES: Final = ("done", "failed", "refused", "cancelled")
PRECISION_LEVELS: Final = ("int2", "int4", "int8", "native")
PLANNER_LEVELS: Final = tuple(level.name for level in DEFAULT_PRECISION_LEVELS)
#: ``common.wire.PARSE_REASONS`` plus what the sender session and daemon drop for (``transport/session.py``).
SENDER_DROP_REASONS: Final = (
    *sorted(PARSE_REASONS),
    "unexpected_type",  # a valid datagram of a type the session does not expect in its state
    "bad_result_part",  # RESULT part out of order / inconsistent
    "bad_ack_computed",  # an ACK's computed_tokens past the context (or non-zero outside a split)
    "bad_prefill_speed",  # an ACCEPT stating an implausible prefill speed (the ACCEPT applies without it)
    "unknown_session",  # session id of no active handoff
    "send_failed",  # sendto raised (ENOBUFS, EPERM by a firewall, ...)
    "junk_header",  # no valid header
    "junk_auth",  # does not open under any key (forged or corrupt)
    "bad_ack",  # an authentic ACK whose fields do not fit the session (applied nowhere)
    "accept_mismatch",  # an ACCEPT that does not echo this session's randomness (or a second one)
    "not_an_answer",  # a speed query got a reply that is no zero-source ACCEPT
    "bad_feedback",  # an authentic datagram the session could not apply (dropped, never raised)
    "malformed",  # an authentic body out of its domain (the key holder's bug)
    "other",
)

_DECISION_BUCKETS: Final = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3)
_HANDOFF_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_QUEUE_BUCKETS: Final = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
_PREFILL_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


HANDOFF_MODE_LABELS = ("handoff", "split", "local")


class SenderMetrics(NodeMetrics):
    """All ``pfec_sender_*`` series, in a registry of their own (``self.registry``)."""

    ROLE = "sender"
    PEERS = "receivers"
    DROP_REASONS = SENDER_DROP_REASONS
    UTILITY_HELP = "Recovered utility (0..1) reported in each handoff's RESULT."

    def __init__(self, registry: CollectorRegistry | None = None, *, process_metrics: bool = True,
                 shared: NodeMetrics | None = None) -> None:
        super().__init__(registry, process_metrics=process_metrics, shared=shared)
        self._repairs = self.counter("repairs", "Repair symbols generated and sent.")
        self._handoffs = self.counter("handoffs", "Finished handoffs, by outcome.", ["outcome"])
        self._handoff_duration = self.histogram(
            "handoff_duration_seconds",
            "From the control request to the handoff's end (RESULT, refusal, failure or cancel).",
            _HANDOFF_BUCKETS,
        )
        self._decision = self.histogram(
            "scheduler_decision_seconds",
            "CPU time of one scheduler decision (view refresh + masks + policy).",
            _DECISION_BUCKETS,
        )
        self._active = self.gauge("active_handoffs", "Handoffs in progress.")
        self._prefill = self.histogram("prefill_seconds", "Model prefill time per handoff.", _PREFILL_BUCKETS)
        self._window = self.gauge(
            "window_symbols", "Coding window (un-ACKed source symbols) at the latest decision."
        )
        self._deficit = self.gauge(
            "deficit_symbols", "Estimated repair deficit (symbols) at the latest decision."
        )
        self.precreate(self._handoffs, HANDOFF_OUTCOMES)
        self._precision_bytes = self.counter(
            "precision_bytes_sent", "KV bytes of the source symbols sent, by the precision of their pieces.",
            ["precision"])
        self.precreate(self._precision_bytes, PRECISION_LEVELS)
        self._planner = self.counter(
            "planner_choices", "The break-even planner's choice per handoff (local, handoff:P or split:P).",
            ["choice"])
        # At zero from start-up, so a panel's rate() sees a choice's first handoff.
        self.precreate(self._planner,
                       ["local", *(f"{m}:{p}" for m in ("handoff", "split") for p in PLANNER_LEVELS)])
        self._modes = self.counter(
            "handoff_modes", "Handoffs by the mode they ran in (handoff: the whole cache streams; split: the "
            "receiver prefills the front while the back streams; local: the receiver prefills everything).",
            ["mode"])
        self.precreate(self._modes, HANDOFF_MODE_LABELS)
        # The path controller (link.rate_control = path), per handoff at its end: bounded labels, none.
        self._rate_estimate = self.gauge(
            "rate_estimate_bytes_per_second", "The path controller's rate estimate at a handoff's end.")
        self._min_rtt = self.gauge("min_rtt_seconds", "The path controller's min RTT at a handoff's end.")
        self._queue_delay = self.histogram(
            "queueing_delay_seconds", "Queueing delay of the path's latest round, at each handoff's end.",
            _QUEUE_BUCKETS)
        self._congestion = self.counter("congestion_events", "Congestion cuts of the path controllers.")
        self._breaker = self.counter("circuit_breaker_trips", "Handoffs the circuit breaker stopped.")

    # ------------------------------------------------------------------ datagrams

    def datagrams_sent(self, kind: str | enum.Enum, count: int, nbytes: int) -> str:
        """As ``NodeMetrics``; REPAIRs also count in repairs_total."""
        label = super().datagrams_sent(kind, count, nbytes)
        if label == "repair":
            self._repairs.inc(count)
        return label

    # ------------------------------------------------------------------ handoffs

    def handoff_started(self) -> None:
        self._active.inc()

    def handoff_finished(
        self, outcome: str, duration_s: float, recovered_utility: float | None = None
    ) -> None:
        """End of a handoff begun with ``handoff_started``; ``recovered_utility`` from its RESULT, if any."""
        self._handoffs.labels(check_label(outcome, HANDOFF_OUTCOMES, "handoff outcome")).inc()
        self._active.dec()
        self._handoff_duration.observe(max(0.0, duration_s))
        if recovered_utility is not None:
            self.recovered_utility(recovered_utility)

    def prefill_done(self, seconds: float) -> None:
        self._prefill.observe(max(0.0, seconds))

    def precision_bytes_sent(self, level: str, nbytes: int) -> None:
        """KV bytes sent at ``level`` (int2, int4, int8, native) in one handoff."""
        label = check_label(level, PRECISION_LEVELS, "precision level")
        self._precision_bytes.labels(label).inc(max(0, nbytes))

    def planner_choice(self, choice: str) -> None:
        """The planner's choice for one handoff (``local``, ``handoff:P``, ``split:P``, P a known level)."""
        mode, _, level = choice.partition(":")
        if not (choice == "local" or (mode in ("handoff", "split") and level in PLANNER_LEVELS)):
            raise ValueError(f"unknown planner choice {choice!r}")
        self._planner.labels(choice).inc()

    def handoff_mode(self, mode: str) -> None:
        """One handoff ran in ``mode`` (handoff, split or local)."""
        self._modes.labels(check_label(mode, HANDOFF_MODE_LABELS, "handoff mode")).inc()

    def path_rate(self, estimate_bps: float, min_rtt_s: float, queue_delay_s: float, new_events: int) -> None:
        """A handoff on a measured path ended: the controller's estimate, min RTT, queueing delay and the
        congestion cuts during the handoff."""
        self._rate_estimate.set(estimate_bps / 8)
        if min_rtt_s < float("inf"):
            self._min_rtt.set(min_rtt_s)
        self._queue_delay.observe(max(0.0, queue_delay_s))
        self._congestion.inc(max(0, new_events))

    def circuit_breaker_tripped(self) -> None:
        self._breaker.inc()

    def scheduler_decision(self, seconds: float, window_symbols: int, deficit_symbols: float) -> None:
        """One policy decision: its CPU time and the state it saw."""
        self._decision.observe(max(0.0, seconds))
        self._window.set(window_symbols)
        self._deficit.set(deficit_symbols)

    def scheduler_decisions(self, decision_ns: Iterable[int]) -> None:
        """Bulk form for ``CpuMeter.decision_ns`` (nanoseconds per decision) collected by a session."""
        for ns in decision_ns:
            self._decision.observe(ns * 1e-9)
