"""Handoffs from framework state (issue 38, item 5): a conversation handed off by its ``messages`` in the
chat-completions shapes or as the Responses API items the OpenAI Agents SDK keeps, converted in one place
(``common/node/openai/responses_items.py``) to the chat messages the chat endpoint rendered; the tools it
was served with; the completion id the SDK keeps in ``provider_data``; errors naming the client's field
path. The end-to-end test runs the real sender and receiver apps on the tiny model over real UDP.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import aiohttp
import pytest
from pydantic import ValidationError
from test_openai_fields import TOKEN
from test_openai_tools import TOOLS_TEMPLATE, WEATHER

from pfec.common.codec import fec
from pfec.common.model import llm
from pfec.common.model.runtime import runtime_identity
from pfec.common.node.config import LimitsConfig, SenderLimitsConfig
from pfec.common.node.control import ControlServer, validation_error_body
from pfec.common.node.openai.http import OpenAIFace
from pfec.common.node.openai.models import ChatCompletionRequest
from pfec.common.node.worker import ModelWorker
from pfec.receiver.control import receiver_routes
from pfec.receiver.daemon import ReceiverDaemon
from pfec.receiver.metrics import ReceiverMetrics
from pfec.sender.control import ConversationRef, HandoffRequest, sender_routes
from pfec.sender.daemon import SenderDaemon

PSK = bytes(range(50, 82))
FAKE = "__fake_id__"  # the Agents SDK's id on every item a chat-completions model returned
CALL_ARGS = '{"city": "w9"}'


def _convert(items: list[Any], **extra: Any) -> list[dict[str, Any]]:
    """Items through the control API's own model (strict, from JSON), then the conversion."""
    ref = ConversationRef.model_validate_json(json.dumps({"messages": items, **extra}), strict=True)
    return ref.rendered()


def _error(body: dict[str, Any]) -> dict[str, Any]:
    raw = json.dumps({"receiver": "127.0.0.1:9", **body}).encode()
    with pytest.raises(ValidationError) as caught:
        HandoffRequest.model_validate_json(raw, strict=True)
    return validation_error_body(caught.value, raw)


def _out_text(text: str) -> dict[str, Any]:
    """An ``output_text`` part as the SDK dumps one."""
    return {"annotations": [{"type": "url_citation", "url": "https://e.example"}], "text": text,
            "type": "output_text", "logprobs": [{"token": "w5", "logprob": -0.1, "bytes": [119],
                                                 "top_logprobs": []}]}


def _out_message(*texts: str, response_id: str = "chatcmpl-1") -> dict[str, Any]:
    """An assistant's output message as the SDK keeps it after a chat-completions call."""
    return {"id": FAKE, "content": [_out_text(t) for t in texts], "role": "assistant", "status": "completed",
            "type": "message", "provider_data": {"model": "tiny-llama", "response_id": response_id}}


def _call(call_id: str = "call_1", arguments: str = CALL_ARGS) -> dict[str, Any]:
    return {"arguments": arguments, "call_id": call_id, "name": "get_weather", "type": "function_call",
            "id": FAKE, "status": "completed", "provider_data": {"model": "tiny-llama",
                                                                 "response_id": "chatcmpl-1"}}


def _output(output: Any, call_id: str = "call_1") -> dict[str, Any]:
    return {"call_id": call_id, "output": output, "type": "function_call_output"}


# --------------------------------------------------------------------------- the conversion, shape by shape


def test_chat_messages_convert_as_the_chat_endpoint_keeps_them() -> None:
    chat = [{"role": "developer", "content": "w3"},
            {"role": "user", "content": [{"type": "text", "text": "w5 "}, {"type": "text", "text": "w6"}],
             "name": "ada"},  # a chat message's own field: the chat model takes it, not an item's
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": CALL_ARGS}}]},
            {"role": "tool", "content": "w7", "tool_call_id": "call_1"},
            {"role": "assistant", "content": "w8", "refusal": None, "function_call": None, "audio": None}]
    expected = ChatCompletionRequest.model_validate_json(
        json.dumps({"model": "m", "messages": chat}), strict=True).rendered()
    assert _convert(chat) == expected
    assert expected[0] == {"role": "system", "content": "w3"} and expected[1]["content"] == "w5 w6"


def test_an_easy_input_message_is_a_chat_message() -> None:
    assert _convert([{"role": "user", "content": "w5"}]) == [{"role": "user", "content": "w5"}]
    # Parts of the Responses API's kinds, no type: an easy input message all the same.
    parts = [{"type": "input_text", "text": "w5 "}, {"type": "input_text", "text": "w6"}]
    assert _convert([{"role": "user", "content": parts}]) == [{"role": "user", "content": "w5 w6"}]
    # An assistant's without an id is an easy message too: its own turn, calls after it open another.
    easy = [{"role": "assistant", "content": "w8"}, _call()]
    assert [m["role"] for m in _convert(easy)] == ["assistant", "assistant"]


def test_a_message_item_joins_input_parts_as_chat_parts() -> None:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "w5 "},
                                                            {"type": "input_text", "text": "w6"}]}
    assert _convert([item]) == [{"role": "user", "content": "w5 w6"}]
    system = {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "w3"}]}
    assert _convert([system]) == [{"role": "system", "content": "w3"}]


def test_an_output_message_joins_its_text_with_newlines_and_ignores_annotations_and_logprobs() -> None:
    assert _convert([_out_message("w5", "w6")]) == [{"role": "assistant", "content": "w5\nw6"}]
    refused = {**_out_message(), "content": [{"type": "refusal", "refusal": "w9"}]}
    assert _convert([refused]) == [{"role": "assistant", "content": "w9"}]


def test_a_function_call_attaches_to_the_output_message_before_it() -> None:
    got = _convert([{"role": "user", "content": "w5"}, _out_message("w6"), _call(), _call("call_2")])
    assert got[1]["content"] == "w6" and [c["id"] for c in got[1]["tool_calls"]] == ["call_1", "call_2"]
    assert got[1]["tool_calls"][0] == {"id": "call_1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": CALL_ARGS}}
    # Alone, a call opens an assistant message of null content; empty arguments are an empty object.
    alone = _convert([{"role": "user", "content": "w5"}, _call(arguments="")])
    assert alone[1]["content"] == "" and alone[1]["tool_calls"][0]["function"]["arguments"] == "{}"
    # A streamed turn lists its calls before its text: one assistant message all the same.
    streamed = _convert([{"role": "user", "content": "w5"}, _call(), _out_message("w6")])
    assert len(streamed) == 2 and streamed[1]["content"] == "w6" and streamed[1]["tool_calls"]


def test_a_function_call_output_is_a_tool_message() -> None:
    items = [_call(), _output("w7"), _call("call_2"),
             _output([{"type": "input_text", "text": "w7 "}, {"type": "input_text", "text": "w8"}], "call_2")]
    got = _convert(items)
    assert got[1] == {"role": "tool", "content": "w7", "tool_call_id": "call_1"}
    assert got[3] == {"role": "tool", "content": "w7 w8", "tool_call_id": "call_2"}


def test_an_item_of_another_type_is_an_error_naming_its_type() -> None:
    items = [{"role": "user", "content": "w5"}, _out_message("w6"), _call(),
             {"type": "reasoning", "id": "rs_1", "summary": []}]
    body = _error({"conversation": {"messages": items}})
    assert [f["field"] for f in body["fields"]] == ["conversation.messages.3.type"], body
    assert "unknown item type 'reasoning'" in body["error"]
    # A part of another kind (an image), a call's bad name: the client's paths, no union tags.
    image = {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}
    assert [f["field"] for f in _error({"conversation": {"messages": [image]}})["fields"]] == [
        "conversation.messages.0.content.0"]
    bad_call = {**_call(), "name": "get weather"}
    assert [f["field"] for f in _error({"conversation": {"messages": [bad_call]}})["fields"]] == [
        "conversation.messages.0.name"]
    # A chat message's null content (only an assistant's may be null): its field, not a union member's.
    body = _error({"conversation": {"messages": [{"role": "user", "content": None}]}})
    assert [f["field"] for f in body["fields"]] == ["conversation.messages.0.content"], body


def test_conversation_id_is_bounded_and_typed_and_keeps_no_tools_of_its_own() -> None:
    assert ConversationRef.model_validate({"id": "chatcmpl-000001abcdef0123"}).id
    body = _error({"conversation": {"id": "chatcmpl x"}})
    assert [f["field"] for f in body["fields"]] == ["conversation.id"]
    body = _error({"conversation": {"id": "c" * 129}})
    assert [f["field"] for f in body["fields"]] == ["conversation.id"]
    body = _error({"conversation": {"id": "chatcmpl-1", "tools": [WEATHER]}})
    assert "only with messages" in body["error"], body


# --------------------------------------------------------------------------- the prompt renders the same


# A conversation the Agents SDK ran through OpenAIChatCompletionsModel: what it keeps (to_input_list())...
SDK_ITEMS = [{"role": "user", "content": "w5 w6"}, _out_message("w10", "w11"), _call(), _output("w7"),
             _out_message("w12"), {"role": "user", "content": "w13"}]
# ... and the chat request its converter (0.24, Converter.items_to_messages) sent for it.
SDK_CHAT = [{"role": "system", "content": "w3"}, {"role": "user", "content": "w5 w6"},
            {"role": "assistant", "content": "w10\nw11", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": CALL_ARGS}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "w7"},
            {"role": "assistant", "content": "w12"}, {"role": "user", "content": "w13"}]
SYSTEM = {"role": "system", "content": "w3"}  # the agent's instructions: a chat message in the handoff


@pytest.fixture(scope="module")
def tools_tiny(tiny: llm.ModelRuntime) -> llm.ModelRuntime:
    assert tiny.tokenizer is not None
    tiny.tokenizer.chat_template = TOOLS_TEMPLATE  # renders the tools and the calls' arguments
    return tiny


def test_the_rendered_ids_equal_the_chat_endpoints(tools_tiny: llm.ModelRuntime) -> None:
    face = OpenAIFace(tools_tiny, ModelWorker("test-render"), ReceiverMetrics(process_metrics=False),
                      LimitsConfig())
    try:
        served = ChatCompletionRequest.model_validate_json(json.dumps(
            {"model": "m", "messages": SDK_CHAT, "tools": [WEATHER]}), strict=True)
        chat_ids = face.chat_ids(served.rendered(), served.offered(), add_generation_prompt=False)
        ref = ConversationRef.model_validate_json(json.dumps(
            {"messages": [SYSTEM, *SDK_ITEMS], "tools": [WEATHER]}), strict=True)
        assert face.chat_ids(ref.rendered(), ref.offered(), add_generation_prompt=False) == chat_ids
        # The tools open the prompt: without them it is another prompt (its cache would not be found).
        untooled = ref.model_copy(update={"tools": None})
        assert face.chat_ids(untooled.rendered(), untooled.offered(), add_generation_prompt=False) != chat_ids
        # tool_choice none: the tools were not offered, as on the chat endpoint.
        none = ConversationRef.model_validate(
            {"messages": [SYSTEM], "tools": [WEATHER], "tool_choice": "none"})
        assert none.offered() is None
    finally:
        face.worker.shutdown()


# --------------------------------------------------------------------------- end to end


def test_a_handoff_of_the_sdks_items_finds_the_cache_the_chat_endpoint_stored(
        tools_tiny: llm.ModelRuntime) -> None:
    """The sender serves a chat request as the Agents SDK sends it; the conversation is handed off by the
    SDK's items (and by the completion id its provider_data keeps); the receiver continues it from the
    handed-off cache. An id the node never served is a 404 naming conversation.id."""
    fec.warm_up()
    identity = runtime_identity(tools_tiny)
    salt = "team-w"

    async def main() -> None:
        rx = ReceiverDaemon(identity, PSK, runtime=tools_tiny, limits=LimitsConfig(max_completion_tokens=8))
        await rx.start("127.0.0.1", 0)
        tx = SenderDaemon(identity, PSK, runtime=tools_tiny, rate_mbps=400, owd_ms=1, rate_control="fixed",
                          limits=SenderLimitsConfig(max_completion_tokens=8))
        servers = [ControlServer(receiver_routes(rx)), ControlServer(sender_routes(tx))]
        for server in servers:
            await server.start(None, ("127.0.0.1", 0), TOKEN)
        rx_url, tx_url = (f"http://127.0.0.1:{s.tcp_port}" for s in servers)
        target = "{}:{}".format(*rx.address)
        try:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:

                async def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
                    async with http.post(url, data=json.dumps(body)) as response:
                        return response.status, await response.json()

                request = {"model": identity.model_id, "messages": SDK_CHAT[:-1], "tools": [WEATHER],
                           "max_tokens": 3, "temperature": 0, "cache_salt": salt}
                status, reply = await post(tx_url + "/v1/chat/completions", request)
                assert status == 200, reply
                text = reply["choices"][0]["message"]["content"] or ""
                while tx.worker.pending:  # the conversation's cache upkeep (settle)
                    await asyncio.sleep(0.01)
                # What the SDK keeps after that turn: its items, the reply an output message.
                items = [SYSTEM, *SDK_ITEMS[:-1], _out_message(text, response_id=reply["id"])]
                base = {"receiver": target, "rho": 4.0, "precision": "native", "handoff_mode": "handoff"}
                status, created = await post(tx_url + "/handoffs", {**base, "conversation": {
                    "messages": items, "cache_salt": salt, "tools": [WEATHER]}})
                assert status == 202, created
                async with http.get(f"{tx_url}/handoffs/{created['id']}?wait=60") as response:
                    report = await response.json()
                assert report["outcome"] == "done", report
                # The sender's store held the whole conversation: nothing was prefilled for the handoff.
                handed = report["conversation"]
                assert handed["prefilled_tokens"] == 0 and handed["n_tokens"] == report["n_tokens"], handed
                follow = [*SDK_CHAT[:-1], {"role": "assistant", "content": text}, SDK_CHAT[-1]]
                status, next_turn = await post(rx_url + "/v1/chat/completions", {
                    **request, "messages": follow})
                assert status == 200, next_turn
                assert next_turn["usage"]["prompt_tokens_details"]["cached_tokens"] == report["n_tokens"]
                assert next_turn["pfec"]["prefix"]["handoff_id"] == report["session_id"]
                # The SDK's provider_data.response_id names the same conversation.
                status, by_id = await post(tx_url + "/handoffs", {**base, "conversation": {
                    "id": items[-1]["provider_data"]["response_id"]}})
                assert status == 202, by_id
                async with http.get(f"{tx_url}/handoffs/{by_id['id']}?wait=60") as response:
                    assert (await response.json())["conversation"]["prefilled_tokens"] == 0
                # An id the node never served, the SDK's placeholder: a 404 naming conversation.id.
                for unknown in ("chatcmpl-never", FAKE, "resp_0123"):
                    status, bad = await post(tx_url + "/handoffs", {**base, "conversation": {"id": unknown}})
                    assert status == 404 and bad["fields"][0]["field"] == "conversation.id", bad
                status, bad = await post(tx_url + "/handoffs", {**base, "conversation": {"id": FAKE}})
                assert "provider_data.response_id" in bad["error"], bad
                # An item of another type: the client's path, never a 500; nothing was handed off for it.
                handoffs = len(tx.handoffs)
                odd = copy.deepcopy(items)
                odd[3] = {"type": "reasoning", "id": "rs_1", "summary": []}
                status, bad = await post(tx_url + "/handoffs", {**base, "conversation": {
                    "messages": odd, "cache_salt": salt}})
                assert status == 422 and bad["fields"][0]["field"] == "conversation.messages.3.type", bad
                assert len(tx.handoffs) == handoffs
        finally:
            for server in servers:
                await server.close()
            await tx.close()
            await rx.close()

    asyncio.run(main())
