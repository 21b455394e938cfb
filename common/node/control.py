"""Control API of both daemons: HTTP + JSON (aiohttp), on a UNIX socket (mode 0660 is the access control)
and optionally on TCP with a bearer token (constant-time compare).

Sender: ``POST /handoffs`` -> ``{"id": ...}``; ``GET /handoffs/{id}[?wait=1]`` (the report; waits for the
end with ``wait``); ``GET /handoffs``. Receiver: ``GET /sessions``, ``GET /results``. Both: ``GET /healthz``
and ``GET /metrics``. Bad requests get 422 with ``{"error": ..., "fields": [{"field", "message"}]}``:
every message names the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pfec.common.node.config import parse_host_port
from pfec.common.plan.deadline import DEFAULT_RHO
from pfec.common.sched.policies import SCHEMES

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_WAIT_S = 600.0


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class HandoffRequest(BaseModel):
    """``POST /handoffs``: the context (text, chat messages or token ids), the question and the target."""

    model_config = ConfigDict(extra="forbid")

    receiver: str = Field(description="Receiver data address HOST:PORT.")
    context: str | None = Field(default=None, description="Shared context (text).")
    messages: list[ChatMessage] | None = Field(
        default=None, description="Chat messages forming the context (system messages become the system "
        "prompt, the rest are joined in order).")
    question: str | None = Field(default=None, description="The question the receiver answers.")
    context_ids: list[int] | None = Field(default=None, description="Pre-tokenised context.")
    question_ids: list[int] | None = Field(default=None,
                                           description="Pre-tokenised question + chat template tail.")
    synthetic_tokens: int | None = Field(default=None, gt=0, le=1 << 20,
                                         description="No model: hand off random KV of this many tokens.")
    deadline_ms: float | None = Field(default=None, gt=0, le=600_000)
    rho: float | None = Field(default=None, gt=0, le=100)
    scheme: str | None = None
    reconstruction: Literal["mask", "zero"] = "mask"
    rate_mbps: float | None = Field(default=None, gt=0, le=400_000)
    max_new_tokens: int = Field(default=24, ge=1, le=512)
    full_kv_answer: bool = False
    generate: bool = True
    profile: str | None = None
    repair_budget: float | None = Field(default=None, ge=0, le=10)

    @field_validator("receiver")
    @classmethod
    def _receiver(cls, v: str) -> str:
        parse_host_port(v)
        return v.strip()

    @field_validator("scheme")
    @classmethod
    def _scheme(cls, v: str | None) -> str | None:
        if v is not None and v not in SCHEMES:
            raise ValueError(f"unknown scheme {v!r}; choose one of {', '.join(SCHEMES)}")
        return v

    @field_validator("context_ids", "question_ids")
    @classmethod
    def _ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(t < 0 for t in v)):
            raise ValueError("expected a non-empty list of non-negative token ids")
        return v

    @model_validator(mode="after")
    def _one_form(self) -> HandoffRequest:
        forms = [n for n in ("context", "messages", "context_ids", "synthetic_tokens")
                 if getattr(self, n) is not None]
        if len(forms) != 1:
            raise ValueError(f"give exactly one of context, messages, context_ids, synthetic_tokens "
                             f"(got {', '.join(forms) or 'none'})")
        if self.context_ids is not None and self.question_ids is None:
            raise ValueError("context_ids needs question_ids")
        if (self.context is not None or self.messages is not None) and not self.question:
            raise ValueError("question is required with context or messages")
        if self.deadline_ms is not None and self.rho is not None:
            raise ValueError("give deadline_ms or rho, not both")
        return self

    def context_text(self) -> tuple[str | None, str | None]:
        """(context, system) from ``context`` or ``messages``."""
        if self.messages is None:
            return self.context, None
        system = "\n".join(m.content for m in self.messages if m.role == "system") or None
        body = "\n\n".join(m.content for m in self.messages if m.role != "system")
        return body, system


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


async def read_model(request: web.Request, model: type[BaseModel]) -> BaseModel | web.Response:
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


def bearer_middleware(token: str) -> Any:
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


# --------------------------------------------------------------------------- route tables


def sender_routes(daemon: Any) -> list[web.RouteDef]:
    from pfec.sender.daemon import HandoffSpec
    from pfec.sender.kv import ContextInput

    async def post_handoff(request: web.Request) -> web.Response:
        parsed = await read_model(request, HandoffRequest)
        if isinstance(parsed, web.Response):
            return parsed
        assert isinstance(parsed, HandoffRequest)
        context, system = parsed.context_text()
        inputs = ContextInput(
            context=context,
            question=parsed.question,
            context_ids=tuple(parsed.context_ids) if parsed.context_ids else None,
            question_ids=tuple(parsed.question_ids) if parsed.question_ids else None,
            system=system,
            synthetic_tokens=parsed.synthetic_tokens,
        )
        if daemon.runtime is None and parsed.synthetic_tokens is None:
            msg = "synthetic_tokens: this sender runs without a model; give synthetic_tokens"
            return json_error(422, msg, fields=[{"field": "synthetic_tokens", "message": msg}])
        spec = HandoffSpec(
            inputs=inputs,
            receiver=parse_host_port(parsed.receiver),
            deadline_ms=parsed.deadline_ms,
            rho=parsed.rho if parsed.deadline_ms is None else None,
            scheme=parsed.scheme,
            mode=parsed.reconstruction,
            rate_mbps=parsed.rate_mbps,
            max_new_tokens=parsed.max_new_tokens,
            full_kv_answer=parsed.full_kv_answer,
            profile=parsed.profile,
            generate=parsed.generate,
            repair_budget=parsed.repair_budget,
        )
        if spec.deadline_ms is None and spec.rho is None:
            spec = HandoffSpec(**{**spec.__dict__, "rho": DEFAULT_RHO})
        handoff = daemon.submit(spec)
        return web.json_response({"id": handoff.id, "state": handoff.state}, status=202)

    async def get_handoff(request: web.Request) -> web.Response:
        handoff = daemon.handoffs.get(request.match_info["id"])
        if handoff is None:
            return json_error(404, f"no handoff with id {request.match_info['id']!r}")
        wait = wait_flag(request)
        if wait:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(handoff.done.wait(), wait)
        return web.json_response(handoff.view())

    async def list_handoffs(_request: web.Request) -> web.Response:
        return web.json_response({"handoffs": [h.view() for h in daemon.handoffs.values()]})

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response(daemon.health())

    return [
        web.post("/handoffs", post_handoff),
        web.get("/handoffs", list_handoffs),
        web.get("/handoffs/{id}", get_handoff),
        web.get("/healthz", healthz),
        web.get("/metrics", daemon.metrics.aiohttp_handler()),
    ]


def receiver_routes(daemon: Any) -> list[web.RouteDef]:
    async def sessions(_request: web.Request) -> web.Response:
        return web.json_response({"sessions": daemon.session_views()})

    async def results(_request: web.Request) -> web.Response:
        return web.json_response({"results": list(daemon.results)})

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response(daemon.health())

    return [
        web.get("/sessions", sessions),
        web.get("/results", results),
        web.get("/healthz", healthz),
        web.get("/metrics", daemon.metrics.aiohttp_handler()),
    ]


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

    def _session(self) -> Any:
        import aiohttp

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
