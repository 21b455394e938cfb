"""The control API pieces both daemons share: HTTP + JSON (aiohttp) on a UNIX socket (mode 0660 is the
access control) and optionally on TCP behind a bearer token (constant-time compare); request validation
with errors that name the field; the ``?wait=`` flag; and the client the CLI talks to a daemon with.

Each daemon's routes live with it (``sender/control.py``: ``POST /handoffs``, ``GET /handoffs[/{id}]``;
``receiver/control.py``: ``GET /sessions``, ``GET /results``; both also ``GET /healthz`` and
``GET /metrics``). Bad requests get 422 with ``{"error": ..., "fields": [{"field", "message"}]}``.
"""

from __future__ import annotations

import hmac
import json
import os
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from pydantic import BaseModel, ValidationError

MAX_WAIT_S = 600.0
M = TypeVar("M", bound=BaseModel)


def validation_error_body(exc: ValidationError) -> dict[str, Any]:
    fields = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(request)"
        msg = str(err["msg"]).removeprefix("Value error, ")
        shown = err.get("input")
        value = "" if isinstance(shown, dict) or err["type"] == "missing" else f" (got {shown!r})"
        fields.append({"field": loc, "message": f"{loc}: {msg}{value}"})
    return {"error": "; ".join(f["message"] for f in fields), "fields": fields}


def json_error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


async def read_model(request: web.Request, model: type[M]) -> M | web.Response:
    """The request body validated as ``model``, or the 400/422 response to send instead."""
    try:
        data = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return json_error(400, f"request body is not JSON: {exc}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        return web.json_response(validation_error_body(exc), status=422)


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


class ControlServer:
    """Runs one route table on a UNIX socket and/or a TCP listener (the latter behind a bearer token)."""

    def __init__(self, routes: list[web.RouteDef]) -> None:
        self.routes = routes
        self.runners: list[web.AppRunner] = []
        self.tcp_port: int | None = None

    def _app(self, token: str | None) -> web.Application:
        app = web.Application(middlewares=[bearer_middleware(token)] if token else [])
        app.add_routes(self.routes)
        return app

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
