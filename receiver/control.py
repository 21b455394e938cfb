"""The receiver's control API: ``GET /sessions`` (every live session, pending handshakes included),
``GET /results`` (the last results), ``GET /healthz`` (liveness), ``GET /readyz`` (503 while the model
worker is stuck) and ``GET /metrics``. The server, the bearer token and the client are
``common/node/control.py``."""

from __future__ import annotations

from aiohttp import web

from pfec.common.node.control import node_routes
from pfec.receiver.daemon import ReceiverDaemon


def receiver_routes(daemon: ReceiverDaemon) -> list[web.RouteDef]:
    async def sessions(_request: web.Request) -> web.Response:
        return web.json_response({"sessions": daemon.session_views()})

    async def results(_request: web.Request) -> web.Response:
        return web.json_response({"results": list(daemon.results)})

    return [
        web.get("/sessions", sessions),
        web.get("/results", results),
        *node_routes(daemon),
    ]
