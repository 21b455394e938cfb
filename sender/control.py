"""The sender's control API: ``POST /handoffs`` -> ``{"id": ...}``; ``GET /handoffs/{id}[?wait=1]`` (the
report; waits for the end with ``wait``); ``GET /handoffs``; ``GET /healthz`` (liveness); ``GET /readyz``
(503 while the model worker is stuck); ``GET /metrics``.

``HandoffRequest`` is the request's JSON model, validated strictly (``true`` is no integer): every field is
typed and bounded, first statically here, then by the daemon's configured limits (``limits.*``: maximum
context, maximum budget), and every error names its field (422). The receiver address is resolved once,
off the loop, and refused (422) when it is multicast, broadcast, unspecified or link-local unless
``limits.allow_destinations`` lists it. The profile is a name in the sender's profile directory, never a
path. A full model worker queue answers 503. ``conversation`` names a conversation the sender served
through its OpenAI API (``/v1/...``, ``common/node/openai/http.py``): its cache goes over as is (only what
its prefix cache store lacks is prefilled), with its cache salt, and the receiver continues it; named by
its completion id, or by its messages as chat messages or the Agents SDK's items
(``openai.responses_items``). The server, the bearer token, the body size and depth bounds and the client
are ``common/node/control.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pfec.common.node.config import SenderLimitsConfig, parse_host_port
from pfec.common.node.control import json_error, node_routes, read_model, wait_flag
from pfec.common.node.openai.jobs import ServingError
from pfec.common.node.openai.models import MAX_ID_CHARS
from pfec.common.node.openai.responses_items import Items, chat_messages
from pfec.common.node.openai.tools import ToolsMixin
from pfec.common.node.udp import Destination, DestinationRefused
from pfec.common.node.worker import WorkerBusy
from pfec.common.plan.deadline import DEFAULT_RHO, MAX_REPAIR_FRACTION
from pfec.common.plan.handoff import MAX_NEW_TOKENS, MAX_QUESTION_TOKENS, MAX_TOKEN_ID
from pfec.common.plan.pieces import HeldBlocks
from pfec.common.plan.prefix_store import MAX_SALT_CHARS
from pfec.common.plan.utility import ProfileError, check_profile_name
from pfec.common.sched.policies import SCHEMES
from pfec.sender.daemon import SenderDaemon
from pfec.sender.fanout import MAX_FANOUT, check_receivers
from pfec.sender.handoffs import HandoffSpec
from pfec.sender.kv import ContextInput, Prefilled

MAX_TEXT_CHARS = 1 << 22  # a context's characters (the body size bounds it first)
MAX_MESSAGES = 1024
MAX_IDS = 1 << 20  # static cap; limits.max_context_tokens is the configured one


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=MAX_TEXT_CHARS)


class ConversationRef(ToolsMixin):
    """A conversation this sender served through its OpenAI API: the completion id it returned (the Agents
    SDK keeps it as an item's ``provider_data.response_id``; a ``resp_`` id of ``/v1/responses``), or its
    messages (the assistant's replies included, chat messages or Responses items: ``openai.responses_items``)
    with the cache salt they were served under, and the tools (and ``tool_choice``) they were served with."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS, pattern=r"^[A-Za-z0-9_.:-]+$",
                           description="The id a /v1/chat/completions response returned (chatcmpl-...).")
    messages: Items | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_SALT_CHARS)

    @model_validator(mode="after")
    def _one(self) -> ConversationRef:
        if (self.id is None) == (self.messages is None):
            raise ValueError("give exactly one of id and messages")
        if self.id is not None and (self.tools is not None or self.tool_choice is not None):
            raise ValueError("a conversation named by id keeps the tools it was served with: give tools "
                             "and tool_choice only with messages")
        return self

    def rendered(self) -> list[dict[str, Any]]:
        """The messages as the chat endpoint kept them (``responses_items.chat_messages``)."""
        assert self.messages is not None
        return chat_messages(self.messages)


class HandoffRequest(BaseModel):
    """``POST /handoffs``: the context (text, chat messages or token ids), the question and the target."""

    model_config = ConfigDict(extra="forbid", strict=True)

    receiver: str | None = Field(default=None, max_length=300, description="Receiver data address HOST:PORT.")
    receivers: list[str] | None = Field(
        default=None, min_length=1, max_length=MAX_FANOUT,
        description="Fan-out: 1 to 8 receiver data addresses HOST:PORT, distinct, sent one preparation "
        "(instead of receiver).")
    fanout: Literal["unicast", "multicast"] = Field(
        default="unicast", description="How a fan-out is carried: unicast (a session per receiver sharing "
        "the preparation, the symbols and the uplink's pacing) or multicast (one stream sealed once, to "
        "the group destination).")
    group: str | None = Field(
        default=None, max_length=64, description="Multicast fan-out: the group destination IP:PORT, one of "
        "the sender's [udp] multicast_group (default: the first).")
    context: str | None = Field(default=None, max_length=MAX_TEXT_CHARS, description="Shared context (text).")
    messages: list[ChatMessage] | None = Field(
        default=None, max_length=MAX_MESSAGES,
        description="Chat messages forming the context (system messages become the system prompt, the rest "
        "are joined in order).")
    question: str | None = Field(default=None, max_length=MAX_TEXT_CHARS,
                                 description="The question the receiver answers.")
    context_ids: list[int] | None = Field(default=None, max_length=MAX_IDS,
                                          description="Pre-tokenised context.")
    question_ids: list[int] | None = Field(default=None, max_length=MAX_QUESTION_TOKENS,
                                           description="Pre-tokenised question + chat template tail.")
    conversation: ConversationRef | None = Field(
        default=None, description="Hand over a conversation's cache (no question): the receiver keeps it "
        "under the conversation's cache salt for the requests that continue it.")
    cache_salt: str | None = Field(
        default=None, min_length=1, max_length=MAX_SALT_CHARS,
        description="The cache salt the receiver keeps the context's cache under for later requests (as "
        "vLLM's; none: the shared namespace). A conversation's goes in conversation.cache_salt.")
    synthetic_tokens: int | None = Field(default=None, gt=0, le=MAX_IDS,
                                         description="No model: hand off random KV of this many tokens "
                                         "(at most limits.max_context_tokens).")
    deadline_ms: float | None = Field(default=None, gt=0, le=3_600_000,
                                      description="Deadline, ms (at most limits.max_budget_ms).")
    rho: float | None = Field(default=None, gt=0, le=100)
    scheme: str | None = Field(default=None, max_length=64)
    reconstruction: Literal["mask", "zero"] = "mask"
    rate_mbps: float | None = Field(default=None, ge=0.01, le=400_000)
    max_new_tokens: int = Field(default=24, ge=1, le=MAX_NEW_TOKENS)
    full_kv_answer: bool = False
    generate: bool = True
    profile: str | None = Field(default=None, max_length=300,
                                description="Profile NAME in the sender's profile directory (never a path).")
    repair_budget: Annotated[float, Field(ge=0, le=MAX_REPAIR_FRACTION)] | Literal["deadline"] | None = Field(
        default=None, description='A cap as a fraction of the source symbols, or "deadline" (repair until '
        "done); null: the daemon's fec.repair_budget.")
    precision: Literal["auto", "native", "int8", "int8-int4", "int4", "int2"] = Field(
        default="auto", description="KV precision: auto (the break-even planner's mix; native for "
        "synthetic KV) or a mix.")
    handoff_mode: Literal["auto", "handoff", "split", "local"] = Field(
        default="auto", description="auto (the break-even planner's choice; handoff for synthetic KV), "
        "handoff (the whole cache streams), split (the receiver prefills the front while the back "
        "streams) or local (the receiver prefills everything, no KV sent).")

    @field_validator("receiver")
    @classmethod
    def _receiver(cls, v: str | None) -> str | None:
        if v is None:
            return None
        parse_host_port(v)
        return v.strip()

    @field_validator("receivers")
    @classmethod
    def _receivers(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else check_receivers(v)

    @field_validator("profile")
    @classmethod
    def _profile(cls, v: str | None) -> str | None:
        return None if v is None else check_profile_name(v, "profile")

    @field_validator("scheme")
    @classmethod
    def _scheme(cls, v: str | None) -> str | None:
        if v is not None and v not in SCHEMES:
            raise ValueError(f"unknown scheme {v!r}; choose one of {', '.join(SCHEMES)}")
        return v

    @field_validator("context_ids", "question_ids")
    @classmethod
    def _ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(not 0 <= t <= MAX_TOKEN_ID for t in v)):
            raise ValueError(f"expected a non-empty list of token ids in 0..{MAX_TOKEN_ID}")
        return v

    @model_validator(mode="after")
    def _one_form(self) -> HandoffRequest:
        forms = [n for n in ("context", "messages", "context_ids", "synthetic_tokens", "conversation")
                 if getattr(self, n) is not None]
        if len(forms) != 1:
            raise ValueError(f"give exactly one of context, messages, context_ids, synthetic_tokens, "
                             f"conversation (got {', '.join(forms) or 'none'})")
        if self.conversation is not None and (self.question is not None or self.question_ids is not None
                                              or self.full_kv_answer):
            raise ValueError("a conversation handoff asks no question (no question, question_ids or "
                             "full_kv_answer): the receiver continues the conversation through its API")
        keeps_no_context = self.conversation is not None or self.synthetic_tokens is not None
        if self.cache_salt is not None and keeps_no_context:
            raise ValueError("cache_salt is a question/answer context's (a conversation's goes in "
                             "conversation.cache_salt; synthetic KV is kept by no one)")
        if self.context_ids is not None and self.question_ids is None:
            raise ValueError("context_ids needs question_ids")
        if (self.context is not None or self.messages is not None) and not self.question:
            raise ValueError("question is required with context or messages")
        if self.deadline_ms is not None and self.rho is not None:
            raise ValueError("give deadline_ms or rho, not both")
        if (self.receiver is None) == (self.receivers is None):
            raise ValueError("give exactly one of receiver and receivers")
        if self.group is not None and (self.receivers is None or self.fanout != "multicast"):
            raise ValueError("group names a multicast fan-out's destination: give receivers and "
                             "fanout: multicast with it")
        return self

    def limit_errors(self, limits: SenderLimitsConfig) -> list[dict[str, str]]:
        """The configured bounds this request breaks, as 422 ``fields`` entries (empty: within them)."""
        errors = []
        tokens = self.synthetic_tokens if self.synthetic_tokens is not None else (
            len(self.context_ids) if self.context_ids is not None else None)
        field = "synthetic_tokens" if self.synthetic_tokens is not None else "context_ids"
        if tokens is not None and tokens > limits.max_context_tokens:
            errors.append((field, f"{tokens} tokens, above this sender's limits.max_context_tokens "
                                  f"({limits.max_context_tokens})"))
        if self.deadline_ms is not None and self.deadline_ms > limits.max_budget_ms:
            errors.append(("deadline_ms", f"{self.deadline_ms:g} ms, above this sender's "
                                          "limits.max_budget_ms "
                                          f"({limits.max_budget_ms:g})"))
        return [{"field": f, "message": f"{f}: {m}"} for f, m in errors]

    def context_text(self) -> tuple[str | None, str | None]:
        """(context, system) from ``context`` or ``messages``."""
        if self.messages is None:
            return self.context, None
        system = "\n".join(m.content for m in self.messages if m.role == "system") or None
        body = "\n\n".join(m.content for m in self.messages if m.role != "system")
        return body, system

    def spec(self, destination: Destination | None = None, prefilled: Prefilled | None = None) -> HandoffSpec:
        """The daemon's view of this request (rho defaults to ``DEFAULT_RHO`` without a deadline)."""
        context, system = self.context_text()
        inputs = ContextInput(
            prefilled=prefilled,
            context=context,
            question=self.question,
            context_ids=tuple(self.context_ids) if self.context_ids else None,
            question_ids=tuple(self.question_ids) if self.question_ids else None,
            system=system,
            synthetic_tokens=self.synthetic_tokens,
            cache_salt=self.cache_salt or "",
        )
        rho = self.rho if self.deadline_ms is None else None
        if self.deadline_ms is None and rho is None:
            rho = DEFAULT_RHO
        return HandoffSpec(
            inputs=inputs,
            receiver=parse_host_port(self.receivers[0] if self.receivers else self.receiver or ""),
            receivers=() if self.receivers is None else tuple(parse_host_port(r) for r in self.receivers),
            fanout=self.fanout,
            group=self.group,
            deadline_ms=self.deadline_ms,
            rho=rho,
            scheme=self.scheme,
            mode=self.reconstruction,
            rate_mbps=self.rate_mbps,
            max_new_tokens=self.max_new_tokens,
            full_kv_answer=self.full_kv_answer,
            profile=self.profile,
            generate=self.generate and self.conversation is None,
            repair_budget=self.repair_budget,
            destination=destination,
            precision=self.precision,
            handoff_mode=self.handoff_mode,
        )


def _id_hint(conversation_id: str) -> str:
    """What an id the node never returns is, for the 404 (an Agents SDK item's own id, a Responses id)."""
    if conversation_id == "__fake_id__":
        return ("; that is the Agents SDK's placeholder item id: send the item's provider_data.response_id "
                "(the chatcmpl-... id this node returned)")
    if conversation_id.startswith("resp_"):
        return "; a Responses API id this node did not serve, or no longer keeps"
    return ""


def _field_error(status: int, field: str, message: str) -> web.Response:
    text = message if message.startswith(f"{field}:") else f"{field}: {message}"
    return json_error(status, text, fields=[{"field": field, "message": text}])


async def _conversation(daemon: SenderDaemon, ref: ConversationRef) -> Prefilled | web.Response:
    """The named conversation's cache, made whole in the model worker (only what the store lacks is
    prefilled: the end of the last turn), or the 404/422/503 to answer instead."""
    face = daemon.face
    if face is None:
        return _field_error(422, "conversation", "this sender runs without a model")
    salt = ref.cache_salt or ""
    if ref.id is not None:
        known = face.conversation(ref.id)
        if known is None:
            return _field_error(404, "conversation.id", f"no conversation {ref.id!r} on this sender"
                                f"{_id_hint(ref.id)}")
        if ref.cache_salt is not None and ref.cache_salt != known.salt:
            return _field_error(422, "conversation.cache_salt", "the conversation was served under another "
                                "cache salt")
        salt, messages, tools = known.salt, [dict(m) for m in known.messages], known.tools
    else:
        assert ref.messages is not None
        offered = ref.offered()
        messages, tools = ref.rendered(), None if offered is None else tuple(offered)
    try:
        ids, kv, cached, origin = await daemon.worker.submit(face.conversation_cache, salt, messages, tools)
    except ServingError as exc:
        field = "conversation.cache_salt" if exc.param == "cache_salt" else "conversation"
        return _field_error(exc.status, field, str(exc))
    except WorkerBusy as exc:
        return json_error(503, str(exc))
    except ValueError as exc:  # longer than the model's context
        return _field_error(422, "conversation", str(exc))
    finally:
        face.export_metrics()
    held = origin.get("held")  # received before (a chain): what this node holds of it goes on as held
    if not isinstance(held, HeldBlocks):
        held = None
    elif cached < held.n_tokens:  # the conversation left the received context there: the rest is recomputed
        held = held.truncated(cached)
    return Prefilled(salt, tuple(ids), kv, cached, held)


def sender_routes(daemon: SenderDaemon) -> list[web.RouteDef]:
    limits = daemon.limits

    async def post_handoff(request: web.Request) -> web.Response:
        parsed = await read_model(request, HandoffRequest, max_depth=limits.max_json_depth)
        if isinstance(parsed, web.Response):
            return parsed
        errors = parsed.limit_errors(limits)
        if errors:
            return json_error(422, "; ".join(e["message"] for e in errors), fields=errors)
        if daemon.runtime is None and parsed.synthetic_tokens is None:
            return _field_error(422, "synthetic_tokens",
                                "this sender runs without a model; give synthetic_tokens")
        if parsed.profile is not None:
            try:
                await daemon.profiles.resolve(parsed.profile, daemon.identity.geometry.n_layers)
            except ProfileError as exc:
                return _field_error(422, "profile", str(exc))
        if parsed.receivers is not None:
            if parsed.fanout == "multicast":
                try:  # the request's group (one configured), or the first configured
                    group = daemon.multicast_group(parsed.group)
                except ValueError as exc:
                    return _field_error(422, "group" if parsed.group is not None else "fanout", str(exc))
                parsed.group = group
            for i, receiver in enumerate(parsed.receivers):
                try:
                    await daemon.destination(replace(parsed.spec(), receiver=parse_host_port(receiver)))
                except DestinationRefused as exc:
                    return _field_error(422, f"receivers.{i}", str(exc))
        try:
            destination = await daemon.destination(parsed.spec())
        except DestinationRefused as exc:
            return _field_error(422, "receiver" if parsed.receivers is None else "receivers.0", str(exc))
        prefilled = None
        if parsed.conversation is not None:
            found = await _conversation(daemon, parsed.conversation)
            if isinstance(found, web.Response):
                return found
            prefilled = found
        try:
            handoff = daemon.submit(parsed.spec(destination, prefilled))
        except WorkerBusy as exc:
            return json_error(503, str(exc))
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

    async def list_paths(_request: web.Request) -> web.Response:
        return web.json_response({"rate_control": daemon.rate_control, "paths": daemon.paths_view()})

    return [
        web.post("/handoffs", post_handoff),
        web.get("/handoffs", list_handoffs),
        web.get("/handoffs/{id}", get_handoff),
        web.get("/paths", list_paths),
        *node_routes(daemon),
        *(daemon.face.routes() if daemon.face is not None else []),
    ]
