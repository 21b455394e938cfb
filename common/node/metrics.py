"""What both daemons' Prometheus metrics share: one registry per instance (no global state), the process
collector, the families both nodes define (datagrams and bytes by direction and wire type, drops by reason,
recovered utility), the ``/metrics`` exposition, and the export of a session's drop counts.

``SenderMetrics`` and ``ReceiverMetrics`` subclass ``NodeMetrics``: each names its role, its peers and its
drop reasons, and adds only its own series through ``counter`` / ``gauge`` / ``histogram`` (which prefix
``pfec_<role>_``). Label values come from fixed sets so a hostile peer cannot grow the series count:
unknown drop reasons count as ``other``; unknown datagram types and outcomes are programming errors
(``ValueError``); a received datagram that does not parse or authenticate counts as type ``junk``, never by
the type byte it claims. Every labelled series is created at zero up front, so ``rate()`` and alerts see it
before the first event. Names carry base units (``_seconds``, ``_bytes``); counters get ``_total``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import ClassVar, Final

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.process_collector import ProcessCollector

from pfec.common.plan.prefix_store import StoreStats
from pfec.common.wire.messages import TYPE_MASK, MsgType

DATAGRAM_TYPES: Final = ("source", "repair", "ack", "offer", "accept", "refuse", "result", "close", "done",
                          "junk")
#: Message type (``MsgType`` value) -> its label.
MSG_TYPE_LABELS: Final[dict[int, str]] = {int(t): t.name.lower() for t in MsgType}
#: Wire type byte (``datagram[1]``: the type under the key-phase bits) -> its label, for the daemons'
#: per-datagram send paths (every byte value is a key: a lookup, no masking, on the hot path).
TYPE_BYTE_LABELS: Final[dict[int, str]] = {
    b: MSG_TYPE_LABELS[b & TYPE_MASK] for b in range(256) if (b & TYPE_MASK) in MSG_TYPE_LABELS
}
#: Drop reasons of datagrams that never authenticated (or never parsed): junk, whatever type they claim.
JUNK_REASONS: Final = ("junk_header", "junk_auth", "bad_version")
UTILITY_BUCKETS: Final = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


def type_label(kind: str | enum.Enum) -> str:
    """``MsgType.SOURCE`` or ``"source"`` -> ``"source"``; ValueError for anything else."""
    name = kind.name.lower() if isinstance(kind, enum.Enum) else str(kind).lower()
    if name not in DATAGRAM_TYPES:
        raise ValueError(f"unknown datagram type {kind!r}; expected one of {', '.join(DATAGRAM_TYPES)}")
    return name


def check_label(value: str, allowed: Iterable[str], what: str) -> str:
    """``value`` if it is one of ``allowed``, else ValueError naming ``what`` and the allowed values."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(allowed)}")
    return value


class NodeMetrics:
    """The series every node has, in a registry of its own (``self.registry``)."""

    #: Series named alike on both nodes (no role in the name): the same fact about any node.
    SHARED: ClassVar[tuple[str, ...]] = ("pfec_prefill_tokens_per_second", "pfec_torch_threads")

    ROLE: ClassVar[str]  # "sender" or "receiver": names are pfec_<ROLE>_*
    PEERS: ClassVar[str]  # who the datagrams go to and come from, for the help texts
    DROP_REASONS: ClassVar[tuple[str, ...]]  # the "reason" label values (must include "other")
    UTILITY_HELP: ClassVar[str]

    def __init__(self, registry: CollectorRegistry | None = None, *, process_metrics: bool = True,
                 shared: NodeMetrics | None = None) -> None:
        # shared: the other role's metrics of the same node (pfec.node), in the same registry: the series of
        # one fact about the node (prefill speed, torch threads, the prefix cache store, serving refusals)
        # are its own, never registered twice.
        self.registry: CollectorRegistry = registry if registry is not None else CollectorRegistry()
        if shared is not None and shared.registry is not self.registry:
            raise ValueError("shared metrics live in the registry given")
        if process_metrics:
            ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, RSS, open fds
        peers = self.PEERS
        self._sent = self.counter("datagrams_sent", f"Datagrams sent to {peers}, by message type.", ["type"])
        self._bytes_sent = self.counter("bytes_sent", "UDP payload bytes sent (sealed datagrams).")
        self._received = self.counter(
            "datagrams_received", f"Datagrams received from {peers}, by message type.", ["type"]
        )
        self._bytes_received = self.counter("bytes_received", "UDP payload bytes received (before parsing).")
        self._dropped = self.counter(
            "datagrams_dropped",
            "Datagrams dropped (parse, authentication, replay, codec, session state) and failed sends, "
            "by reason.",
            ["reason"],
        )
        self._utility = self.histogram("recovered_utility", self.UTILITY_HELP, UTILITY_BUCKETS)
        self._shared = shared
        if shared is None:
            self._node_series()
        # Resolved once: .labels() costs several microseconds per call on the per-datagram path.
        self._sent_by_type = {t: self._sent.labels(t) for t in DATAGRAM_TYPES}
        self._received_by_type = {t: self._received.labels(t) for t in DATAGRAM_TYPES}
        self._dropped_by_reason = {r: self._dropped.labels(r) for r in self.DROP_REASONS}

    def _node_series(self) -> None:
        """The series of facts about the node rather than a role (one set per node)."""
        # Not role-prefixed: the same fact on both nodes (the planner's receiver speed, issue 13).
        self._prefill_speed = Gauge(
            "pfec_prefill_tokens_per_second", "This node's prefill speed for its model (tokens/s at the "
            "longest length measured at start-up with common/model/speed.py; 0: not measured, no model).",
            registry=self.registry)
        self._torch_threads = Gauge(
            "pfec_torch_threads", "Torch intra-op threads set at start-up (model.torch_threads, default the "
            "usable CPUs; 0: no model).", registry=self.registry)
        # The OpenAI face's prefix cache store (common/node/openai/http.py) and its refusals.
        self._prefix_lookups = self.counter("prefix_cache_lookups", "Prefix cache lookups of OpenAI API "
                                            "requests (and conversation handoffs), by outcome.", ["outcome"])
        self.precreate(self._prefix_lookups, ("hit", "miss"))
        self._prefix_tokens = self.counter("prefix_cache_cached_tokens", "Prompt tokens served from the "
                                           "prefix cache instead of prefilled.")
        self._prefix_evictions = self.counter("prefix_cache_evictions", "Prefix cache entries dropped for "
                                              "room, entry count or TTL (not those a longer turn replaced).")
        self._prefix_bytes = self.gauge("prefix_cache_bytes", "Bytes the prefix cache store holds.")
        self._prefix_entries = self.gauge("prefix_cache_entries", "Entries the prefix cache store holds.")
        self._serving_refused = self.counter("serving_refused", "OpenAI API requests answered 503 (the "
                                             "serving queue or the model worker was full).")
        self._prefix_seen = StoreStats()

    # ------------------------------------------------------------------ defining series

    def counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        """A counter ``pfec_<role>_<name>`` (exposed as ``..._total``) in this registry."""
        return Counter(f"pfec_{self.ROLE}_{name}", documentation, labels, registry=self.registry)

    def gauge(self, name: str, documentation: str) -> Gauge:
        return Gauge(f"pfec_{self.ROLE}_{name}", documentation, registry=self.registry)

    def histogram(self, name: str, documentation: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(f"pfec_{self.ROLE}_{name}", documentation, buckets=buckets, registry=self.registry)

    @staticmethod
    def precreate(family: Counter, label_values: Iterable[str]) -> None:
        """Create each labelled series at zero, so it is exposed before its first event."""
        for value in label_values:
            family.labels(value)

    # ------------------------------------------------------------------ datagrams

    def datagrams_sent(self, kind: str | enum.Enum, count: int, nbytes: int) -> str:
        """``count`` datagrams of ``nbytes`` in total handed to the socket; returns the type label.

        Daemons count a batch (one pacer wake-up, one loop iteration) in one call."""
        label = kind if kind in self._sent_by_type else type_label(kind)
        self._sent_by_type[label].inc(count)
        self._bytes_sent.inc(nbytes)
        return label

    def datagram_sent(self, kind: str | enum.Enum, size: int) -> None:
        self.datagrams_sent(kind, 1, size)

    def datagrams_received(self, kind: str | enum.Enum, count: int, nbytes: int) -> None:
        label = kind if kind in self._received_by_type else type_label(kind)
        self._received_by_type[label].inc(count)
        self._bytes_received.inc(nbytes)

    def datagram_received(self, kind: str | enum.Enum, size: int) -> None:
        self.datagrams_received(kind, 1, size)

    def dropped(self, reason: str, count: int = 1) -> None:
        """Count ``count`` dropped datagrams; reasons outside ``DROP_REASONS`` count as ``other``."""
        self._dropped_by_reason.get(reason, self._dropped_by_reason["other"]).inc(count)

    def drops(self, counts: Mapping[str, int]) -> None:
        """Add a drops dict (reason -> count) at once."""
        for reason, n in counts.items():
            if n:
                self.dropped(reason, n)

    def prefill_speed(self, tokens_per_second: float) -> None:
        """This node's measured prefill speed (tokens/s)."""
        if self._shared is not None:
            self._shared.prefill_speed(tokens_per_second)
            return
        self._prefill_speed.set(max(0.0, float(tokens_per_second)))

    def torch_threads(self, threads: int) -> None:
        """Torch's intra-op thread count as set at start-up (0 without a model)."""
        if self._shared is not None:
            self._shared.torch_threads(threads)
            return
        self._torch_threads.set(max(0, int(threads)))

    def prefix_cache(self, stats: StoreStats, nbytes: int, entries: int) -> None:
        """Export the store's counters (the increase since the last call) and its size."""
        if self._shared is not None:
            self._shared.prefix_cache(stats, nbytes, entries)
            return
        seen = self._prefix_seen
        for family, now, before in ((self._prefix_lookups.labels("hit"), stats.hits, seen.hits),
                                    (self._prefix_lookups.labels("miss"), stats.misses, seen.misses),
                                    (self._prefix_tokens, stats.cached_tokens, seen.cached_tokens),
                                    (self._prefix_evictions, stats.evictions, seen.evictions)):
            if now > before:
                family.inc(now - before)
        self._prefix_seen = dataclasses.replace(stats)
        self._prefix_bytes.set(nbytes)
        self._prefix_entries.set(entries)

    def serving_refused(self) -> None:
        if self._shared is not None:
            self._shared.serving_refused()
            return
        self._serving_refused.inc()

    def recovered_utility(self, utility: float) -> None:
        self._utility.observe(min(1.0, max(0.0, utility)))

    # ------------------------------------------------------------------ exposition

    def exposition(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)

    def aiohttp_handler(self) -> Callable[[web.Request], Awaitable[web.Response]]:
        """An aiohttp handler serving ``exposition()``; mount it at ``/metrics`` of any app."""

        async def handler(_request: web.Request) -> web.Response:
            return web.Response(body=self.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

        return handler

    async def serve(self, host: str, port: int) -> web.AppRunner:
        """Serve ``/metrics`` on ``host:port`` from the running loop; ``await runner.cleanup()`` to stop.

        ``runner.addresses[0][1]`` is the bound port (useful with ``port=0``).
        """
        app = web.Application()
        app.router.add_get("/metrics", self.aiohttp_handler())
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        return runner


class DropExporter:
    """Turns a session's (or endpoint's) cumulative ``drops`` dict into counter increments: each call
    adds what grew since the previous one."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self.metrics = metrics
        self._seen: dict[str, int] = {}

    def export(self, drops: Mapping[str, int]) -> None:
        if drops == self._seen:
            return
        for reason, count in drops.items():
            delta = count - self._seen.get(reason, 0)
            if delta:
                self.metrics.dropped(reason, delta)
        self._seen = dict(drops)
