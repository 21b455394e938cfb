"""The OpenAI face's request fields (issue 38, item 4), through the real aiohttp app on a tiny random Llama
(fast): the fields that change nothing are accepted, ignored and named in ``X-PFEC-Ignored-Fields``
(streamed or not, both endpoints); explicit nulls mean the defaults; what would change the answer and is
not built is a 400 naming the field; every error names the field as the client wrote it; ``max_tokens``
left out is the rest of the context up to the node's limit; ``limits.force_include_usage`` ends every
stream with usage.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
from pydantic import ValidationError

from pfec.common.model import llm, serving
from pfec.common.node.config import LimitsConfig, SenderLimitsConfig
from pfec.common.node.control import ControlServer
from pfec.common.node.openai.http import IGNORED_HEADER, OpenAIFace
from pfec.common.node.openai.models import MAX_METADATA_KEYS
from pfec.common.node.worker import ModelWorker
from pfec.receiver.metrics import ReceiverMetrics

TOKEN = "t" * 32
MODEL = "tiny-llama"
# The tiny model's words are w0 .. w95 (w2 ends a turn): a chat template of its own words.
TEMPLATE = ("{% for m in messages %}w3 {{ m['content'] }} w2 {% endfor %}"
            "{% if add_generation_prompt %}w4 {% endif %}")
HELLO = [{"role": "user", "content": "w5 w6 w7"}]


@pytest.fixture(scope="module")
def chat_tiny(tiny: llm.ModelRuntime) -> llm.ModelRuntime:
    assert tiny.tokenizer is not None
    tiny.tokenizer.chat_template = TEMPLATE
    return tiny


@dataclass
class Node:
    url: str
    face: OpenAIFace

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        """A request's status, JSON body (or the stream's events as ``{"events": [...]}``) and headers."""
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession(headers=headers) as session, session.post(
                self.url + path, data=json.dumps(body)) as response:
            if response.content_type == "text/event-stream":
                events = [json.loads(line[6:]) for line in (await response.text()).splitlines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
                return response.status, {"events": events}, dict(response.headers)
            return response.status, await response.json(), dict(response.headers)


@asynccontextmanager
async def serving_node(runtime: llm.ModelRuntime, **limits: Any) -> AsyncIterator[Node]:
    """One OpenAI face on its own worker, behind the control API's app on TCP (bearer token)."""
    worker = ModelWorker("test-serving")
    face = OpenAIFace(runtime, worker, ReceiverMetrics(process_metrics=False), LimitsConfig(**limits))
    server = ControlServer(face.routes())
    await server.start(None, ("127.0.0.1", 0), TOKEN)
    try:
        yield Node(f"http://127.0.0.1:{server.tcp_port}/v1", face)
    finally:
        while worker.pending:  # the cache upkeep queued behind the last response
            await asyncio.sleep(0.01)
        await server.close()
        worker.shutdown()


def run(runtime: llm.ModelRuntime, test: Callable[[Node], Awaitable[None]], **limits: Any) -> None:
    async def main() -> None:
        async with serving_node(runtime, **limits) as node:
            await test(node)

    asyncio.run(main())


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 3, "temperature": 0, **fields}


# Fields that change nothing here, as clients send them (the Agents SDK, LangChain, OpenAI's own SDK).
IGNORED = {"store": True, "metadata": {"run": "r1", "team": "a"}, "service_tier": "auto",
           "prompt_cache_key": "conversation-7", "safety_identifier": "user-hash", "user": "ada"}
IGNORED_NAMES = "store, metadata, service_tier, prompt_cache_key, safety_identifier, user"
# Explicit nulls of optional fields (the default each stands for).
NULLS = {"tool_choice": None, "top_p": None, "stop": None, "seed": None, "n": None, "presence_penalty": None,
         "frequency_penalty": None, "logit_bias": None, "logprobs": None, "top_logprobs": None, "tools": None,
         "response_format": None, "stream_options": None, "max_completion_tokens": None,
         "parallel_tool_calls": None, "reasoning_effort": None, "audio": None}


def test_fields_that_change_nothing_are_ignored_and_named_in_a_header(chat_tiny: llm.ModelRuntime) -> None:
    async def test(node: Node) -> None:
        status, plain, headers = await node.post("/chat/completions", _chat(cache_salt="a"))
        assert status == 200 and IGNORED_HEADER not in headers, (plain, headers)
        loose_request = _chat(cache_salt="b", **IGNORED, **NULLS)
        status, loose, headers = await node.post("/chat/completions", loose_request)
        assert status == 200, loose
        assert headers[IGNORED_HEADER] == IGNORED_NAMES
        # Greedy, and each from a cache of its own salt: the ignored fields and the nulls change nothing.
        assert loose["choices"][0]["message"] == plain["choices"][0]["message"]
        assert loose["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
        # A null temperature is the default (1.0: sampled), a null max_tokens the rest of the context.
        status, sampled, _ = await node.post("/chat/completions", _chat(temperature=None, max_tokens=None))
        assert status == 200 and sampled["usage"]["completion_tokens"] >= 1, sampled
        # Streamed: the same header, the same text.
        status, streamed, headers = await node.post("/chat/completions", _chat(
            cache_salt="c", stream=True, stream_options={"include_usage": True, "include_obfuscation": False},
            **IGNORED))
        assert status == 200
        assert headers[IGNORED_HEADER] == IGNORED_NAMES + ", stream_options.include_obfuscation"
        deltas = [e["choices"][0]["delta"] for e in streamed["events"] if e["choices"]]
        text = "".join(d.get("content", "") for d in deltas)
        assert text == plain["choices"][0]["message"]["content"]
        # Message fields the template never sees are named once, not per message; an echoed reply's nulls
        # (what the openai SDK's message objects serialise to) are accepted.
        echoed = {"role": "assistant", "content": "w9", "refusal": None, "tool_calls": None,
                  "function_call": None, "audio": None, "name": "bot"}
        status, body, headers = await node.post("/chat/completions", _chat(
            messages=[{**HELLO[0], "name": "ada"}, echoed, HELLO[0]], parallel_tool_calls=True))
        assert status == 200 and headers[IGNORED_HEADER] == "parallel_tool_calls, messages.*.name", body
        # /v1/completions too, streamed and not.
        for stream in (False, True):
            status, done, headers = await node.post("/completions", {
                "model": MODEL, "prompt": "w5 w6", "max_tokens": 2, "stream": stream, "echo": None,
                "best_of": None, "suffix": None, "logprobs": None, "store": False, "user": "ada"})
            assert status == 200 and headers[IGNORED_HEADER] == "store, user", done

    run(chat_tiny, test)


# A request's field and what it may not be: a 400 naming the field (the message names it too).
REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("/chat/completions", {"n": 2}, "n", "n = 1"),
    ("/chat/completions", {"logit_bias": {"5": 10}}, "logit_bias", "changes the answer"),
    ("/chat/completions", {"logprobs": True}, "logprobs", "not built yet"),
    ("/chat/completions", {"top_logprobs": 2}, "top_logprobs", "not built yet"),
    # Tools and constrained decoding are built (tests/test_openai_tools.py, tests/test_constrained.py); a
    # choice no grammar can hold is refused.
    ("/chat/completions", {"tool_choice": "required"}, "tool_choice", "needs tools to call"),
    ("/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice.function.name", "not one of the tools"),
    ("/chat/completions", {"functions": [{"name": "f"}]}, "functions", "not built yet"),
    ("/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
     "response_format.json_schema.name", "pattern"),
    ("/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "response_format.json_schema.schema", "not a JSON type"),
    ("/chat/completions", {"response_format": {"type": "xml"}}, "response_format", "does not match"),
    ("/chat/completions", {"modalities": ["text", "audio"]}, "modalities", "audio"),
    ("/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort", "not served"),
    ("/chat/completions", {"presence_penalty": 0.5}, "presence_penalty", "penalties"),
    ("/chat/completions", {"top_k": 5}, "top_k", "not a parameter"),
    ("/completions", {"best_of": 2}, "best_of", "best_of = 1"),
    ("/completions", {"suffix": "w9"}, "suffix", "not served"),
    ("/completions", {"logprobs": 1}, "logprobs", "not built yet"),
    ("/completions", {"echo": True}, "echo", "echo"),
]


def test_what_would_change_the_answer_is_a_400_naming_the_field(chat_tiny: llm.ModelRuntime) -> None:
    async def test(node: Node) -> None:
        for path, fields, param, why in REFUSED:
            chat = path == "/chat/completions"
            base = _chat() if chat else {"model": MODEL, "prompt": "w5", "max_tokens": 2}
            status, body, _ = await node.post(path, {**base, **fields})
            error = body.get("error", {})
            assert status == 400 and error.get("param") == param, (fields, body)
            assert why in error["message"] and error["message"].startswith(param + ":"), (fields, body)

    run(chat_tiny, test)


def test_errors_name_the_field_as_the_client_wrote_it(chat_tiny: llm.ModelRuntime) -> None:
    async def test(node: Node) -> None:
        # An assistant turn with null content renders as empty text.
        null_reply: list[dict[str, Any]] = [*HELLO, {"role": "assistant", "content": None},
                                            {"role": "user", "content": "w8"}]
        status, body, _ = await node.post("/chat/completions", _chat(messages=null_reply))
        assert status == 200, body
        ids = serving.chat_ids(chat_tiny, [{**m, "content": m["content"] or ""} for m in null_reply])
        assert body["usage"]["prompt_tokens"] == len(ids)
        cases: list[tuple[dict[str, Any], str, str]] = [
            ({"messages": [{"role": "user", "content": None}]}, "messages.0.content", "needs content"),
            ({"messages": [{"role": "user"}]}, "messages.0.content", "needs content"),
            ({"messages": [*HELLO, {"role": "user", "content": 5}]}, "messages.1.content", "valid string"),
            # A list of parts: its bad part is named, not the string the content might also have been.
            ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
             "messages.0.content.0.text", "valid string"),
            ({"messages": [{"role": "user", "content": [{"type": "text", "text": "w5"},
                                                         {"type": "image_url"}]}]},
             "messages.0.content.1.type", "'text'"),
            ({"messages": [{"role": "robot", "content": "w5"}]}, "messages.0.role", "'user'"),
            ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "valid boolean"),
            ({"max_tokens": 2, "max_completion_tokens": 2}, "max_completion_tokens", "not both"),
            # An ignored field is still bounded, as OpenAI bounds it.
            ({"metadata": {f"k{i}": "v" for i in range(MAX_METADATA_KEYS + 1)}}, "metadata", "at most 16"),
            ({"metadata": {"k" * 65: "v"}}, "metadata." + "k" * 64 + "...", "at most 64 characters"),
            ({"metadata": {"k": "v" * 513}}, "metadata.k", "at most 512 characters"),
            ({"metadata": {"k": 1}}, "metadata.k", "valid string"),
            ({"prompt_cache_key": "p" * 1025}, "prompt_cache_key", "at most 1024"),
            ({"service_tier": 3}, "service_tier", "valid string"),
        ]
        for fields, param, why in cases:
            status, body, _ = await node.post("/chat/completions", _chat(**fields))
            error = body.get("error", {})
            assert status == 400 and error.get("param") == param, (fields, body)
            assert why in error["message"], (fields, body)
            # Never pydantic's own names: a union member tried, a map key's marker.
            for internal in ("constrained-str", "list[", "[key]", "function-", "TextPart"):
                assert internal not in error["message"], (fields, body)

    run(chat_tiny, test)


def test_max_tokens_left_out_is_the_rest_of_the_context_up_to_the_nodes_limit(
        chat_tiny: llm.ModelRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []
    complete = serving.complete

    def spy(runtime: llm.ModelRuntime, ids: list[int], *args: Any, **kwargs: Any) -> serving.Completion:
        asked.append(args[2].max_tokens)  # (prefix, n_cached, sampling, on_text)
        return complete(runtime, ids, *args, **kwargs)

    monkeypatch.setattr(serving, "complete", spy)
    context = chat_tiny.max_context  # 256 positions
    short = len(serving.chat_ids(chat_tiny, HELLO))

    def words(n: int) -> str:  # one token each ("w2" is a special token: "w20" would be two)
        return " ".join(f"w{30 + i % 60}" for i in range(n))

    async def test(node: Node) -> None:
        status, body, _ = await node.post("/chat/completions", _chat(max_tokens=None))
        assert status == 200 and asked[-1] == context - short, body  # the node's limit (300) is above it
        # A prompt that leaves less room than the node's limit: the room, not a 400.
        long = [{"role": "user", "content": words(context - 8)}]
        n_long = len(serving.chat_ids(chat_tiny, long))
        status, body, _ = await node.post("/chat/completions", _chat(messages=long, max_tokens=None))
        assert status == 200 and asked[-1] == context - n_long, body
        # Asked for more than the room: a 400 naming the prompt (as before).
        status, body, _ = await node.post("/chat/completions", _chat(messages=long, max_tokens=16))
        assert status == 400 and body["error"]["param"] == "messages", body
        # A prompt that fills the context leaves no room: a 400 naming the prompt.
        full = [{"role": "user", "content": words(context)}]
        status, body, _ = await node.post("/chat/completions", _chat(messages=full, max_tokens=None))
        assert status == 400 and body["error"]["param"] == "messages", body
        assert "no room" in body["error"]["message"]
        # /v1/completions: OpenAI's default of 16 when left out; an explicit null asks for the rest.
        prompt = {"model": MODEL, "prompt": "w5 w6", "temperature": 0}
        status, body, _ = await node.post("/completions", prompt)
        assert status == 200 and asked[-1] == 16, body
        status, body, _ = await node.post("/completions", {**prompt, "max_tokens": None})
        assert status == 200 and asked[-1] == context - 2, body

    run(chat_tiny, test, max_completion_tokens=300)

    async def capped(node: Node) -> None:
        unlimited = _chat(max_tokens=None, max_completion_tokens=None)
        status, body, _ = await node.post("/chat/completions", unlimited)
        assert status == 200 and asked[-1] == 5 and body["usage"]["completion_tokens"] <= 5, body
        status, body, _ = await node.post("/chat/completions", _chat(max_completion_tokens=6))
        assert status == 400 and body["error"]["param"] == "max_completion_tokens", body

    run(chat_tiny, capped, max_completion_tokens=5)


def _usage_chunks(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("usage")]


def test_force_include_usage_ends_every_stream_with_usage(chat_tiny: llm.ModelRuntime) -> None:
    streams = [("/chat/completions", _chat(stream=True)),
               ("/completions", {"model": MODEL, "prompt": "w5 w6", "max_tokens": 2, "stream": True})]

    async def unforced(node: Node) -> None:
        for path, body in streams:
            status, got, _ = await node.post(path, body)
            assert status == 200 and got["events"] and not _usage_chunks(got["events"]), got
            status, got, _ = await node.post(path, {**body, "stream_options": {"include_usage": True}})
            assert status == 200 and len(_usage_chunks(got["events"])) == 1, got

    async def forced(node: Node) -> None:
        for path, body in streams:
            for options in (None, {"include_usage": False}, {"include_usage": True}):
                status, got, _ = await node.post(path, {**body, "stream_options": options})
                assert status == 200, got
                last = got["events"][-1]
                assert last["choices"] == [] and _usage_chunks(got["events"]) == [last], got
                assert last["usage"]["prompt_tokens"] > 0
                assert "cached_tokens" in last["usage"]["prompt_tokens_details"]
        # The openai client as a framework uses it against a base URL that is not OpenAI's: no
        # stream_options, and usage (with the cached tokens of the turn before) still comes.
        client = openai.AsyncOpenAI(base_url=node.url, api_key=TOKEN, max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=3, temperature=0, stream=True)  # type: ignore[arg-type]
        assert isinstance(stream, openai.AsyncStream)
        chunks = [c async for c in stream]
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached is not None and cached > 0  # the turns before left their cache
        await client.close()

    run(chat_tiny, unforced)
    run(chat_tiny, forced, force_include_usage=True)


def test_force_include_usage_is_a_typed_documented_option_off_by_default() -> None:
    for limits in (LimitsConfig, SenderLimitsConfig):
        field = limits.model_fields["force_include_usage"]
        assert limits().force_include_usage is False and field.description
        assert limits(force_include_usage=True).force_include_usage is True
        with pytest.raises(ValidationError, match="force_include_usage"):
            limits(force_include_usage="sometimes")  # type: ignore[arg-type]
    assert "leaves it out" in (LimitsConfig.model_fields["max_completion_tokens"].description or "")
