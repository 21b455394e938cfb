"""Tool calls on the OpenAI face (issue 38, item 1; their constrained decoding: tests/test_constrained.py):
the tools' bounds and their schema's shape, the Hermes fallback for a template that ignores tools (the
default model's), the template's own rendering when it takes them, the Hermes parser streamed and not, a
forced reply's calls only, ``tool_choice`` and ``parallel_tool_calls``, tool messages. A random model
never writes a call, so the route is tested end to end with only the text of ``serving.complete``
scripted (its cache and counts stay real).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import openai
import pytest
from pydantic import ValidationError
from test_openai_fields import HELLO, MODEL, TEMPLATE, TOKEN, Node, run

from pfec.common.model import llm, serving
from pfec.common.node.config import LimitsConfig, SenderLimitsConfig
from pfec.common.node.openai import tools as openai_tools
from pfec.common.node.openai.tools import CLOSE, OPEN, HermesParser, ParsedCall, template_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}'
# SmolLM2-135M-Instruct's template (the default model's GGUF carries it): it never reads `tools`.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# A template that renders tools and calls itself, as Qwen2.5's does (arguments written with tojson).
TOOLS_TEMPLATE = (
    "{% if tools %}w9 {% for t in tools %}{{ t['function']['name'] }} {% endfor %}w2 {% endif %}"
    "{% for m in messages %}w3 {{ m['content'] }} {% for c in m.get('tool_calls', []) %}"
    "{{ c['function']['arguments'] | tojson }} {% endfor %}w2 {% endfor %}"
    "{% if add_generation_prompt %}w4 {% endif %}")


@pytest.fixture(scope="module")
def chat_tiny(tiny: llm.ModelRuntime) -> llm.ModelRuntime:
    assert tiny.tokenizer is not None
    tiny.tokenizer.chat_template = TEMPLATE
    return tiny


def _events(parser: HermesParser, pieces: list[str]) -> list[openai_tools.Event]:
    out = [e for piece in pieces for e in parser.feed(piece)]
    return out + parser.finish()


def _strip_ids(events: list[openai_tools.Event]) -> list[Any]:
    """Calls as (name, arguments), adjacent pieces of text joined (a stream cuts them anywhere)."""
    out: list[Any] = []
    for e in events:
        if isinstance(e, str) and out and isinstance(out[-1], str):
            out[-1] += e
        else:
            out.append(e if isinstance(e, str) else (e.name, json.loads(e.arguments)))
    return out


def test_hermes_parser_streamed_or_whole_gives_the_same_calls_and_text() -> None:
    names = frozenset({"get_weather", "add"})
    reply = f"Let me look.\n{CALL}\n{OPEN}{{\"name\": \"add\", \"arguments\": {{\"a\": 1}}}}{CLOSE}\n"
    whole = _events(HermesParser(names), [reply])
    assert _strip_ids(whole) == ["Let me look.", ("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
    for size in (1, 2, 5, 11):  # every cut, the tags' included
        pieces = [reply[i:i + size] for i in range(0, len(reply), size)]
        assert _strip_ids(_events(HermesParser(names), pieces)) == _strip_ids(whole), size
    ids = [e.id for e in whole if isinstance(e, ParsedCall)]
    assert all(i.startswith("call_") and len(i) == 29 for i in ids) and len(set(ids)) == 2
    # Text that may start a tag is held back, and released once it does not.
    parser = HermesParser(names)
    assert parser.feed("Hi <tool") == ["Hi"]  # its trailing space waits for what follows
    assert parser.feed("s are ") == [" <tools are"] and parser.finish() == [" "]
    # A call the reply ends without closing (max_tokens, a stop) is tried at the end.
    assert _strip_ids(_events(HermesParser(names), [CALL.removesuffix(CLOSE)])) == [
        ("get_weather", {"city": "Paris"})]


def test_a_forced_reply_is_calls_only() -> None:
    """Under tool_choice required or named the grammar allows calls only: what text the parser is left with
    (a last call max_tokens cut short) is dropped, streamed or not; unforced, it comes back as content."""
    cut = CALL + "\n" + CALL[:20]
    for forced, content in ((True, None), (False, "\n" + CALL[:20])):
        whole = openai_tools.Reply([WEATHER], "hermes", True, forced)
        whole.feed(cut)
        whole.finish()
        message = whole.message()
        assert message["content"] == content and len(message["tool_calls"]) == 1, message
        streamed = openai_tools.Reply([WEATHER], "hermes", True, forced)
        deltas = [d for i in range(0, len(cut), 4) for d in streamed.deltas(streamed.feed(cut[i:i + 4]))]
        deltas += streamed.deltas(streamed.finish())
        assert any("content" in d for d in deltas) is (not forced), deltas


def test_a_call_the_token_limit_cut_inside_its_closing_tag_is_still_a_call() -> None:
    """Seen with the Agents SDK at max_tokens 24: its transfer call ended in ``</tool`` and came back as
    text, so no handoff ran. Cut anywhere in the closing tag, or before it, the complete call parses."""
    call = f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n'
    for cut in range(len(CLOSE)):
        for pieces in ([call + CLOSE[:cut]], [call, CLOSE[:cut]]):
            events = _events(HermesParser(frozenset({"get_weather"})), pieces)
            assert [e.name for e in events if isinstance(e, ParsedCall)] == ["get_weather"], (cut, events)
    # What the tag's first characters end is still text when no call is open.
    assert _strip_ids(_events(HermesParser(frozenset({"get_weather"})), ["so </tool"])) == ["so </tool"]


def test_hermes_parser_leaves_what_is_not_a_declared_call_as_text() -> None:
    names = frozenset({"get_weather"})
    for block in (f'{OPEN}{{"name": "rm_rf", "arguments": {{}}}}{CLOSE}',  # not declared
                  f"{OPEN}{{not json{CLOSE}", f'{OPEN}["get_weather"]{CLOSE}',
                  f'{OPEN}{{"name": "get_weather", "arguments": "city"}}{CLOSE}',
                  f"{OPEN}{'[' * 5000}{CLOSE}"):  # nested past the JSON parser's recursion
        assert _strip_ids(_events(HermesParser(names), [f"So: {block}"])) == [f"So: {block}"], block
    assert _strip_ids(_events(HermesParser(names), ["plain text"])) == ["plain text"]
    # parallel_tool_calls false: the first call only.
    two = _events(HermesParser(names, parallel=False), [CALL + CALL])
    assert [e.name for e in two if isinstance(e, ParsedCall)] == ["get_weather"]


def test_the_default_models_template_gets_the_hermes_fallback(chat_tiny: llm.ModelRuntime) -> None:
    tok = chat_tiny.tokenizer
    assert tok is not None
    try:
        for template, takes in ((SMOLLM2_TEMPLATE, False), (TEMPLATE, False), (TOOLS_TEMPLATE, True)):
            tok.chat_template = template
            assert serving.takes_tools(chat_tiny) is takes, template
    finally:
        tok.chat_template = TEMPLATE
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
               {"role": "tool", "content": "20 C", "tool_call_id": "c2"}]
    shaped, offered = template_messages(history, [WEATHER], native=False)
    assert offered is None and [m["role"] for m in shaped] == ["system", "user", "assistant", "user"]
    assert shaped[0]["content"].startswith("Be brief.\n\n# Tools")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in shaped[0]["content"]
    assert shaped[2]["content"] == CALL
    assert shaped[3]["content"] == ("<tool_response>\nsunny\n</tool_response>\n"
                                    "<tool_response>\n20 C\n</tool_response>")
    # tool_choice none: no tools offered, the history still rendered as text.
    shaped, _ = template_messages(history[1:], None, native=False)
    assert shaped[0] == {"role": "user", "content": "Weather?"}
    # A template that takes tools gets them, and the arguments as the object its tojson writes.
    shaped, offered = template_messages(history, [WEATHER], native=True)
    assert offered == [WEATHER] and shaped[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert shaped[3] == history[3]


def _scripted(monkeypatch: pytest.MonkeyPatch, replies: list[str], prompts: list[list[int]]) -> None:
    """``serving.complete`` runs for real (its cache, its counts), and the text it hands out is the next
    scripted reply, in pieces of 3 characters (a stream's deltas)."""
    complete = serving.complete

    def scripted(runtime: llm.ModelRuntime, ids: list[int], prefix: Any, n_cached: int, sampling: Any,
                 on_text: Callable[[str], None] | None = None) -> serving.Completion:
        prompts.append(list(ids))
        done = complete(runtime, ids, prefix, n_cached, sampling, None)
        text = replies.pop(0)
        for i in range(0, len(text), 3):
            if on_text is not None:
                on_text(text[i:i + 3])
        return dataclasses.replace(done, text=text, finish_reason="stop")

    monkeypatch.setattr(serving, "complete", scripted)


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 3, "temperature": 0, "tools": [WEATHER],
            **fields}


def test_the_openai_client_gets_tool_calls_streamed_and_not(chat_tiny: llm.ModelRuntime,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    prompts: list[list[int]] = []
    _scripted(monkeypatch, [CALL, "Sure. " + CALL, CALL], prompts)

    async def test(node: Node) -> None:
        client = openai.AsyncOpenAI(base_url=node.url, api_key=TOKEN, max_retries=0)
        done = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3,  # type: ignore[arg-type]
                                                    tools=[WEATHER])  # type: ignore[list-item]
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        call = choice.message.tool_calls[0]  # type: ignore[index]
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
        # The tools opened the prompt (the fallback's system block): more tokens than without.
        assert len(prompts[-1]) > len(serving.chat_ids(chat_tiny, HELLO))
        # The conversation keeps the call and the tools (a handoff of it renders the same prompt).
        kept = node.face.conversations[done.id]
        assert kept.tools is not None and kept.messages[-1]["tool_calls"][0]["id"] == call.id
        # Streamed: the SDK's own accumulation of the deltas.
        async with client.chat.completions.stream(model=MODEL, messages=HELLO, max_tokens=3,  # type: ignore[arg-type]
                                                  tools=[WEATHER]) as stream:  # type: ignore[list-item]
            final = await stream.get_final_completion()
        choice2 = final.choices[0]
        assert choice2.finish_reason == "tool_calls" and choice2.message.content == "Sure."
        streamed = choice2.message.tool_calls[0]  # type: ignore[index]
        assert streamed.function.name == "get_weather"  # type: ignore[union-attr]
        assert json.loads(streamed.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
        # The raw chunks: OpenAI's shape, the id and name first, then the arguments.
        status, body, _ = await node.post("/chat/completions", _chat(stream=True))
        deltas = [e["choices"][0]["delta"] for e in body["events"] if e["choices"]]
        calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        assert status == 200 and [c["index"] for c in calls] == [0, 0]
        assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
        assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
        assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Paris"} and "id" not in calls[1]
        assert not any(OPEN in d.get("content", "") for d in deltas)
        assert body["events"][-1]["choices"][0]["finish_reason"] == "tool_calls"
        await client.close()

    run(chat_tiny, test)


def test_what_is_not_a_call_comes_back_as_content(chat_tiny: llm.ModelRuntime,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    bad = f'{OPEN}{{"name": "delete_all", "arguments": {{}}}}{CLOSE}'
    broken = f"{OPEN}{{oops{CLOSE}"
    prompts: list[list[int]] = []
    _scripted(monkeypatch, [bad, broken, CALL, CALL + CALL, CALL + CALL], prompts)

    async def test(node: Node) -> None:
        for text in (bad, broken):  # under auto: never a 500
            status, body, _ = await node.post("/chat/completions", _chat())
            choice = body["choices"][0]
            assert status == 200 and choice["message"] == {"role": "assistant", "content": text}, body
            assert choice["finish_reason"] == "stop"
        # tool_choice none: the tools are not offered (the prompt as without them), nothing is parsed.
        status, body, headers = await node.post("/chat/completions", _chat(tool_choice="none",
                                                                           parallel_tool_calls=True))
        assert status == 200 and body["choices"][0]["message"]["content"] == CALL, body
        assert prompts[-1] == serving.chat_ids(chat_tiny, HELLO)
        assert headers["X-PFEC-Ignored-Fields"] == "parallel_tool_calls"
        # parallel_tool_calls false keeps the first call; true (or left out) all of them.
        for parallel, n in ((False, 1), (None, 2)):
            status, body, _ = await node.post("/chat/completions", _chat(parallel_tool_calls=parallel))
            assert status == 200 and len(body["choices"][0]["message"]["tool_calls"]) == n, body

    run(chat_tiny, test)


def test_tool_messages_and_calls_are_rendered_through_the_template(
        chat_tiny: llm.ModelRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts: list[list[int]] = []
    _scripted(monkeypatch, ["w5"], prompts)
    history = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "w7"}'}}]},
        {"role": "tool", "content": "w8", "tool_call_id": "c1"}]

    async def test(node: Node) -> None:
        status, body, _ = await node.post("/chat/completions", _chat(messages=history))
        assert status == 200 and body["choices"][0]["message"]["content"] == "w5", body
        # The tiny template ignores tools: the fallback's text, written out here.
        call = '{"name": "get_weather", "arguments": {"city": "w7"}}'
        shaped = [{"role": "system", "content": openai_tools.hermes_block([WEATHER])},
                  {"role": "user", "content": "w5 w6 w7"},
                  {"role": "assistant", "content": f"{OPEN}\n{call}\n{CLOSE}"},
                  {"role": "user", "content": "<tool_response>\nw8\n</tool_response>"}]
        assert prompts[-1] == serving.chat_ids(chat_tiny, shaped)

    run(chat_tiny, test)


def test_bad_tools_are_a_400_naming_the_field(chat_tiny: llm.ModelRuntime) -> None:
    def tool(**function: Any) -> dict[str, Any]:
        return {"type": "function", "function": {"name": "f", **function}}

    deep: dict[str, Any] = {"type": "object"}
    for _ in range(13):
        deep = {"type": "object", "properties": {"x": deep}}
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"tools": [tool(parameters={"type": "strin"})]}, "tools.0.function.parameters", "not a JSON type"),
        ({"tools": [tool(parameters={"type": "string"})]}, "tools.0.function.parameters", "object schema"),
        ({"tools": [tool(parameters={"type": "object", "properties": {"a": 5}})]},
         "tools.0.function.parameters", "properties.a"),
        ({"tools": [tool(parameters={"type": "object", "required": "a"})]}, "tools.0.function.parameters",
         "required"),
        ({"tools": [tool(parameters=[1])]}, "tools.0.function.parameters", "an object"),
        ({"tools": [tool(parameters=deep)]}, "tools.0.function.parameters", "deeper than 12"),
        ({"tools": [tool(parameters={"type": "object", "description": "d" * 17000})]},
         "tools.0.function.parameters", "bytes of JSON"),
        ({"tools": [tool(name="a b")]}, "tools.0.function.name", "pattern"),
        ({"tools": [tool(name="n" * 65)]}, "tools.0.function.name", "pattern"),
        ({"tools": [tool(description="d" * 4097)]}, "tools.0.function.description", "at most 4096"),
        ({"tools": [tool()] * 65}, "tools", "at most 64"),
        ({"tools": [tool(description="d" * 4000, name=f"f{i}") for i in range(40)]}, "tools",
         "bytes of JSON"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type", "'function'"),
        ({"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [tool()]},
         "tool_choice.function.name", "not one of the tools"),
        ({"messages": [{"role": "tool", "content": "w5"}]}, "messages.0.tool_call_id", "names its call"),
        ({"messages": [{"role": "user", "content": "w5", "tool_call_id": "c"}]}, "messages.0.tool_call_id",
         "names its call"),
        ({"messages": [{"role": "user", "content": "w5", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages.0.tool_calls", "only an assistant"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}]},
         "messages.0.tool_calls.0.function.arguments", "valid string"),
    ]

    async def test(node: Node) -> None:
        for fields, param, why in cases:
            status, body, _ = await node.post("/chat/completions", _chat(**fields))
            error = body.get("error", {})
            assert status == 400 and error.get("param") == param, (param, body)
            assert why in error["message"], (param, body)

    run(chat_tiny, test)


def test_tool_call_parser_is_a_typed_documented_option() -> None:
    for limits in (LimitsConfig, SenderLimitsConfig):
        field = limits.model_fields["tool_call_parser"]
        assert limits().tool_call_parser == "hermes" and field.description and "hermes" in field.description
        with pytest.raises(ValidationError, match="tool_call_parser"):
            limits(tool_call_parser="mistral")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown tool call parser"):
        openai_tools.parser("mistral", [WEATHER], True)
