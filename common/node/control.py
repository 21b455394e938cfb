"""The control API pieces both daemons share: HTTP + JSON (aiohttp) on a UNIX socket (mode 0660 is the
access control) and optionally on TCP behind a bearer token (constant-time compare); request validation
with errors that name the field; the ``?wait=`` flag; and the client the CLI talks to a daemon with.

Each daemon's routes live with it (``sender/control.py``: ``POST /handoffs``, ``GET /handoffs[/{id}]``;
``receiver/control.py``: ``GET /sessions``, ``GET /results``; both also ``GET /healthz`` and
``GET /metrics``, ``GET /readyz``). Bad requests get 422 with ``{"error": ..., "fields": [{"field",
"message"}]}``, each field named as the client wrote it; a body that is not JSON, or nests deeper than
the configured depth, gets 400; one larger than the configured size 413; every error, including aiohttp's
own (404, 405), is a JSON ``{"error": ...}``.

Request bodies are validated strictly (pydantic strict mode on the raw JSON): ``true`` is not an integer and
``1.5`` is not one either; the depth is checked by a scan before anything is parsed.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from pydantic import BaseModel, ValidationError

from pfec.common.node.metrics import NodeMetrics
from pfec.common.node.openai.models import client_path, shallow_error
from pfec.common.plan.handoff import json_depth

MAX_WAIT_S = 600.0
MAX_BODY_BYTES = 1 << 20
MAX_JSON_DEPTH = 32
MAX_BODY_KEY = web.AppKey("max_body", int)
log = logging.getLogger("pfec.control")
M = TypeVar("M", bound=BaseModel)


def _shown(value: Any) -> str:
    """A client's value for an error message: scalars as given (bounded), containers by type only."""
    if isinstance(value, dict | list | tuple):
        return f" (got a {type(value).__name__})"
    text = repr(value)
    return f" (got {text[:80]}{'...' if len(text) > 80 else ''})"


def validation_error_body(exc: ValidationError, raw: bytes = b"null", max_errors: int = 10) -> dict[str, Any]:
    """The 422 body: each bad field by the path the client wrote (``conversation.messages.3.type``, not
    pydantic's union tags: ``openai.models.client_path``), each (path, reason) once, a union member's plain
    type mismatch left out where another member went deeper."""
    errors = exc.errors()
    try:
        body = json.loads(raw)  # pydantic parsed it; its size and depth were checked before
    except ValueError:
        body = None
    paths = [client_path(tuple(e["loc"]), body) for e in errors]
    fields: list[dict[str, str]] = []
    for err, path in zip(errors, paths, strict=True):
        if shallow_error(err["type"], path, paths):
            continue
        loc = path or "(request)"
        msg = str(err["msg"]).removeprefix("Value error, ")
        value = "" if err["type"] == "missing" or "input" not in err else _shown(err["input"])
        entry = {"field": loc, "message": f"{loc}: {msg}{value}"}
        if entry not in fields:
            fields.append(entry)
        if len(fields) == max_errors:
            break
    return {"error": "; ".join(f["message"] for f in fields), "fields": fields}


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (404, 405, 413...) as JSON ``{"error": ...}`` like ours; a handler's bug is a
    JSON 500 that names no internals."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.content_type == "application/json" or exc.status < 400:
            raise
        return json_error(exc.status, exc.reason)
    except Exception:
        log.exception("control API: %s %s failed", request.method, request.path)
        return json_error(500, "internal error (see the daemon's log)")


def json_error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


async def read_model(request: web.Request, model: type[M], *,
                     max_depth: int = MAX_JSON_DEPTH) -> M | web.Response:
    """The request body validated strictly as ``model``, or the 400/413/422 response to send instead.

    The body size is bounded by the app's ``client_max_size`` (``ControlServer(max_body=...)``)."""
    limit = request.config_dict.get(MAX_BODY_KEY, MAX_BODY_BYTES)
    if request.content_length is not None and request.content_length > limit:
        return json_error(413, f"request body of {request.content_length} bytes is above the {limit}-byte "
                               "limit")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return json_error(413, f"request body is above the {limit}-byte limit")
    depth = json_depth(raw)
    if depth > max_depth:
        return json_error(400, f"request body nests JSON {depth} levels deep, above the limit of {max_depth}")
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        if any(err["type"] == "json_invalid" for err in exc.errors()):
            return json_error(400, "request body is not JSON (send one JSON object, UTF-8)")
        return web.json_response(validation_error_body(exc, raw), status=422)


def wait_flag(request: web.Request) -> float | None:
    """``?wait=1`` (up to MAX_WAIT_S) or ``?wait=SECONDS``; None without it."""
    raw = request.query.get("wait")
    if raw is None or raw in ("0", "false", ""):
        return None
    if raw in ("1", "true"):
        return MAX_WAIT_S
    try:
        return min(MAX_WAIT_S, max(0.0, float(raw)))
    except ValueError:
        raise web.HTTPUnprocessableEntity(
            text=json.dumps({"error": f"wait: bad value {raw!r}, expected 1 or seconds"}),
            content_type="application/json",
        ) from None


def bearer_middleware(token: str) -> Middleware:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        got = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(got, expected):
            return json_error(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
        return await handler(request)

    return check


class NodeStatus(Protocol):
    """What the routes both daemons share read from a daemon."""

    @property
    def metrics(self) -> NodeMetrics: ...

    def health(self) -> dict[str, Any]: ...

    def readiness(self) -> tuple[bool, dict[str, Any]]: ...


def node_routes(node: NodeStatus) -> list[web.RouteDef]:
    """/healthz (liveness), /readyz (503 while the model worker is stuck) and /metrics, as both daemons
    serve them."""

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response(node.health())

    async def readyz(_request: web.Request) -> web.Response:
        ready, body = node.readiness()
        return web.json_response(body, status=200 if ready else 503)

    return [
        web.get("/healthz", healthz),
        web.get("/readyz", readyz),
        web.get("/metrics", node.metrics.aiohttp_handler()),
    ]


def control_app(routes: list[web.RouteDef], token: str | None = None,
                max_body: int = MAX_BODY_BYTES) -> web.Application:
    """One control API app: ``routes`` behind the JSON error middleware (and the bearer token, if any),
    request bodies bounded to ``max_body`` bytes."""
    middlewares = [json_errors, *([bearer_middleware(token)] if token else [])]
    app = web.Application(middlewares=middlewares, client_max_size=max_body)
    app[MAX_BODY_KEY] = max_body
    app.add_routes(routes)
    return app


class ControlServer:
    """Runs one route table on a UNIX socket and/or a TCP listener (the latter behind a bearer token)."""

    def __init__(self, routes: list[web.RouteDef], max_body: int = MAX_BODY_BYTES) -> None:
        self.routes = routes
        self.max_body = max_body
        self.runners: list[web.AppRunner] = []
        self.tcp_port: int | None = None

    def _app(self, token: str | None) -> web.Application:
        return control_app(self.routes, token, self.max_body)

    async def start(self, socket_path: Path | None, tcp: tuple[str, int] | None = None,
                    token: str | None = None) -> None:
        if socket_path is not None:
            socket_path.parent.mkdir(parents=True, exist_ok=True)
            if socket_path.is_socket():
                socket_path.unlink()
            runner = web.AppRunner(self._app(None), access_log=None)
            await runner.setup()
            await web.UnixSite(runner, str(socket_path)).start()
            os.chmod(socket_path, 0o660)
            self.runners.append(runner)
        if tcp is not None:
            if not token:
                raise ValueError("control.tcp needs a bearer token (control.token_file)")
            runner = web.AppRunner(self._app(token), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, tcp[0], tcp[1])
            await site.start()
            self.tcp_port = int(runner.addresses[-1][1])
            self.runners.append(runner)

    async def close(self) -> None:
        for runner in self.runners:
            await runner.cleanup()
        self.runners = []


# --------------------------------------------------------------------------- client


class ControlClient:
    """Talks to a daemon's control API over its UNIX socket or ``http://host:port`` with a token."""

    def __init__(self, socket_path: Path | None = None, url: str | None = None, token: str | None = None,
                 timeout_s: float = MAX_WAIT_S + 30) -> None:
        if (socket_path is None) == (url is None):
            raise ValueError("give exactly one of socket_path and url")
        self.socket_path = socket_path
        self.base = url.rstrip("/") if url else "http://pfec"
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s = timeout_s

    def _session(self) -> aiohttp.ClientSession:
        connector = aiohttp.UnixConnector(path=str(self.socket_path)) if self.socket_path else None
        return aiohttp.ClientSession(connector=connector, headers=self.headers,
                                     timeout=aiohttp.ClientTimeout(total=self.timeout_s))

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with self._session() as session, session.request(method, self.base + path, json=body) as resp:
            try:
                data = await resp.json(content_type=None)
            except json.JSONDecodeError:
                data = {"error": await resp.text()}
            return resp.status, data
