"""The sender's control API: ``POST /handoffs`` -> ``{"id": ...}``; ``GET /handoffs/{id}[?wait=1]`` (the
report; waits for the end with ``wait``); ``GET /handoffs``; ``GET /healthz``; ``GET /metrics``.

``HandoffRequest`` is the request's JSON model: every field is typed and bounded, and every error names
its field (422). The server, the bearer token and the client are ``common/node/control.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pfec.common.node.config import parse_host_port
from pfec.common.node.control import json_error, read_model, wait_flag
from pfec.common.plan.deadline import DEFAULT_RHO
from pfec.common.sched.policies import SCHEMES
from pfec.sender.daemon import SenderDaemon
from pfec.sender.handoffs import HandoffSpec
from pfec.sender.kv import ContextInput


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

    def spec(self) -> HandoffSpec:
        """The daemon's view of this request (rho defaults to ``DEFAULT_RHO`` without a deadline)."""
        context, system = self.context_text()
        inputs = ContextInput(
            context=context,
            question=self.question,
            context_ids=tuple(self.context_ids) if self.context_ids else None,
            question_ids=tuple(self.question_ids) if self.question_ids else None,
            system=system,
            synthetic_tokens=self.synthetic_tokens,
        )
        rho = self.rho if self.deadline_ms is None else None
        if self.deadline_ms is None and rho is None:
            rho = DEFAULT_RHO
        return HandoffSpec(
            inputs=inputs,
            receiver=parse_host_port(self.receiver),
            deadline_ms=self.deadline_ms,
            rho=rho,
            scheme=self.scheme,
            mode=self.reconstruction,
            rate_mbps=self.rate_mbps,
            max_new_tokens=self.max_new_tokens,
            full_kv_answer=self.full_kv_answer,
            profile=self.profile,
            generate=self.generate,
            repair_budget=self.repair_budget,
        )


def sender_routes(daemon: SenderDaemon) -> list[web.RouteDef]:
    async def post_handoff(request: web.Request) -> web.Response:
        parsed = await read_model(request, HandoffRequest)
        if isinstance(parsed, web.Response):
            return parsed
        if daemon.runtime is None and parsed.synthetic_tokens is None:
            msg = "synthetic_tokens: this sender runs without a model; give synthetic_tokens"
            return json_error(422, msg, fields=[{"field": "synthetic_tokens", "message": msg}])
        handoff = daemon.submit(parsed.spec())
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
