"""The Prometheus exposition and ``/metrics`` endpoint both daemons' metrics classes share."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

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
