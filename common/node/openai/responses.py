"""``POST /v1/responses``: the Responses API (the OpenAI Agents SDK's default model class speaks it) over
the chat endpoint's generation.

A request (``responses_models.ResponsesRequest``) is translated into the chat request it stands for and
generated through the face's own path (``OpenAIFace.submit``): the same prefix store, tools, tool choice
and structured output. The reply's text and calls (``tools.Reply``) become the response's output items
(``Output``): one ``message`` item with its ``output_text``, and a ``function_call`` item per call, in the
order they came. Streamed, the same items as OpenAI's event sequence, each with its ``sequence_number``.

``previous_response_id``: each response (unless ``store`` is false) is kept in a bounded LRU
(``ResponseStore``: by count and by bytes, per node, per cache salt) as its conversation's chat messages,
the instructions left out (OpenAI carries them over no more than it does). A follow-up prepends them, so
its prompt renders as the earlier turn did and the prefix store serves it. The conversation is also the
face's, under the response id, so ``POST /handoffs`` may name it by its ``resp_`` id.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from aiohttp import web
from pydantic import TypeAdapter, ValidationError

from pfec.common.node.config_models import CommonLimits
from pfec.common.node.openai.jobs import (
    Job,
    Served,
    ServingError,
    consume,
    error_response,
    ignored_header,
    read_body,
)
from pfec.common.node.openai.models import ChatCompletionRequest, openai_error, validation_error
from pfec.common.node.openai.responses_items import Items, chat_messages
from pfec.common.node.openai.responses_models import ResponsesRequest, client, client_message
from pfec.common.node.openai.tools import Event, ParsedCall, Reply

log = logging.getLogger("pfec.openai")
RESPONSES_KEPT = 1024  # responses kept for previous_response_id, per node
RESPONSES_BYTES = 64 << 20  # their conversations' JSON, all together
_ITEMS: TypeAdapter[Any] = TypeAdapter(Items)


class Face(Protocol):
    """What the Responses API uses of ``openai.http.OpenAIFace`` (it cannot import it: that module mounts
    this one)."""

    limits: CommonLimits
    max_json_depth: int

    def new_id(self, prefix: str) -> str: ...
    def chat_ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                 add_generation_prompt: bool = True) -> list[int]: ...
    def submit(self, parsed: ChatCompletionRequest, render: Callable[[], list[int]],
               cid: str) -> tuple[Job, asyncio.Future[Served]] | web.Response: ...
    def finish(self, began: float) -> None: ...
    def _reply(self, parsed: ChatCompletionRequest) -> Reply: ...
    def _record(self, cid: str, parsed: ChatCompletionRequest, messages: list[dict[str, Any]] | None,
                reply: dict[str, Any]) -> None: ...
    @staticmethod
    def _extension(served: Served, cid: str) -> dict[str, Any]: ...


class ResponseStore:
    """Responses' conversations for ``previous_response_id``: an LRU bounded by count and by bytes (each
    entry's messages as compact JSON). An entry is found only under the cache salt it was served with."""

    def __init__(self, max_entries: int = RESPONSES_KEPT, max_bytes: int = RESPONSES_BYTES) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, tuple[str, tuple[dict[str, Any], ...], int]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, rid: str, salt: str, messages: Sequence[Mapping[str, Any]]) -> bool:
        """Keep a response's conversation (False: larger than the whole store, not kept)."""
        size = len(json.dumps(list(messages), separators=(",", ":")))
        if size > self.max_bytes:
            return False
        self._drop(rid)
        self._entries[rid] = (salt, tuple(dict(m) for m in messages), size)
        self.nbytes += size
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, rid: str, salt: str) -> list[dict[str, Any]] | None:
        found = self._entries.get(rid)
        if found is None or found[0] != salt:
            return None
        self._entries.move_to_end(rid)
        return [dict(m) for m in found[1]]

    def _drop(self, rid: str) -> None:
        gone = self._entries.pop(rid, None)
        if gone is not None:
            self.nbytes -= gone[2]


class Output:
    """A reply's events (text pieces, parsed calls) as the response's output items, and as the stream's
    events that build them (each without its ``sequence_number``). The message item opens at the first
    text and closes at the end (text after a call joins it: the chat message has one content); a call is
    an item of its own, added and done at once."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None
        self.index = -1  # the message item's output_index
        self.text = ""

    def feed(self, events: Sequence[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, ParsedCall):
                out += self._call(event)
            elif event:
                out += self._open() if self.message is None else []
                self.text += event
                out.append({"type": "response.output_text.delta", **self._where(), "delta": event,
                            "logprobs": []})
        return out

    def close(self, incomplete: bool) -> list[dict[str, Any]]:
        """The events that end the output (an empty message when the reply was nothing at all)."""
        out = self._open() if self.message is None and not self.items else []
        if self.message is None:
            return out
        part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
        self.message.update(status="incomplete" if incomplete else "completed", content=[part])
        where = self._where()
        return [*out, {"type": "response.output_text.done", **where, "text": self.text, "logprobs": []},
                {"type": "response.content_part.done", **where, "part": copy.deepcopy(part)},
                {"type": "response.output_item.done", "output_index": self.index,
                 "item": copy.deepcopy(self.message)}]

    def _open(self) -> list[dict[str, Any]]:
        self.message = {"id": f"msg_{secrets.token_hex(16)}", "type": "message", "role": "assistant",
                        "status": "in_progress", "content": []}
        self.index = len(self.items)
        self.items.append(self.message)
        return [{"type": "response.output_item.added", "output_index": self.index,
                 "item": copy.deepcopy(self.message)},
                {"type": "response.content_part.added", **self._where(),
                 "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}]

    def _where(self) -> dict[str, Any]:
        assert self.message is not None
        return {"item_id": self.message["id"], "output_index": self.index, "content_index": 0}

    def _call(self, call: ParsedCall) -> list[dict[str, Any]]:
        item = {"id": f"fc_{secrets.token_hex(16)}", "type": "function_call", "call_id": call.id,
                "name": call.name, "arguments": "", "status": "in_progress"}
        index = len(self.items)
        self.items.append(item)
        added = {"type": "response.output_item.added", "output_index": index, "item": dict(item)}
        where = {"item_id": item["id"], "output_index": index}
        item.update(arguments=call.arguments, status="completed")
        return [added, {"type": "response.function_call_arguments.delta", **where, "delta": call.arguments},
                {"type": "response.function_call_arguments.done", **where, "arguments": call.arguments},
                {"type": "response.output_item.done", "output_index": index, "item": dict(item)}]


def response_usage(served: Served) -> dict[str, Any]:
    """The Responses API's ``usage``: the input tokens served from the node's cache, and those written."""
    done = served.completion
    return {"input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": done.cached_tokens,
                                     "cache_write_tokens": done.prompt_tokens - done.cached_tokens},
            "output_tokens": len(done.token_ids), "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.prompt_tokens + len(done.token_ids)}


def _client_error(exc: ServingError) -> ServingError:
    """A chat request's error with the field as this API spells it."""
    return ServingError(client(exc.param), client_message(exc.param, str(exc)), exc.status)


class ResponsesAPI:
    """One node's ``POST /v1/responses`` over its OpenAI face."""

    def __init__(self, face: Face) -> None:
        self.face = face
        self.store = ResponseStore()

    async def create(self, request: web.Request) -> web.StreamResponse:
        parsed = await read_body(request, ResponsesRequest, self.face.max_json_depth)
        if isinstance(parsed, web.Response):
            return parsed
        prior: list[dict[str, Any]] = []
        if parsed.previous_response_id is not None:
            kept = self.store.get(parsed.previous_response_id, parsed.salt)
            if kept is None:
                return error_response(ServingError("previous_response_id", (
                    f"previous_response_id: no response {parsed.previous_response_id!r} is kept on this node "
                    "under this cache salt (never served here, stored with store: false, or dropped from its "
                    "bounded store): send the whole conversation as input"), 404))
            prior = kept
        new = parsed.input_messages()
        chat = self._chat_request(parsed.chat_body(prior, new))
        if isinstance(chat, web.Response):
            return chat
        problem = chat.choice_error()
        if problem is not None:
            return error_response(_client_error(ServingError(*problem)))
        messages, tools = chat.rendered(), chat.offered()
        rid = self.face.new_id("resp_")
        began = time.monotonic()
        try:
            submitted = self.face.submit(chat, lambda: self.face.chat_ids(messages, tools), rid)
        except ServingError as exc:
            return error_response(_client_error(exc))
        if isinstance(submitted, web.Response):
            return submitted  # busy: no field to name
        job, future = submitted
        turn = _Turn(self, parsed, chat, rid, messages, prior + new)
        headers = ignored_header(parsed.ignored() + [n for n in chat.ignored() if n not in parsed.ignored()])
        try:
            if parsed.stream:
                return await turn.stream(request, job, future, headers)
            try:
                served = await future
            except ServingError as exc:
                return error_response(_client_error(exc))
            except asyncio.CancelledError:  # the client went away: the job runs out (its limit bounds it)
                future.add_done_callback(consume)
                raise
            reply = self.face._reply(chat)
            output = Output()
            output.feed(reply.feed(served.completion.text))
            output.feed(reply.finish())
            incomplete = reply.finish_reason(served.completion.finish_reason) == "length"
            output.close(incomplete)
            turn.done(reply, output)
            return web.json_response(turn.body(output, served, incomplete), headers=headers)
        finally:
            self.face.finish(began)

    @staticmethod
    def _chat_request(body: dict[str, Any]) -> ChatCompletionRequest | web.Response:
        """The translated request through the chat request's own validation (JSON, strict: as the chat
        endpoint reads it), an error naming this API's field."""
        raw = json.dumps(body).encode()
        try:
            return ChatCompletionRequest.model_validate_json(raw, strict=True)
        except ValidationError as exc:
            error = validation_error(exc, raw)["error"]
            param = error["param"]
            return web.json_response(openai_error(client_message(param, error["message"]), client(param)),
                                     status=400)


class _Turn:
    """One request's answer: its body, its stream, what is kept of it."""

    def __init__(self, api: ResponsesAPI, parsed: ResponsesRequest, chat: ChatCompletionRequest, rid: str,
                 messages: list[dict[str, Any]], conversation: list[dict[str, Any]]) -> None:
        self.api, self.parsed, self.chat, self.rid = api, parsed, chat, rid
        self.messages = messages  # the chat request's (the instructions first)
        self.conversation = conversation  # what a follow-up prepends (no instructions)
        self.created = int(time.time())

    def done(self, reply: Reply, output: Output) -> None:
        """Keep the conversation: the face's (cache upkeep, a handoff by id) and, unless ``store`` is false,
        this API's for ``previous_response_id`` (the output items through the one converter, as a client
        sending them back as input would have them)."""
        self.api.face._record(self.rid, self.chat, self.messages, reply.message())
        if not self.parsed.store:
            return
        try:
            turn = chat_messages(_ITEMS.validate_python(copy.deepcopy(output.items)))
        except ValidationError as exc:  # a reply past the input's bounds (a call's arguments): not kept
            log.warning("%s is not kept for previous_response_id: %s", self.rid, exc.errors()[0]["msg"])
            return
        self.api.store.put(self.rid, self.parsed.salt, self.conversation + turn)

    def body(self, output: Output | None, served: Served | None, incomplete: bool = False,
             failed: str | None = None) -> dict[str, Any]:
        """The response object (``output`` None: the stream's opening snapshot, in progress)."""
        status = ("failed" if failed is not None else "in_progress" if served is None
                  else "incomplete" if incomplete else "completed")
        body: dict[str, Any] = {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "error": None if failed is None else {"code": "server_error", "message": failed},
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": [] if output is None else copy.deepcopy(output.items), **self.parsed.echoed(),
            "usage": None if served is None else response_usage(served)}
        if served is not None:
            body["completed_at"] = int(time.time())
            body["pfec"] = self.api.face._extension(served, self.rid)
        return body

    async def stream(self, request: web.Request, job: Job, future: asyncio.Future[Served],
                     headers: dict[str, str]) -> web.StreamResponse:
        """OpenAI's event sequence: created, in_progress, the items' events as the reply comes, then
        completed (or incomplete) with usage. Errors before the job starts are plain 4xx answers; after,
        a ``response.failed`` event ends the stream."""
        face = self.api.face
        started: asyncio.Future[Any] = asyncio.ensure_future(job.started.wait())
        await asyncio.wait([started, future], return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        if future.done() and future.exception() is not None:
            exc = future.exception()
            if isinstance(exc, ServingError):
                return error_response(_client_error(exc))
            raise exc  # type: ignore[misc]  # the JSON 500 middleware answers
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache", **headers})
        await response.prepare(request)
        events = _Events(response)
        reply, output = face._reply(self.chat), Output()
        try:
            await events.send({"type": "response.created", "response": self.body(None, None)})
            await events.send({"type": "response.in_progress", "response": self.body(None, None)})
            while not (future.done() and job.texts.empty()):
                getter: asyncio.Future[Any] = asyncio.ensure_future(job.texts.get())
                await asyncio.wait([getter, future], return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    await events.send_all(output.feed(reply.feed(getter.result())))
                else:
                    getter.cancel()
            served = await future
            await events.send_all(output.feed(reply.finish()))
            incomplete = reply.finish_reason(served.completion.finish_reason) == "length"
            await events.send_all(output.close(incomplete))
        except (ConnectionResetError, asyncio.CancelledError):
            job.gone.set()  # the worker stops at its next token
            future.add_done_callback(consume)
            raise
        except Exception:  # the headers are out: end the stream with a failed response, never a 500 page
            log.exception("%s failed mid-stream", self.rid)
            failed = self.body(output, None, failed="generation failed (see the node's log)")
            await events.send({"type": "response.failed", "response": failed})
            await response.write_eof()
            return response
        self.done(reply, output)
        final = self.body(output, served, incomplete)
        await events.send({"type": "response.incomplete" if incomplete else "response.completed",
                           "response": final})
        await response.write_eof()
        return response


class _Events:
    """The stream's server-sent events, numbered in order (``sequence_number``)."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response
        self.sequence = 0

    async def send(self, event: dict[str, Any]) -> None:
        payload = {**event, "sequence_number": self.sequence}
        self.sequence += 1
        data = json.dumps(payload, separators=(",", ":"))
        await self.response.write(f"event: {event['type']}\ndata: {data}\n\n".encode())

    async def send_all(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            await self.send(event)
