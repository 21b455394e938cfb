"""``POST /v1/responses`` (issue 38, item 3) through the real aiohttp app, the real ``openai`` client and the
OpenAI Agents SDK's default model class: text and tools (auto), streamed and not, parsed with the
``openai.types.responses`` models the SDK uses; ``previous_response_id`` served from the prefix store;
the ignored-fields header; errors naming the field as this API spells it. Tool calls need scripted text
(a random model never writes one): only ``serving.complete``'s text is scripted, its cache and counts
stay real (``test_openai_tools._scripted``).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import agents
import aiohttp
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from test_handoff_messages import PSK
from test_openai_fields import HELLO, MODEL, TEMPLATE, TOKEN, Node, run
from test_openai_tools import CALL, WEATHER, _scripted

from pfec.common.codec import fec
from pfec.common.model import llm, serving
from pfec.common.model.runtime import runtime_identity
from pfec.common.node.config import LimitsConfig, SenderLimitsConfig
from pfec.common.node.control import ControlServer
from pfec.common.node.openai.jobs import IGNORED_HEADER
from pfec.common.node.openai.responses import ResponseStore
from pfec.common.node.openai.responses_models import ResponsesRequest, client
from pfec.receiver.control import receiver_routes
from pfec.receiver.daemon import ReceiverDaemon
from pfec.sender.control import sender_routes
from pfec.sender.daemon import SenderDaemon

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
        "parameters": WEATHER["function"]["parameters"], "strict": True}
SYSTEM = "w9 w10"


@pytest.fixture(scope="module")
def chat_tiny(tiny: llm.ModelRuntime) -> llm.ModelRuntime:
    assert tiny.tokenizer is not None
    tiny.tokenizer.chat_template = TEMPLATE
    return tiny


def _create(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "w5 w6 w7", "max_output_tokens": 3, "temperature": 0, **fields}


def _client(node: Node) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=node.url, api_key=TOKEN, max_retries=0)


def test_text_streamed_and_not_as_the_chat_endpoint_answers(chat_tiny: llm.ModelRuntime) -> None:
    async def test(node: Node) -> None:
        api = _client(node)
        done = await api.responses.create(model=MODEL, input="w5 w6 w7", instructions=SYSTEM,
                                          max_output_tokens=3, temperature=0, extra_body={"cache_salt": "a"})
        # The same prompt through the chat endpoint (another salt: nothing cached), greedy: the same text.
        status, chat, _ = await node.post("/chat/completions", {
            "model": MODEL, "temperature": 0, "max_tokens": 3, "cache_salt": "b",
            "messages": [{"role": "system", "content": SYSTEM}, *HELLO]})
        assert status == 200, chat
        assert done.id.startswith("resp_") and done.object == "response" and done.model == MODEL
        assert done.output_text == chat["choices"][0]["message"]["content"]
        assert done.usage is not None and done.usage.input_tokens == chat["usage"]["prompt_tokens"]
        assert done.usage.output_tokens == chat["usage"]["completion_tokens"] == 3
        assert done.usage.total_tokens == done.usage.input_tokens + 3
        assert done.usage.input_tokens_details.cached_tokens == 0
        # Three tokens asked and three written: the reply was cut, as OpenAI says it.
        assert done.status == "incomplete" and done.incomplete_details is not None
        assert done.incomplete_details.reason == "max_output_tokens"
        [message] = done.output
        assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
        assert done.instructions == SYSTEM and done.tools == [] and done.tool_choice == "auto"
        # Streamed: the client's events (an incomplete stream ends in response.incomplete, which the
        # client's stream helper refuses as OpenAI's own), and the raw events in OpenAI's order, numbered.
        streamed = [e async for e in await api.responses.create(
            model=MODEL, input="w5 w6 w7", instructions=SYSTEM, max_output_tokens=3, temperature=0,
            stream=True, extra_body={"cache_salt": "c"})]
        assert streamed[-1].type == "response.incomplete"
        assert streamed[-1].response.output_text == done.output_text
        status, body, headers = await node.post("/responses", _create(stream=True, cache_salt="d",
                                                                       instructions=SYSTEM))
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        events = [EVENTS.validate_python(e) for e in body["events"]]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        kinds = [e.type for e in events]
        assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added", "response.output_text.delta"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.incomplete"]
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == done.output_text == events[-1].response.output_text
        assert events[0].response.status == "in_progress" and events[0].response.usage is None
        assert events[-1].response.usage.output_tokens == 3
        # Left out, max_output_tokens is the rest of the context up to the node's limit.
        status, body, _ = await node.post("/responses", _create(max_output_tokens=None))
        assert status == 200 and body["usage"]["output_tokens"] >= 1, body
        Response.model_validate(body)
        await api.close()

    run(chat_tiny, test)


def test_tool_calls_streamed_and_not(chat_tiny: llm.ModelRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts: list[list[int]] = []
    _scripted(monkeypatch, [CALL, "Sure. " + CALL, "Sure. " + CALL, "w5"], prompts)

    async def test(node: Node) -> None:
        api = _client(node)
        done = await api.responses.create(model=MODEL, input="w5 w6 w7", tools=[TOOL])  # type: ignore[list-item]
        assert done.status == "completed"
        [call] = done.output
        assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
        assert call.call_id.startswith("call_") and json.loads(call.arguments) == {"city": "Paris"}
        assert call.id is not None and call.id.startswith("fc_")
        assert done.tools[0].type == "function" and done.tools[0].name == "get_weather"
        # The tools opened the prompt (the Hermes fallback's system block).
        assert len(prompts[-1]) > len(serving.chat_ids(chat_tiny, HELLO))
        async with api.responses.stream(model=MODEL, input="w5 w6 w7", tools=[TOOL]) as stream:  # type: ignore[list-item]
            final = await stream.get_final_response()
        assert [item.type for item in final.output] == ["message", "function_call"]
        assert final.output_text == "Sure."
        assert final.output[1].type == "function_call"
        assert json.loads(final.output[1].arguments) == {"city": "Paris"}
        status, body, _ = await node.post("/responses", {**_create(tools=[TOOL]), "stream": True})
        events = [EVENTS.validate_python(e) for e in body["events"]]
        kinds = [e.type for e in events]
        at = kinds.index("response.function_call_arguments.delta")
        assert kinds[at - 1:at + 3] == [
            "response.output_item.added", "response.function_call_arguments.delta",
            "response.function_call_arguments.done", "response.output_item.done"]
        assert json.loads(events[at + 1].arguments) == {"city": "Paris"}
        assert events[-1].type == "response.completed" and events[-1].response.status == "completed"
        # tool_choice none: the tools are not offered (the prompt as without them).
        status, body, headers = await node.post("/responses", _create(tools=[TOOL], tool_choice="none",
                                                                      parallel_tool_calls=True))
        assert status == 200 and body["output"][0]["content"][0]["text"] == "w5", body
        assert prompts[-1] == serving.chat_ids(chat_tiny, HELLO)
        assert headers[IGNORED_HEADER] == "parallel_tool_calls"
        await api.close()

    run(chat_tiny, test)


def test_previous_response_id_continues_from_the_prefix_store(chat_tiny: llm.ModelRuntime,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    prompts: list[list[int]] = []
    _scripted(monkeypatch, ["w11 w12", CALL, "w13", "w14", "w15", "w16"], prompts)

    async def test(node: Node) -> None:
        api = _client(node)
        first = await api.responses.create(model=MODEL, input="w5 w6 w7", instructions=SYSTEM,
                                           tools=[TOOL])  # type: ignore[list-item]
        second = await api.responses.create(model=MODEL, input="w8", instructions=SYSTEM, tools=[TOOL],  # type: ignore[list-item]
                                            previous_response_id=first.id)
        assert second.previous_response_id == first.id
        # The earlier turn opened the prompt: instructions, its input, its reply, then the new input.
        turn = [{"role": "system", "content": SYSTEM}, *HELLO, {"role": "assistant", "content": "w11 w12"},
                {"role": "user", "content": "w8"}]
        strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
        assert prompts[-1] == node.face.chat_ids(turn, [strict])
        assert second.usage is not None and second.usage.input_tokens_details.cached_tokens >= len(prompts[0])
        # A call and its output, continued by id: the output item goes in as a tool message.
        [call] = second.output
        assert call.type == "function_call"
        third = await api.responses.create(model=MODEL, instructions=SYSTEM, tools=[TOOL],  # type: ignore[list-item]
                                           previous_response_id=second.id, input=[
                                               {"type": "function_call_output", "call_id": call.call_id,
                                                "output": "sunny"}])
        assert third.output_text == "w13" and third.usage is not None
        assert third.usage.input_tokens_details.cached_tokens >= len(prompts[1])
        # The whole conversation sent back as items (the Agents SDK's default) renders the same prompt.
        def echoed(response: Response) -> list[dict[str, Any]]:
            return [o.model_dump(exclude_none=True) for o in response.output]

        result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
        items = [{"role": "user", "content": "w5 w6 w7"}, *echoed(first), {"role": "user", "content": "w8"},
                 *echoed(second), result, *echoed(third), {"role": "user", "content": "w9"}]
        status, whole, _ = await node.post("/responses", _create(input=items, instructions=SYSTEM,
                                                                  tools=[TOOL], max_output_tokens=None))
        by_id = prompts[-1]
        status, chained, _ = await node.post("/responses", _create(
            input="w9", instructions=SYSTEM, tools=[TOOL], previous_response_id=third.id, store=False,
            max_output_tokens=None))
        assert status == 200 and prompts[-1] == by_id, chained
        assert chained["usage"]["input_tokens_details"]["cached_tokens"] >= len(prompts[2]), chained
        assert whole["usage"]["input_tokens_details"]["cached_tokens"] >= len(prompts[2]), whole
        # store false: not kept; an unknown id, or one kept under another cache salt: a 404 naming it.
        for rid, salt in ((chained["id"], None), ("resp_never", None), (third.id, "other")):
            status, bad, _ = await node.post("/responses", _create(previous_response_id=rid, cache_salt=salt))
            assert status == 404 and bad["error"]["param"] == "previous_response_id", bad
        with pytest.raises(openai.NotFoundError, match="previous_response_id"):
            await api.responses.create(model=MODEL, input="w5", previous_response_id="resp_gone")
        # The face keeps the conversation under the response id: a handoff may name it.
        kept = node.face.conversation(third.id)
        assert kept is not None and kept.messages[-1] == {"role": "assistant", "content": "w13"}
        await api.close()

    run(chat_tiny, test)


def test_fields_that_change_nothing_are_named_in_the_header(chat_tiny: llm.ModelRuntime) -> None:
    async def test(node: Node) -> None:
        status, plain, headers = await node.post("/responses", _create(cache_salt="a"))
        assert status == 200 and IGNORED_HEADER not in headers, plain
        loose = _create(cache_salt="b", metadata={"run": "r1"}, service_tier="auto", prompt_cache_key="k",
                        safety_identifier="s", user="ada", include=["reasoning.encrypted_content"],
                        reasoning={"effort": None, "summary": None}, store=True, truncation="disabled",
                        background=False, top_logprobs=0, tool_choice=None, tools=None, text=None,
                        parallel_tool_calls=None, previous_response_id=None, conversation=None, prompt=None)
        status, body, headers = await node.post("/responses", loose)
        assert status == 200, body
        assert headers[IGNORED_HEADER] == (
            "metadata, service_tier, prompt_cache_key, safety_identifier, user, include, reasoning")
        assert body["output"] == [{**body["output"][0], "id": body["output"][0]["id"]}]
        assert body["output"][0]["content"] == plain["output"][0]["content"]
        assert body["metadata"] == {"run": "r1"}
        # The Agents SDK's empty include list is nothing sent.
        status, body, headers = await node.post("/responses", _create(include=[], text={"format": {
            "type": "text"}}, stream=True, stream_options={"include_obfuscation": False}))
        assert status == 200 and headers[IGNORED_HEADER] == "stream_options.include_obfuscation"

    run(chat_tiny, test)


def test_bad_fields_are_a_4xx_naming_this_apis_path(chat_tiny: llm.ModelRuntime) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"tools": [{**TOOL, "parameters": {"type": "strin"}}]}, "tools.0.parameters", "not a JSON type"),
        ({"tools": [{**TOOL, "name": "a b"}]}, "tools.0.name", "pattern"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "only function tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools.0.name",  # chat's nesting
         "Field required (and 1 more)"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name",
         "not one of the tools"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice.type", "only function tools"),
        ({"input": [{"role": "user", "content": "w5"}, {"type": "reasoning", "id": "rs_1", "summary": []}]},
         "input.1.type", "unknown item type 'reasoning'"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content.0", "input_image"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id", "Field required"),
        ({"input": 5}, "input", "valid"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"max_output_tokens": 5000}, "max_output_tokens", "limits.max_completion_tokens"),
        ({"truncation": "auto"}, "truncation", "not built"),
        ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"background": True}, "background", "not served"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort", "not served"),
        ({"text": {"verbosity": "low"}}, "text.verbosity", "verbosity"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": "no"}}}, "text.format.schema",
         "should be an object"),
        ({"include": ["message.output_text.logprobs"]}, "include", "logprobs"),
        ({"seed": 3}, "seed", "not a parameter"),
        ({"previous_response_id": "a b"}, "previous_response_id", "pattern"),
        ({"model": "gpt-5"}, "model", "not served here"),
    ]

    async def test(node: Node) -> None:
        for fields, param, why in cases:
            status, body, _ = await node.post("/responses", _create(**fields))
            error = body.get("error", {})
            assert status in (400, 404) and error.get("param") == param, (param, body)
            assert why in error["message"], (param, body)
        # A body the openai client refuses to send is still ours to refuse: the typed client's error.
        api = _client(node)
        with pytest.raises(openai.BadRequestError, match=r"tools\.0\.type"):
            await api.responses.create(model=MODEL, input="w5", tools=[{"type": "web_search"}])
        await api.close()

    run(chat_tiny, test, max_completion_tokens=300)


def test_chat_fields_are_spelled_as_this_api_spells_them() -> None:
    for chat, ours in (("tools.3.function.parameters", "tools.3.parameters"),
                       ("response_format", "text.format"), ("response_format.type", "text.format.type"),
                       ("response_format.json_schema.schema", "text.format.schema"),
                       ("response_format.json_schema", "text.format"), ("tool_choice.function.name",
                                                                        "tool_choice.name"),
                       ("max_completion_tokens", "max_output_tokens"), ("messages.4.content", "input"),
                       ("messages", "input"), ("tool_choice", "tool_choice"), ("temperature", "temperature")):
        assert client(chat) == ours, chat


def test_the_request_translates_into_the_chat_request() -> None:
    """text.format is response_format, a flat tool a nested one, a named tool_choice chat's shape; the
    instructions open the messages, the previous conversation follows, then the input."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    developer = {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "w8"}]}
    parsed = ResponsesRequest.model_validate_json(json.dumps(_create(
        instructions=SYSTEM, tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False, cache_salt="s", input=[developer],
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})),
        strict=True)
    prior = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6"}]
    body = parsed.chat_body(prior, parsed.input_messages())
    assert body == {
        "model": MODEL, "temperature": 0, "top_p": 1.0, "max_completion_tokens": 3, "cache_salt": "s",
        "parallel_tool_calls": False,
        "messages": [{"role": "system", "content": SYSTEM}, *prior, {"role": "system", "content": "w8"}],
        "tools": [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema,
                                                                   "strict": True}}}
    for kind in ("json_object", "text"):
        parsed = ResponsesRequest.model_validate({**_create(), "text": {"format": {"type": kind}}})
        assert parsed.chat_body([], parsed.input_messages())["response_format"] == {"type": kind}
    for choice in ("auto", "none", "required"):
        parsed = ResponsesRequest.model_validate({**_create(), "tool_choice": choice})
        assert parsed.chat_body([], parsed.input_messages())["tool_choice"] == choice
    echoed = Response.model_validate({"id": "resp_1", "object": "response", "created_at": 0, "output": [],
                                      **ResponsesRequest.model_validate_json(json.dumps(_create(
                                          tools=[TOOL], text={"format": {"type": "json_schema", "name": "c",
                                                                         "schema": schema}})),
                                          strict=True).echoed()})
    assert echoed.text is not None and echoed.text.format is not None
    assert echoed.text.format.type == "json_schema" and echoed.text.format.schema_ == schema


def test_the_response_store_is_bounded_by_count_and_bytes() -> None:
    turn = [{"role": "user", "content": "w5" * 10}]
    size = len(json.dumps(turn, separators=(",", ":")))
    store = ResponseStore(max_entries=3, max_bytes=size * 2)
    assert store.put("r1", "", turn) and store.put("r2", "", turn)
    assert store.get("r1", "") == turn  # r1 is now the most recent
    assert store.put("r3", "", turn)  # over the bytes: the least recent (r2) goes
    assert store.get("r2", "") is None and store.get("r1", "") == turn and store.nbytes == size * 2
    assert store.get("r3", "salt") is None  # another cache salt finds nothing
    assert not store.put("big", "", turn * 3) and store.get("big", "") is None
    counted = ResponseStore(max_entries=2, max_bytes=1 << 20)
    for rid in ("a", "b", "c"):
        counted.put(rid, "", turn)
    assert len(counted) == 2 and counted.get("a", "") is None


def test_the_agents_sdk_default_model_class_runs_a_tool_turn(chat_tiny: llm.ModelRuntime,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The OpenAI Agents SDK's ``OpenAIResponsesModel`` pointed at the node with default settings: a tool
    call, the tool's output sent back, the final answer; streamed and not. The SDK sends the whole
    conversation each turn: the second turn is served from the first's cache."""
    agents.set_tracing_disabled(True)
    prompts: list[list[int]] = []
    _scripted(monkeypatch, [CALL, "w11 w12", CALL, "w13"], prompts)
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return "sunny"

    async def test(node: Node) -> None:
        api = _client(node)
        agent = agents.Agent(name="weather", instructions=SYSTEM, tools=[get_weather],
                             model=agents.OpenAIResponsesModel(MODEL, api))
        result = await agents.Runner.run(agent, "w5 w6 w7")
        assert result.final_output == "w11 w12" and asked == ["Paris"]
        _, second = result.raw_responses
        assert second.usage.input_tokens_details.cached_tokens >= len(prompts[0]) > 0
        streamed = agents.Runner.run_streamed(agent, "w5 w6 w7")
        kinds = [event.type async for event in streamed.stream_events()]
        assert streamed.final_output == "w13" and asked == ["Paris", "Paris"]
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
        # The second turn's prompt: the call and the tool's output as the chat endpoint renders them.
        function = {"name": "get_weather", "description": "The weather in a city.",
                    "parameters": get_weather.params_json_schema, "strict": True}
        tool = {"type": "function", "function": function}
        call = {"id": "c", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        turn = [{"role": "system", "content": SYSTEM}, *HELLO,
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c"}]
        assert prompts[1] == node.face.chat_ids(turn, [tool])
        await api.close()

    run(chat_tiny, test)


def test_a_response_handed_off_by_its_id_continues_on_the_receiver_from_the_cache(
        chat_tiny: llm.ModelRuntime) -> None:
    """The sender serves a Responses turn; ``POST /handoffs`` names it by its ``resp_`` id; the receiver
    (which never saw that id) continues it through ``/v1/responses`` from the handed-off cache when the
    client sends the whole input, as the Agents SDK does by default."""
    fec.warm_up()
    identity = runtime_identity(chat_tiny)
    salt = "team-r"

    async def main() -> None:
        rx = ReceiverDaemon(identity, PSK, runtime=chat_tiny, limits=LimitsConfig(max_completion_tokens=8))
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, runtime=chat_tiny, rate_mbps=400, owd_ms=1, rate_control="fixed",
                          limits=SenderLimitsConfig(max_completion_tokens=8))
        servers = [ControlServer(receiver_routes(rx)), ControlServer(sender_routes(tx))]
        for server in servers:
            await server.start(None, ("127.0.0.1", 0), TOKEN)
        rx_url, tx_url = (f"http://127.0.0.1:{s.tcp_port}" for s in servers)
        try:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:

                async def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
                    async with http.post(url, data=json.dumps(body)) as response:
                        return response.status, await response.json()

                request = _create(model=identity.model_id, instructions=SYSTEM, tools=[TOOL], cache_salt=salt)
                status, first = await post(tx_url + "/v1/responses", request)
                assert status == 200, first
                while tx.worker.pending:  # the conversation's cache upkeep (settle)
                    await asyncio.sleep(0.01)
                status, created = await post(tx_url + "/handoffs", {
                    "receiver": "{}:{}".format(*rx.address), "rho": 4.0, "precision": "native",
                    "handoff_mode": "handoff", "conversation": {"id": first["id"]}})
                assert status == 202, created
                async with http.get(f"{tx_url}/handoffs/{created['id']}?wait=60") as response:
                    report = await response.json()
                assert report["outcome"] == "done" and report["conversation"]["prefilled_tokens"] == 0, report
                # The whole input, as the SDK sends it: the first input, the output items, the new turn.
                items = [{"role": "user", "content": "w5 w6 w7"}, *first["output"],
                         {"role": "user", "content": "w8"}]
                status, follow = await post(rx_url + "/v1/responses", {**request, "input": items})
                assert status == 200, follow
                assert follow["usage"]["input_tokens_details"]["cached_tokens"] == report["n_tokens"], follow
                assert follow["pfec"]["prefix"]["handoff_id"] == report["session_id"], follow
                # The receiver never saw the id: previous_response_id there is a 404 naming it.
                status, bad = await post(rx_url + "/v1/responses", {
                    **request, "input": "w8", "previous_response_id": first["id"]})
                assert status == 404 and bad["error"]["param"] == "previous_response_id", bad
        finally:
            for server in servers:
                await server.close()
            await tx.close()
            await rx.close()

    asyncio.run(main())


def test_a_failure_mid_stream_ends_it_with_a_failed_response(chat_tiny: llm.ModelRuntime,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(runtime: llm.ModelRuntime, ids: list[int], prefix: Any, n_cached: int, sampling: Any,
                on_text: Any = None) -> serving.Completion:
        on_text("w5 ")
        time.sleep(0.3)  # the stream is open by then (the worker thread)
        raise RuntimeError("the model broke")

    monkeypatch.setattr(serving, "complete", failing)

    async def test(node: Node) -> None:
        status, body, _ = await node.post("/responses", _create(stream=True))
        events = [EVENTS.validate_python(e) for e in body["events"]]
        assert status == 200 and events[-1].type == "response.failed", body
        assert events[-1].response.status == "failed" and events[-1].response.error is not None
        assert events[-1].response.error.code == "server_error"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        # Not streamed: OpenAI's error body, a 500 (the control API's middleware), never a hung request.
        status, body, _ = await node.post("/responses", _create())
        assert status == 500 and "error" in body, body

    run(chat_tiny, test)


# --------------------------------------------------------------------------- structured output, default model

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
TIME = {"type": "function", "name": "get_time", "description": "The local time in a timezone.",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                       "required": ["timezone"]}, "strict": True}


@pytest.mark.slow  # the embedded default model (a word-level tiny model cannot write JSON): ~1 minute
def test_structured_output_and_forced_calls_come_from_the_chat_endpoints_constraints() -> None:
    """text.format json_schema/json_object and tool_choice required/named through /v1/responses are the chat
    endpoint's constrained decoding; a schema the grammar library cannot compile is a 400 naming
    text.format.schema; the Agents SDK's output_type comes back typed."""
    runtime = llm.load_model("default", device="cpu")
    agents.set_tracing_disabled(True)

    class Person(pydantic.BaseModel):
        name: str
        age: int

    async def test(node: Node) -> None:
        api = openai.AsyncOpenAI(base_url=node.url, api_key=TOKEN, max_retries=0, timeout=600)
        ask = "Ada Lovelace was 36 years old. Give the person's name and age as JSON."
        done = await api.responses.create(model=runtime.model_id, input=ask, temperature=0, text={
            "format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
        value = json.loads(done.output_text)
        assert done.status == "completed" and set(value) == {"name", "age"}, done
        assert isinstance(value["name"], str) and isinstance(value["age"], int)
        assert done.text is not None and done.text.format is not None
        assert done.text.format.type == "json_schema"
        streamed = [e async for e in await api.responses.create(
            model=runtime.model_id, input="Reply with a JSON object whose key 'answer' is 2 + 2.",
            temperature=0, stream=True, text={"format": {"type": "json_object"}})]
        assert streamed[-1].type == "response.completed"
        assert isinstance(json.loads(streamed[-1].response.output_text), dict)
        # Forced calls: named, and required.
        for choice, names in (({"type": "function", "name": "get_time"}, {"get_time"}),
                              ("required", {"get_weather", "get_time"})):
            forced = await api.responses.create(  # type: ignore[call-overload]
                model=runtime.model_id, input="Hello, who are you?", tools=[TOOL, TIME], tool_choice=choice,
                temperature=0)
            calls = [item for item in forced.output if item.type == "function_call"]
            assert calls and all(c.name in names for c in calls), forced.output
            assert all(isinstance(json.loads(c.arguments), dict) for c in calls)
        # A schema the library cannot compile: this API's field, streamed or not (compiled before the stream).
        bad = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
        for stream in (False, True):
            status, body, _ = await node.post("/responses", {
                "model": runtime.model_id, "input": "hi", "stream": stream,
                "text": {"format": {"type": "json_schema", "name": "x", "schema": bad}}})
            assert status == 400 and body["error"]["param"] == "text.format.schema", body
            assert body["error"]["message"].startswith("text.format.schema: "), body
        # The Agents SDK's output_type, default settings: a strict json_schema, the answer typed.
        agent = agents.Agent(name="extract", instructions="Extract the person.", output_type=Person,
                             model=agents.OpenAIResponsesModel(runtime.model_id, api))
        result = await agents.Runner.run(agent, "Grace Hopper was 85 years old.")
        assert isinstance(result.final_output, Person), result.final_output
        await api.close()

    run(runtime, test, max_completion_tokens=64)
