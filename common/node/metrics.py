"""What both daemons' metrics classes share: the Prometheus exposition and ``/metrics`` endpoint, and the
datagram counters by wire type."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

DATAGRAM_TYPES: Final = ("source", "repair", "ack", "offer", "accept", "refuse", "result", "close")


def type_label(kind: str | enum.Enum) -> str:
    """``MsgType.SOURCE`` or ``"source"`` -> ``"source"``; ValueError for anything else."""
    name = kind.name.lower() if isinstance(kind, enum.Enum) else str(kind).lower()
    if name not in DATAGRAM_TYPES:
        raise ValueError(f"unknown datagram type {kind!r}; expected one of {', '.join(DATAGRAM_TYPES)}")
    return name


if TYPE_CHECKING:
    from aiohttp import web


class MetricsEndpoint:
    """Mixin: serve ``self.registry`` in the Prometheus text format."""

    registry: CollectorRegistry

    def exposition(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)

    def aiohttp_handler(self) -> Callable[[web.Request], Awaitable[web.Response]]:
        """An aiohttp handler serving ``exposition()``; mount it at ``/metrics`` of any app."""
        from aiohttp import web

        async def handler(_request: web.Request) -> web.Response:
            return web.Response(body=self.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

        return handler

    async def serve(self, host: str, port: int) -> web.AppRunner:
        """Serve ``/metrics`` on ``host:port`` from the running loop; ``await runner.cleanup()`` to stop.

        ``runner.addresses[0][1]`` is the bound port (useful with ``port=0``).
        """
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/metrics", self.aiohttp_handler())
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        return runner


class DatagramCounters:
    """Mixin: datagrams and bytes sent / received, by wire type. The class resolves the labelled children
    once (``_sent_by_type``, ``_received_by_type``: ``.labels()`` costs microseconds) and owns the byte
    counters; daemons count a batch (one pacer wake-up, one loop iteration) in one call."""

    _sent_by_type: dict[str, Any]
    _received_by_type: dict[str, Any]
    _bytes_sent: Any
    _bytes_received: Any

    def datagrams_sent(self, kind: str | enum.Enum, count: int, nbytes: int) -> str:
        """``count`` datagrams of ``nbytes`` in total handed to the socket; returns the type label."""
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
