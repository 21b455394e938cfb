"""The OpenAI-compatible face of a node: ``POST /v1/chat/completions`` (server-sent events with
``stream``), ``POST /v1/completions`` and ``GET /v1/models``, mounted on the daemon's control API
listeners (the UNIX socket; TCP behind the bearer token), so agent frameworks reach the node's model
through the API they already speak.

Every prompt is looked up in the node's ``PrefixStore`` (its salt only) and only the tokens no stored
cache holds are prefilled: ``usage.prompt_tokens_details.cached_tokens`` says how many were served from
it, and the extension field ``pfec`` where they came from (a handoff: its session id, recovered utility and
precision; an earlier turn: the completion id). Each completion's cache (prompt + the tokens fed) is stored
for the next turn; the receiver stores each rebuilt handoff cache the same way (``keep``).

Generation runs in the daemon's bounded model worker, one request at a time; at most
``limits.serving_queue`` requests wait or run, beyond that a 503 with ``Retry-After``. The store and the
conversations are touched only in that worker thread (``PrefixStore``'s one owner). Errors are OpenAI's
error body: 400 naming the parameter, 404 for an unknown model, 413 for a body over the limit. A
response names the accepted fields its request sent that changed nothing in ``X-PFEC-Ignored-Fields``.

Tools (``openai.tools``): rendered by the chat template or the Hermes fallback, the reply parsed by the
parser ``limits.tool_call_parser`` names into ``tool_calls`` (streamed as OpenAI's deltas).

``POST /v1/responses`` (``openai.responses``) translates into a chat request and generates through
``submit`` too; the job's hop to the worker and the errors are ``openai.jobs``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from pfec.common.node.config_models import CommonLimits
from pfec.common.node.control import MAX_JSON_DEPTH
from pfec.common.node.metrics import NodeMetrics
from pfec.common.node.openai import structured
from pfec.common.node.openai import tools as openai_tools
from pfec.common.node.openai.jobs import IGNORED_HEADER as IGNORED_HEADER  # where tests look for it
from pfec.common.node.openai.jobs import (
    Job,
    Served,
    ServingError,
    consume,
    error_response,
    ignored_header,
    read_body,
)
from pfec.common.node.openai.models import ChatCompletionRequest, CompletionRequest, openai_error, usage
from pfec.common.node.openai.responses import ResponsesAPI
from pfec.common.node.worker import ModelWorker, WorkerBusy
from pfec.common.plan.prefix_store import PrefixStore

if TYPE_CHECKING:
    from pfec.common.model.kvcache import PartialKV
    from pfec.common.model.llm import ModelRuntime

log = logging.getLogger("pfec.openai")
CONVERSATIONS_KEPT = 1024
DEFAULT_ALIAS = "default"  # a client may name the node's model this way too


@dataclass(frozen=True)
class Conversation:
    """A completion the node served, as the next turn (or a handoff naming it) sees it."""

    id: str
    salt: str
    messages: tuple[Mapping[str, Any], ...]  # the request's messages and the assistant's reply
    tools: tuple[Mapping[str, Any], ...] | None = None  # the tools offered (they open the prompt)


class OpenAIFace:
    """One node's OpenAI-compatible API over its model, model worker and prefix store."""

    def __init__(self, runtime: ModelRuntime, worker: ModelWorker, metrics: NodeMetrics,
                 limits: CommonLimits, clock: Callable[[], float] = time.monotonic,
                 max_json_depth: int = MAX_JSON_DEPTH) -> None:
        self.runtime = runtime
        self.worker = worker
        self.metrics = metrics
        self.limits = limits
        self.clock = clock
        self.max_json_depth = max_json_depth
        self.model_id = runtime.model_id
        self.store: PrefixStore[PartialKV] = PrefixStore(
            limits.prefix_cache_bytes, limits.prefix_cache_entries, limits.prefix_cache_ttl_s)
        self.conversations: OrderedDict[str, Conversation] = OrderedDict()
        self.in_flight = 0
        self._ids = itertools.count(1)
        self._recent_s = 1.0  # a request's recent duration, for Retry-After
        self.created = int(time.time())
        self.responses = ResponsesAPI(self)  # POST /v1/responses, over the same generation

    # ------------------------------------------------------------------ worker thread: the store
    def keep(self, salt: str, ids: Sequence[int], kv: PartialKV, info: Mapping[str, Any]) -> bool:
        """Store a cache over ``ids`` (a rebuilt handoff, a completion's leftover). Worker thread."""
        from pfec.common.model.serving import kv_nbytes  # deferred: torch

        return self.store.put(salt, list(ids), kv, kv_nbytes(kv), self.clock(), info)

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                 add_generation_prompt: bool = True) -> list[int]:
        """Worker thread: the messages and tools through the model's chat template, or its Hermes fallback
        when the template ignores tools (``tools.template_messages``)."""
        from pfec.common.model import serving  # deferred: torch

        shaped, offered = openai_tools.template_messages(messages, tools, serving.takes_tools(self.runtime))
        return serving.chat_ids(self.runtime, shaped, add_generation_prompt, offered)

    def conversation_cache(self, salt: str, messages: Sequence[Mapping[str, Any]],
                           tools: Sequence[Mapping[str, Any]] | None = None,
                           ) -> tuple[list[int], PartialKV, int, dict[str, Any]]:
        """A conversation's cache made whole for a handoff: (its token ids as the next turn renders them,
        the cache over them, how many were already cached, where those came from). ServingError when no
        cache of its salt starts it (nothing to hand over without prefilling it all again). Worker
        thread; the whole cache is stored back (the next lookup finds it)."""
        from pfec.common.model import serving  # deferred: torch

        ids = self.chat_ids(messages, tools, add_generation_prompt=False)
        match = self.store.lookup(salt, ids, self.clock())
        if match is None:
            raise ServingError("cache_salt" if salt else "conversation",
                               f"no cached prefix of this conversation under cache salt {salt!r}: serve it "
                               "through /v1/chat/completions on this node first", 404)
        kv = serving.extend(self.runtime, ids, match.entry.value, match.tokens)
        self.keep(salt, ids, kv, match.entry.info)
        return ids, kv, match.tokens, dict(match.entry.info)

    def settle(self, salt: str, messages: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None = None) -> int:
        """Worker thread, after a chat completion: extend its stored cache to the conversation as the next
        turn renders it (the reply's last token, never fed, and the template's end-of-turn marker: a few
        tokens), so the next turn prefills only its own. Returns the tokens prefilled (0: nothing to do, or
        nothing of it stored any more)."""
        from pfec.common.model import serving  # deferred: torch

        ids = self.chat_ids(messages, tools, add_generation_prompt=False)
        match = self.store.lookup(salt, ids, self.clock(), count=False)
        if match is None or match.tokens >= len(ids) or len(ids) > self.runtime.max_context:
            return 0
        kv = serving.extend(self.runtime, ids, match.entry.value, match.tokens)
        self.keep(salt, ids, kv, match.entry.info)
        return len(ids) - match.tokens

    def conversation(self, conversation_id: str) -> Conversation | None:
        return self.conversations.get(conversation_id)

    def _serve(self, job: Job, render: Callable[[], list[int]], salt: str, asked: int | None,
               stops: tuple[str, ...], temperature: float, top_p: float, seed: int | None,
               cid: str, constraint: structured.Constraint | None = None) -> Served:
        """Worker thread: tokenise, check the context, compile the constraint's grammar, look up the store,
        complete, keep the cache. ``asked``: the client's token limit; None is the rest of the context, up
        to the node's limit."""
        from pfec.common.model import serving  # deferred: torch

        field = "prompt" if cid.startswith("cmpl-") else "messages"
        try:
            ids = render()
        except ValueError as exc:  # no chat template, no tokenizer
            raise ServingError(field, str(exc)) from None
        if not ids:
            raise ServingError(field, "the prompt is empty once tokenised")
        room = self.runtime.max_context - len(ids)
        if asked is None and room < 1:
            raise ServingError(field, f"the prompt is {len(ids)} tokens: it fills the model's "
                               f"{self.runtime.max_context}-token context, leaving no room for a reply")
        if asked is not None and room < asked:
            raise ServingError(field, f"the prompt is {len(ids)} tokens; with max_tokens = {asked} it "
                               f"exceeds the model's {self.runtime.max_context}-token context")
        # As vLLM: no limit asked is the rest of the context; the node's limit bounds it (the time a request
        # holds the worker, and the room its cache reserves).
        limit = asked if asked is not None else min(room, self.limits.max_completion_tokens)
        try:
            grammar = None if constraint is None else structured.compiled(self.runtime, constraint)
        except structured.ConstraintError as exc:
            raise ServingError(exc.field, str(exc)) from None
        match = self.store.lookup(salt, ids, self.clock(), max_tokens=len(ids) - 1)
        job.mark_started()
        sampling = serving.Sampling(limit, temperature, top_p, seed, stops, grammar)
        prefix, n_cached = (match.entry.value, match.tokens) if match is not None else (None, 0)
        try:
            done = serving.complete(self.runtime, ids, prefix, n_cached, sampling, job.on_text)
        except serving.GrammarError as exc:  # the library's per-token bounds ran out mid-reply
            blamed = structured.blamed(constraint)
            raise ServingError(blamed, f"{blamed}: constrained decoding stopped: {exc}") from None
        origin = dict(match.entry.info) if match is not None else {}
        self.keep(salt, done.fed_ids, done.kv, {**origin, "completion_id": cid})
        return Served(done, origin)

    # ------------------------------------------------------------------ loop: routes
    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self._models),
            web.post("/v1/chat/completions", self._chat),
            web.post("/v1/completions", self._completions),
            web.post("/v1/responses", self.responses.create),
        ]

    def _model_names(self) -> tuple[str, ...]:
        return (self.model_id, DEFAULT_ALIAS)

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "pfec"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        parsed = await read_body(request, ChatCompletionRequest, self.max_json_depth)
        if isinstance(parsed, web.Response):
            return parsed
        problem = parsed.choice_error()
        if problem is not None:
            return error_response(ServingError(*problem))
        messages, tools = parsed.rendered(), parsed.offered()
        return await self._run(request, parsed, lambda: self.chat_ids(messages, tools), messages)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        parsed = await read_body(request, CompletionRequest, self.max_json_depth)
        if isinstance(parsed, web.Response):
            return parsed
        prompt = parsed.prompt

        def render() -> list[int]:
            from pfec.common.model import serving  # deferred: torch

            return serving.text_ids(self.runtime, prompt)

        return await self._run(request, parsed, render, None)

    def _checked_limit(self, parsed: ChatCompletionRequest | CompletionRequest) -> int | None:
        """The client's token limit checked against the node's (None: none asked; the worker fills it in
        from the prompt's length)."""
        cap = self.limits.max_completion_tokens
        limit = parsed.limit
        if limit is not None and limit > cap:
            raise ServingError(parsed.limit_field, f"{parsed.limit_field}: {limit}, above this node's "
                               f"limits.max_completion_tokens ({cap})")
        if parsed.model not in self._model_names():
            raise ServingError("model", f"model {parsed.model!r} is not served here (this node serves "
                               f"{self.model_id!r})", 404)
        return limit

    def new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):06d}{secrets.token_hex(6)}"

    def submit(self, parsed: ChatCompletionRequest | CompletionRequest, render: Callable[[], list[int]],
               cid: str) -> tuple[Job, asyncio.Future[Served]] | web.Response:
        """Check a request against the node (its token limit, its model: ServingError; the queue: a 503 to
        answer) and queue its job: the job and its future. Once queued, the caller calls ``finish`` when
        done. Both the chat and the Responses endpoint generate through here."""
        limit = self._checked_limit(parsed)
        if self.in_flight >= self.limits.serving_queue:
            return self._busy(f"{self.in_flight} requests wait or run (limits.serving_queue = "
                              f"{self.limits.serving_queue})")
        job = Job(asyncio.get_running_loop())
        try:
            constraint = parsed.constraint() if isinstance(parsed, ChatCompletionRequest) else None
            future = self.worker.submit(self._serve, job, render, parsed.salt, limit, parsed.stops,
                                        parsed.temperature, parsed.top_p, parsed.seed, cid, constraint)
        except WorkerBusy as exc:
            return self._busy(str(exc))
        self.in_flight += 1
        return job, future

    def finish(self, began: float) -> None:
        """A submitted request is answered (``began``: its ``time.monotonic()`` at submission)."""
        self.in_flight -= 1
        self._recent_s = 0.5 * self._recent_s + 0.5 * (time.monotonic() - began)
        self.export_metrics()

    async def _run(self, request: web.Request, parsed: ChatCompletionRequest | CompletionRequest,
                   render: Callable[[], list[int]],
                   messages: list[dict[str, Any]] | None) -> web.StreamResponse:
        chat = messages is not None
        cid = self.new_id("chatcmpl-" if chat else "cmpl-")
        began = time.monotonic()
        try:
            submitted = self.submit(parsed, render, cid)
        except ServingError as exc:
            return error_response(exc)
        if isinstance(submitted, web.Response):
            return submitted
        job, future = submitted
        try:
            if parsed.stream:
                return await self._stream(request, parsed, job, future, cid, chat, messages)
            try:
                served = await future
            except ServingError as exc:
                return error_response(exc)
            except asyncio.CancelledError:  # the client went away: the job runs out (max_tokens bounds it)
                future.add_done_callback(consume)
                raise
            reply = self._reply(parsed)
            reply.feed(served.completion.text)
            reply.finish()
            self._record(cid, parsed, messages, reply.message())
            body = self._body(served, cid, parsed.model, chat, reply)
            return web.json_response(body, headers=ignored_header(parsed.ignored()))
        finally:
            self.finish(began)

    def _busy(self, why: str) -> web.Response:
        retry = max(1, math.ceil(self._recent_s * max(1, self.in_flight)))
        self.metrics.serving_refused()
        body = openai_error(f"this node is busy: {why}; retry later", None, "server_error", "overloaded")
        return web.json_response(body, status=503, headers={"Retry-After": str(retry)})

    def _reply(self, parsed: ChatCompletionRequest | CompletionRequest) -> openai_tools.Reply:
        if isinstance(parsed, ChatCompletionRequest):
            return openai_tools.Reply(parsed.offered(), self.limits.tool_call_parser, parsed.parallel,
                                      parsed.forced)
        return openai_tools.Reply(None, self.limits.tool_call_parser, True)

    def _record(self, cid: str, parsed: ChatCompletionRequest | CompletionRequest,
                messages: list[dict[str, Any]] | None, reply: dict[str, Any]) -> None:
        """Remember a chat completion's conversation (a handoff may name it by id) and queue its cache's
        upkeep (``settle``) behind it in the worker; skipped when the worker is full."""
        if messages is None or not isinstance(parsed, ChatCompletionRequest):
            return
        turn = {**reply, "content": reply["content"] or ""}
        tools = parsed.offered()
        conversation = self.conversations[cid] = Conversation(
            cid, parsed.salt, (*messages, turn), None if tools is None else tuple(tools))
        while len(self.conversations) > CONVERSATIONS_KEPT:
            self.conversations.popitem(last=False)
        try:
            settled = self.worker.submit(self.settle, parsed.salt, conversation.messages, conversation.tools)
        except WorkerBusy:
            return
        settled.add_done_callback(consume)

    def _body(self, served: Served, cid: str, model: str, chat: bool,
              reply: openai_tools.Reply) -> dict[str, Any]:
        done = served.completion
        choice: dict[str, Any] = {"index": 0, "finish_reason": reply.finish_reason(done.finish_reason),
                                  "logprobs": None}
        if chat:
            choice["message"] = reply.message()
        else:
            choice["text"] = done.text
        return {"id": cid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": model, "choices": [choice],
                "usage": usage(done.prompt_tokens, len(done.token_ids), done.cached_tokens),
                "pfec": self._extension(served, cid)}

    @staticmethod
    def _extension(served: Served, cid: str) -> dict[str, Any]:
        done = served.completion
        origin = served.origin
        return {"conversation_id": cid, "cached_tokens": done.cached_tokens,
                "prefill_tokens": done.prompt_tokens - done.cached_tokens,
                "server_ttft_s": round(done.ttft_s, 6),
                "prefix": {k: origin[k] for k in ("handoff_id", "recovered_utility", "precision",
                                                   "precision_utility", "missing", "completion_id")
                           if k in origin}
                if origin else None}

    async def _stream(self, request: web.Request, parsed: ChatCompletionRequest | CompletionRequest,
                      job: Job, future: asyncio.Future[Served], cid: str, chat: bool,
                      messages: list[dict[str, Any]] | None) -> web.StreamResponse:
        """Server-sent events: the first chunk once the job has started (errors before it are plain
        400s), one per piece of text, the finish reason, usage (with ``stream_options.include_usage``, or
        always under ``limits.force_include_usage``: frameworks ask for it only from OpenAI's own URL)."""
        started: asyncio.Future[Any] = asyncio.ensure_future(job.started.wait())
        await asyncio.wait([started, future], return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        if future.done() and future.exception() is not None:
            exc = future.exception()
            if isinstance(exc, ServingError):
                return error_response(exc)
            raise exc  # type: ignore[misc]  # the JSON 500 middleware answers
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        response = web.StreamResponse(headers={**headers, **ignored_header(parsed.ignored())})
        await response.prepare(request)
        chunk = _Chunks(cid, parsed.model, chat)
        reply = self._reply(parsed)
        try:
            if chat:
                await _send(response, chunk.delta({"role": "assistant", "content": ""}))
            while not (future.done() and job.texts.empty()):
                getter: asyncio.Future[Any] = asyncio.ensure_future(job.texts.get())
                await asyncio.wait([getter, future], return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    for delta in reply.deltas(reply.feed(getter.result())):
                        await _send(response, chunk.delta(delta))
                else:
                    getter.cancel()
            served = await future
            for delta in reply.deltas(reply.finish()):  # a call the end of the reply closes
                await _send(response, chunk.delta(delta))
        except (ConnectionResetError, asyncio.CancelledError):
            job.gone.set()  # the worker stops at its next token
            future.add_done_callback(consume)
            raise
        except Exception:  # the headers are out: end the stream with an error event, never a 500 page
            log.exception("%s failed mid-stream", cid)
            failed = openai_error("generation failed (see the node's log)", None, "server_error")
            await _send(response, failed)
            await response.write_eof()
            return response
        done = served.completion
        self._record(cid, parsed, messages, reply.message())
        await _send(response, chunk.finish(reply.finish_reason(done.finish_reason)))
        if parsed.include_usage or self.limits.force_include_usage:
            counts = usage(done.prompt_tokens, len(done.token_ids), done.cached_tokens)
            await _send(response, chunk.usage(counts, self._extension(served, cid)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def export_metrics(self) -> None:
        """The store's counters and size, as the node's metrics."""
        self.metrics.prefix_cache(self.store.stats, self.store.nbytes, len(self.store))


class _Chunks:
    """The stream's chunk objects (``chat.completion.chunk`` or ``text_completion``)."""

    def __init__(self, cid: str, model: str, chat: bool) -> None:
        self.head = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model}
        self.chat = chat

    def delta(self, part: dict[str, Any]) -> dict[str, Any]:
        """A chunk of one delta (``{"content": ...}`` is a completion's ``text``)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": None, "logprobs": None}
        choice.update({"delta": part} if self.chat else {"text": part["content"]})
        return {**self.head, "choices": [choice]}

    def finish(self, reason: str) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        return {**self.head, "choices": [choice]}

    def usage(self, counts: dict[str, Any], extension: dict[str, Any]) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": counts, "pfec": extension}


async def _send(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")
