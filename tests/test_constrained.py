"""Constrained decoding on the OpenAI face (issue 38, items 1 and 2), on the embedded default model through
the real ``openai`` client: ``response_format`` json_object and json_schema replies parse and validate,
``tool_choice`` required and a named function always give a valid call (streamed too), a schema the grammar
library cannot compile and an unknown named tool are 400s naming the field, a schema compiles once (the
cache). And the model room's parts on their own: the mask's unpacking, the grammar's Lark, the LRU bound.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import torch
from test_openai_fields import TOKEN, Node, run

from pfec.common.model import constrained, llm
from pfec.common.node.openai.tools import CLOSE, OPEN, closed

pytestmark = pytest.mark.slow  # the default model: ~2 minutes on 2 cores

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                   "required": ["timezone"]}}}
NO_ARGS = {"type": "function", "function": {"name": "list_cities", "description": "The cities known."}}
TOOLS = [WEATHER, TIME, NO_ARGS]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
QUESTIONS = ["What's the weather like in Paris?", "What time is it in Tokyo?", "Hello, who are you?"]


@pytest.fixture(scope="module")
def runtime() -> llm.ModelRuntime:
    return llm.load_model("default", device="cpu")


def _client(node: Node) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=node.url, api_key=TOKEN, max_retries=0, timeout=600)


def _valid_call(call: Any, tools: list[dict[str, Any]]) -> bool:
    """A call to a declared tool whose arguments hold the tool's required properties and nothing else."""
    declared = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    schema = declared.get(call.function.name)
    if schema is None:
        return False
    arguments = json.loads(call.function.arguments)
    props = schema.get("properties", {})
    return (isinstance(arguments, dict) and set(schema.get("required", ())) <= set(arguments) <= set(props)
            and all(isinstance(v, str) for v in arguments.values()))


def test_json_object_and_json_schema_replies_parse_and_validate(runtime: llm.ModelRuntime) -> None:
    async def test(node: Node) -> None:
        client = _client(node)
        schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                "strict": True}}
        for text in ("Ada Lovelace was 36 years old.", "Bob is a 7-year-old boy.", "Tell me a joke."):
            done = await client.chat.completions.create(
                model=runtime.model_id,
                messages=[{"role": "user", "content": f"{text} Give the person's name and age as JSON."}],
                max_tokens=48, temperature=0, response_format=schema_format)  # type: ignore[arg-type]
            choice = done.choices[0]
            value = json.loads(choice.message.content or "")
            assert choice.finish_reason == "stop" and set(value) == {"name", "age"}, value
            assert isinstance(value["name"], str) and isinstance(value["age"], int)
            assert 0 <= value["age"] <= 150
        # json_object: any JSON object.
        ask = [{"role": "user", "content": "Reply with a JSON object whose key 'answer' is 2 + 2."}]
        done = await client.chat.completions.create(model=runtime.model_id, messages=ask,  # type: ignore[arg-type]
                                                    max_tokens=32, temperature=0,
                                                    response_format={"type": "json_object"})
        assert done.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(done.choices[0].message.content or ""), dict)
        # Streamed: the same JSON in content deltas, sampled too.
        chunks = [c async for c in await client.chat.completions.create(
            model=runtime.model_id, messages=[{"role": "user", "content": "Grace Hopper was 85."}],  # type: ignore[arg-type]
            max_tokens=48, temperature=0.8, seed=3, stream=True, response_format=schema_format)]  # type: ignore[arg-type]
        streamed = json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        assert set(streamed) == {"name", "age"} and chunks[-1].choices[0].finish_reason == "stop"
        await client.close()

    run(runtime, test, max_completion_tokens=64)


def test_required_and_named_tool_choice_always_give_a_valid_call(runtime: llm.ModelRuntime) -> None:
    async def test(node: Node) -> None:
        client = _client(node)
        for question in QUESTIONS:
            messages = [{"role": "user", "content": question}]
            done = await client.chat.completions.create(
                model=runtime.model_id, messages=messages, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
                max_tokens=64, temperature=0)
            choice = done.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
            assert all(_valid_call(c, TOOLS) for c in choice.message.tool_calls), choice.message.tool_calls
            assert OPEN not in (choice.message.content or "")
            # Named: one call, to that tool, whatever the question; parallel off: one call under required.
            for name in ("get_time", "list_cities"):
                named = await client.chat.completions.create(
                    model=runtime.model_id, messages=messages, tools=TOOLS, max_tokens=64, temperature=0,  # type: ignore[arg-type]
                    tool_choice={"type": "function", "function": {"name": name}})
                calls = named.choices[0].message.tool_calls or []
                assert [c.function.name for c in calls] == [name] and _valid_call(calls[0], TOOLS), named  # type: ignore[union-attr]
            single = await client.chat.completions.create(
                model=runtime.model_id, messages=messages, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
                parallel_tool_calls=False, max_tokens=64, temperature=0)
            assert len(single.choices[0].message.tool_calls or []) == 1
        # Streamed, through the SDK's own accumulation of OpenAI's deltas.
        async with client.chat.completions.stream(
                model=runtime.model_id, messages=[{"role": "user", "content": QUESTIONS[0]}],  # type: ignore[arg-type]
                tools=TOOLS, tool_choice="required", max_tokens=64, temperature=0.7, seed=5) as stream:  # type: ignore[arg-type]
            final = await stream.get_final_completion()
        choice = final.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        assert all(_valid_call(c, TOOLS) for c in choice.message.tool_calls)
        # A JSON format with tools under auto: the reply is the JSON or calls, never free text.
        done = await client.chat.completions.create(
            model=runtime.model_id, messages=[{"role": "user", "content": "Ada is 36. Who is she?"}],  # type: ignore[arg-type]
            tools=TOOLS, max_tokens=64, temperature=0,  # type: ignore[arg-type]
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
        message = done.choices[0].message
        assert message.tool_calls or set(json.loads(message.content or "")) == {"name", "age"}, message
        await client.close()

    run(runtime, test, max_completion_tokens=64)


def test_bad_schemas_and_unknown_tools_are_400s_naming_the_field(runtime: llm.ModelRuntime) -> None:
    bad_ref = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad_ref}}},
         "response_format.json_schema.schema", "cannot compile"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "pattern": "(("}}}}, "response_format.json_schema.schema", "regex"),
        ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"d": {"type": "string", "format": "no-such-format"}}}}}],
          "tool_choice": "required"}, "tools.1.function.parameters", "format"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm_rf"}}},
         "tool_choice.function.name", "not one of the tools"),
    ]

    async def test(node: Node) -> None:
        for fields, param, why in cases:
            for stream in (False, True):  # the grammar compiles before the stream starts: a plain 400
                body = {"model": runtime.model_id, "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 4, "stream": stream, **fields}
                status, answer, _ = await node.post("/chat/completions", body)
                error = answer.get("error", {})
                assert status == 400 and error.get("param") == param, (param, answer)
                assert why in error["message"], (param, answer)
        # The same schema compiles once: the second request is a cache hit.
        before = constrained.cache_stats(runtime)
        body = {"model": runtime.model_id, "messages": [{"role": "user", "content": "Ada is 36."}],
                "max_tokens": 24, "temperature": 0, "response_format": {
                    "type": "json_schema", "json_schema": {"name": "p", "schema": {**PERSON, "title": "P"}}}}
        replies = [await node.post("/chat/completions", body) for _ in range(2)]
        after = constrained.cache_stats(runtime)
        assert all(status == 200 for status, _, _ in replies)
        assert after["misses"] == before["misses"] + 1, (before, after)
        assert after["hits"] == before["hits"] + 1, (before, after)
        assert replies[0][1]["choices"][0]["message"] == replies[1][1]["choices"][0]["message"]

    run(runtime, test, max_completion_tokens=64)


def test_the_mask_blocks_exactly_the_tokens_the_bitmask_leaves_out() -> None:
    n_vocab = 77  # not a multiple of 32: the last word is partial
    mask = constrained.TokenMask(n_vocab)
    allowed = torch.zeros(mask.bitmask.shape[1] * 32, dtype=torch.bool)
    allowed[[0, 5, 31, 32, 40, 63, 64, 76]] = True
    words = allowed.view(-1, 32).to(torch.int64)
    packed = (words << torch.arange(32)).sum(dim=1)
    mask.bitmask[0] = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    logits = torch.randn(1, 1, n_vocab)
    before = logits.clone()
    mask.apply(logits[0, -1])  # in place, on a view of the model's output
    kept = allowed[:n_vocab]
    assert torch.equal(logits[0, -1][kept], before[0, -1][kept])
    assert bool(torch.isneginf(logits[0, -1][~kept]).all())


def test_grammar_lark_cache_bound_and_closed_schemas(runtime: llm.ModelRuntime,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    call = json.dumps({"type": "object", "properties": {"name": {"const": "f"}}})
    lark = constrained.Grammar(content='{"type": "object"}', call=call, open=OPEN + "\n", close="\n" + CLOSE,
                               parallel=True).lark()
    assert lark.splitlines()[0] == "start: content | calls" and 'calls: call ("\\n" call)* "\\n"?' in lark
    assert '"x-guidance": {"whitespace_flexible": false' in lark
    with pytest.raises(constrained.GrammarError):
        constrained.Grammar().lark()
    monkeypatch.setattr(constrained, "CACHE_ENTRIES", 2)
    grammars = [constrained.Grammar(content=json.dumps({"type": "object", "title": f"t{i}"}))
                for i in range(3)]
    for grammar in grammars:
        constrained.compile_grammar(runtime, grammar)
    state = constrained._state(runtime)
    assert list(state.cache) == grammars[1:]  # the least recently used went first
    # A schema's objects are closed where they say nothing of other properties; allOf members as written.
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {}}},
                                               "p": {"additionalProperties": True, "properties": {}}},
              "allOf": [{"properties": {"b": {}}}], "$defs": {"d": {"properties": {"c": {}}}}}
    out = closed(schema)
    assert out["additionalProperties"] is False and "additionalProperties" not in out["properties"]
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert out["properties"]["p"]["additionalProperties"] is True
    assert out["allOf"] == schema["allOf"] and out["$defs"]["d"]["additionalProperties"] is False
