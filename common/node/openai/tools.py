"""Tool calls on ``/v1/chat/completions`` (issue 38, item 1).

- The request's tools (``Tool``), each bounded: its name as OpenAI spells names, its description, and its
  ``parameters``, whose shape is checked as a JSON Schema object (``schema_problem``) before anything else.
- The prompt: the model's own chat template renders the tools when it takes them (transformers'
  ``apply_chat_template(tools=...)``). A template that ignores them gets the Hermes fallback
  (``template_messages``): the tools as JSON inside ``<tools></tools>`` in the system prompt, earlier calls
  as ``<tool_call>`` text, their results as ``<tool_response>`` blocks in a user turn.
- The reply: ``HermesParser`` (vLLM's ``--tool-call-parser hermes``) turns ``<tool_call>{json}</tool_call>``
  blocks into calls, streamed or not, with one state machine. A block that names an undeclared tool or
  does not parse stays text (content), never an error.
- ``tool_choice``: ``auto`` (the default with tools) and ``none`` (the tools not offered). ``required`` and
  a named function are held to a grammar of calls (``openai.structured``): a valid call always comes back.
  A named function that is not among the tools is a 400 naming ``tool_choice.function.name``.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_TOOLS = 64
MAX_TOOL_CALLS = 64  # an assistant message's calls
MAX_DESCRIPTION_CHARS = 4096
MAX_SCHEMA_BYTES = 16 << 10  # one tool's parameters, as compact JSON
MAX_SCHEMA_DEPTH = 12  # objects and arrays nested in one schema
MAX_TOOLS_BYTES = 128 << 10  # all the tools, as compact JSON (the model's context bounds them again)
MAX_ARGUMENTS_CHARS = 1 << 16  # an earlier call's arguments, as the client sends them back
MAX_CALL_ID_CHARS = 128
PARSERS = ("hermes",)  # limits.tool_call_parser's values
OPEN, CLOSE = "<tool_call>", "</tool_call>"

# OpenAI's rule for a function's name.
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
_JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_OTHER_PROPERTIES = frozenset({"additionalProperties", "patternProperties", "unevaluatedProperties"})
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "additionalItems")


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDef(_Closed):
    name: Name
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = Field(
        default=None, description="A JSON Schema object (its shape checked, bounded in size and depth).")
    strict: bool | None = Field(default=None, description="Accepted. Under tool_choice required or a named "
                                "function the arguments always match the schema; under auto they are parsed "
                                "from what the model writes.")

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if v is None else checked_schema(v, top=True, what="a tool's parameters are ")


class Tool(_Closed):
    type: Literal["function"]
    function: FunctionDef

    def rendered(self) -> dict[str, Any]:
        """As chat templates and the fallback take it (nulls left out)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


Tools = Annotated[list[Tool], Field(max_length=MAX_TOOLS)]


class NamedFunction(_Closed):
    name: Name


class NamedToolChoice(_Closed):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Closed):
    name: Name
    arguments: str = Field(max_length=MAX_ARGUMENTS_CHARS, description="A JSON object, as a string.")


class ToolCall(_Closed):
    """A call an assistant message carries (the client sends an earlier reply back)."""

    id: str = Field(min_length=1, max_length=MAX_CALL_ID_CHARS)
    type: Literal["function"]
    function: FunctionCall

    def rendered(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": self.function.arguments}}


ToolCalls = Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)]


class ToolsMixin(_Closed):
    """The request fields of tool calls (``ChatCompletionRequest`` takes them)."""

    tools: Tools | None = None
    tool_choice: ToolChoice | None = Field(
        default=None, description="auto (the default with tools), none, required or a named function (the "
        "last two held to a grammar of calls: a valid call always comes back).")
    parallel_tool_calls: bool | None = Field(
        default=None, description="false: only the first call parsed is kept (true or null: all of them).")

    @field_validator("tools")
    @classmethod
    def _tools_size(cls, v: list[Tool] | None) -> list[Tool] | None:
        size = sum(len(t.model_dump_json(exclude_none=True)) for t in v or ())
        if size > MAX_TOOLS_BYTES:
            raise ValueError(f"{size} bytes of JSON, above the limit of {MAX_TOOLS_BYTES}")
        return v

    def choice_error(self) -> tuple[str, str] | None:
        """What the node cannot do with this ``tool_choice``: (the field, why); None when it can."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or ()}
            if choice.function.name not in names:
                return ("tool_choice.function.name",
                        f"tool_choice.function.name: {choice.function.name!r} is not one of the tools")
        if choice == "required" and not self.tools:
            return "tool_choice", "tool_choice: \"required\" needs tools to call; send tools, or \"auto\""
        return None

    def offered(self) -> list[dict[str, Any]] | None:
        """The tools the model is offered (None: none given, or ``tool_choice`` none)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.rendered() for t in self.tools]

    @property
    def parallel(self) -> bool:
        return self.parallel_tool_calls is not False

    @property
    def forced(self) -> bool:
        """``tool_choice`` required or a named function: the reply is calls only."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice,
                                                                                   NamedToolChoice))


def checked_schema(schema: dict[str, Any], top: bool, what: str = "") -> dict[str, Any]:
    """``schema`` as given, once its compact JSON is within ``MAX_SCHEMA_BYTES`` and its shape a JSON
    Schema (``top``: an object schema, as a function's parameters); else a ValueError that says why."""
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"{what}{size} bytes of JSON, above the limit of {MAX_SCHEMA_BYTES}")
    problem = schema_problem(schema, 1, top=top)
    if problem is not None:
        raise ValueError(f"not a JSON Schema{' object' if top else ''}: {problem}")
    return schema


def schema_problem(schema: Any, depth: int, top: bool = False) -> str | None:
    """Why ``schema`` is not a JSON Schema (None: its shape is one). A boolean is a schema below the top; the
    top is an object schema (a function's arguments are a JSON object)."""
    if depth > MAX_SCHEMA_DEPTH:
        return f"nested deeper than {MAX_SCHEMA_DEPTH} levels"
    if isinstance(schema, bool) and not top:
        return None
    if not isinstance(schema, dict):
        return f"a schema is an object, not {type(schema).__name__}"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not all(isinstance(k, str) and k in _JSON_TYPES for k in kinds):
        return f"type {kind!r} is not a JSON type"
    if top and kinds and kinds != ["object"]:
        return f"type {kind!r}: a function's parameters are an object schema"
    for key in _SCHEMA_MAPS:
        if key in schema:
            value = schema[key]
            if not isinstance(value, dict):
                return f"{key} is an object of schemas"
            for name, sub in value.items():
                if (problem := schema_problem(sub, depth + 1)) is not None:
                    return f"{key}.{name}: {problem}"
    for key in _SCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list):
                return f"{key} is a list of schemas"
            for i, sub in enumerate(schema[key]):
                if (problem := schema_problem(sub, depth + 1)) is not None:
                    return f"{key}.{i}: {problem}"
    for key in _SCHEMA_ONE:
        if key in schema and (problem := schema_problem(schema[key], depth + 1)) is not None:
            return f"{key}: {problem}"
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return "required is a list of property names"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return "enum is a list"
    return None


def closed(schema: Any) -> Any:
    """``schema`` with each object schema that lists ``properties`` and says nothing of other properties
    closed (``additionalProperties: false``), as OpenAI's strict mode has schemas written: a forced call's
    arguments (and a strict ``response_format``) hold only what they declare. ``allOf`` members are left
    as written (closing each would refuse the properties of the others)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and not _OTHER_PROPERTIES & set(out):
        out["additionalProperties"] = False
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if key != "allOf" and isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if key in out:
            out[key] = closed(out[key])
    return out


# --------------------------------------------------------------------------- the prompt


def hermes_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The fallback's system-prompt block (the Hermes format, as Qwen2.5's and Hermes 2 Pro's templates
    write it): the only place its wording lives."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and "
            f"arguments within {OPEN}{CLOSE} XML tags:\n{OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' + CLOSE)


def template_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                      native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (and tools) the chat template is given. ``native``: the template renders tools itself
    (an earlier call's arguments as the object it expects when they parse). Else the Hermes fallback: the
    tools block in the system prompt, calls as text, results in user turns; the template sees text only."""
    if native:
        shaped = []
        for m in messages:
            calls = [{**c, "function": _function(c)} for c in m.get("tool_calls") or ()]
            plain = {k: v for k, v in m.items() if k != "tool_calls"}
            shaped.append({**plain, "tool_calls": calls} if calls else plain)
        return shaped, [dict(t) for t in tools] if tools else None
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
            continue
        for call in m.get("tool_calls") or ():
            named = json.dumps(_function(call), ensure_ascii=False)
            content += f"{chr(10) if content else ''}{OPEN}\n{named}\n{CLOSE}"
        out.append({"role": role, "content": content})
    if tools:
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{hermes_block(tools)}"
        else:
            out.insert(0, {"role": "system", "content": hermes_block(tools)})
    return [{"role": m["role"], "content": m["content"]} for m in out], None


def _function(call: Mapping[str, Any]) -> dict[str, Any]:
    """An earlier call's name and arguments, the arguments as the object they encode when they parse as
    one (what templates expect: they write it with ``tojson``), else as the string sent."""
    arguments = call["function"]["arguments"]
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        value = None
    return {"name": call["function"]["name"], "arguments": value if isinstance(value, dict) else arguments}


# --------------------------------------------------------------------------- the reply


@dataclass(frozen=True)
class ParsedCall:
    """A call parsed from the reply: its id (``call_`` and random hex), the tool's name, the arguments as a
    JSON string (as OpenAI returns them)."""

    id: str
    name: str
    arguments: str

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}

    def deltas(self, index: int) -> list[dict[str, Any]]:
        """The call as a stream's deltas, as OpenAI streams one: its id and name, then its arguments."""
        head = {"index": index, "id": self.id, "type": "function", "function": {"name": self.name,
                                                                              "arguments": ""}}
        return [{"tool_calls": [head]}, {"tool_calls": [{"index": index, "function": {
            "arguments": self.arguments}}]}]


Event = str | ParsedCall  # a piece of content, or a call


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks out of the reply, fed piece by
    piece (the whole reply at once when not streamed: the same events). Text that may start a tag is held
    until it is known; trailing whitespace is held until text follows (dropped before a call and at the end
    of a reply with calls), so the events are the same however the reply is cut."""

    def __init__(self, names: frozenset[str], parallel: bool = True) -> None:
        self.names = names
        self.parallel = parallel
        self.calls: list[ParsedCall] = []
        self._buf = ""
        self._inside = False
        self._blank = ""

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._inside:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return out
                block, self._buf = self._buf[: end + len(CLOSE)], self._buf[end + len(CLOSE):]
                self._inside = False
                self._block(block, block[len(OPEN): end], out)
                continue
            start = self._buf.find(OPEN)
            if start < 0:
                cut = len(self._buf) - _partial_tag(self._buf, OPEN)
                self._text(self._buf[:cut], out)
                self._buf = self._buf[cut:]
                return out
            self._text(self._buf[:start], out)
            self._buf, self._inside = self._buf[start:], True

    def finish(self) -> list[Event]:
        """The events the end of the reply releases (an unclosed last block is tried as a call, less a
        closing tag the token limit cut short)."""
        out: list[Event] = []
        if self._inside:
            body = self._buf[len(OPEN):]
            self._block(self._buf, body[: len(body) - _partial_tag(body, CLOSE)], out)
        else:
            self._text(self._buf, out)
        self._buf, self._inside = "", False
        if self._blank and not self.calls:
            out.append(self._blank)
        self._blank = ""
        return out

    def _text(self, text: str, out: list[Event]) -> None:
        body = text.rstrip()
        if body:
            out.append(self._blank + body)
            self._blank = ""
        self._blank += text[len(body):]  # trailing whitespace: kept only if text follows

    def _block(self, block: str, body: str, out: list[Event]) -> None:
        call = self._call(body)
        if call is None:
            self._text(block, out)  # not a call of a declared tool: the text comes back as content
            return
        self._blank = ""
        if self.parallel or not self.calls:
            self.calls.append(call)
            out.append(call)

    def _call(self, body: str) -> ParsedCall | None:
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        arguments = value.get("arguments", {})
        if not isinstance(arguments, dict):
            return None
        return ParsedCall(f"call_{secrets.token_hex(12)}", value["name"], json.dumps(arguments,
                                                                                   ensure_ascii=False))


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may start ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parser(name: str, tools: Sequence[Mapping[str, Any]], parallel: bool) -> HermesParser:
    """The parser ``limits.tool_call_parser`` names, for the tools offered."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r} (known: {', '.join(PARSERS)})")
    return HermesParser(frozenset(t["function"]["name"] for t in tools), parallel)


class Reply:
    """A reply's text and calls as they come, and what they make: the stream's deltas, the message, the
    finish reason. Without tools offered, text only (no parser: plain text streams as it comes).
    ``forced`` (a grammar of calls held the reply): calls only; the one text a grammar of calls leaves is a
    last call ``max_tokens`` cut short, and it is dropped."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None, parser_name: str, parallel: bool,
                 forced: bool = False) -> None:
        self.parser = None if tools is None else parser(parser_name, tools, parallel)
        self.forced = forced and self.parser is not None
        self.events: list[Event] = []
        self.n_calls = 0

    def feed(self, text: str) -> list[Event]:
        new: list[Event] = [text] if self.parser is None else self.parser.feed(text)
        return self._keep(new)

    def finish(self) -> list[Event]:
        return self._keep([] if self.parser is None else self.parser.finish())

    def _keep(self, new: list[Event]) -> list[Event]:
        if self.forced:
            new = [e for e in new if isinstance(e, ParsedCall)]
        self.events.extend(new)
        return new

    def deltas(self, events: Sequence[Event]) -> list[dict[str, Any]]:
        """Events as a stream's deltas; a call's index counts the calls streamed before it."""
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, str):
                out.append({"content": event})
            else:
                out.extend(event.deltas(self.n_calls))
                self.n_calls += 1
        return out

    def message(self) -> dict[str, Any]:
        """The reply as OpenAI's message: its content (null when it is only calls) and its calls."""
        text = "".join(e for e in self.events if isinstance(e, str))
        calls = [e.message() for e in self.events if isinstance(e, ParsedCall)]
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return message

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if any(isinstance(e, ParsedCall) for e in self.events) else reason
