"""The receiver's control API: ``GET /sessions`` (every live session, pending handshakes included),
``GET /results`` (the last results), ``GET /healthz`` (liveness), ``GET /readyz`` (503 while the model
worker is stuck) and ``GET /metrics``; with a model, the OpenAI-compatible ``/v1/...`` routes
(``common/node/openai/http.py``), where a handed-off conversation continues. The server, the bearer
token and the client are ``common/node/control.py``."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from pfec.common.node.control import node_routes
from pfec.common.node.udp import PeerAddress
from pfec.receiver.daemon import ReceiverDaemon, clock


def _shown(peer: PeerAddress | None) -> str | None:
    return f"{peer[0]}:{peer[1]}" if peer else None


def session_views(daemon: ReceiverDaemon) -> list[dict[str, Any]]:
    """Every live session: the endpoint's (whether or not its OFFER completed) and its pending
    handshakes (authentic OFFERs not yet established)."""
    now = clock()
    handoffs = daemon.handoffs
    out = []
    for sid, session in daemon.endpoint.sessions.items():
        info = handoffs.sessions.get(sid)
        out.append(
            {
                "session_id": f"{sid:016x}",
                "state": info.state if info is not None else "offer_incomplete",
                "peer": _shown(info.peer if info is not None else handoffs.peers.get(sid)),
                "deadline_in_ms": round((session.deadline - now) * 1000, 3),
                "decoded_symbols": session.decoder.decoded_count,
                "n_source": session.offer.n_source,
                "profile": info.app.profile if info is not None and info.app is not None else None,
            }
        )
    for hs in daemon.endpoint.pending_handshakes():
        out.append({"session_id": f"{hs.session_id:016x}", "state": "handshake",
                    "peer": _shown(handoffs.peers.get(hs.session_id)),
                    "expires_in_ms": round((hs.expires_at - now) * 1000, 3), "deadline_in_ms": None,
                    "decoded_symbols": None, "n_source": hs.n_source, "profile": None,
                    "offer_parts": f"{hs.parts_received}/{hs.part_count}"})
    return out


def receiver_routes(daemon: ReceiverDaemon) -> list[web.RouteDef]:
    async def sessions(_request: web.Request) -> web.Response:
        return web.json_response({"sessions": session_views(daemon)})

    async def results(_request: web.Request) -> web.Response:
        return web.json_response({"results": list(daemon.results)})

    return [
        web.get("/sessions", sessions),
        web.get("/results", results),
        *node_routes(daemon),
        *(daemon.face.routes() if daemon.face is not None else []),
    ]
