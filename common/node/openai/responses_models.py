"""``POST /v1/responses``'s request, typed and bounded as the chat request is (``openai.models``), and its
translation into the chat request the node generates through (``chat_body``).

The fields fall into the same kinds as the chat request's:

- honoured: ``model``, ``input`` (a string, or items: ``openai.responses_items``), ``instructions`` (the
  system prompt; not carried over from a previous response, as OpenAI's), ``tools`` (function tools, flat),
  ``tool_choice``, ``parallel_tool_calls``, ``text.format`` (the chat request's ``response_format``),
  ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``previous_response_id``, ``store`` (false:
  the response is not kept for a later ``previous_response_id``), ``truncation`` disabled and vLLM's
  ``cache_salt``;
- accepted and ignored, named in ``X-PFEC-Ignored-Fields``: ``IGNORED``, an ``include`` list (what it adds
  belongs to tools not served here) and ``reasoning`` without an effort;
- refused, naming the field: hosted tools, ``truncation`` auto, a ``conversation``, a ``prompt`` template,
  ``background``, logprobs, reasoning efforts, ``text.verbosity`` and context management.

A translated request the chat model refuses is answered with the field as this API spells it (``client``):
``tools.0.function.parameters`` is ``tools.0.parameters``, ``response_format`` is ``text.format``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator

from pfec.common.node.openai.models import (
    MAX_HINT_CHARS,
    MAX_ID_CHARS,
    MAX_TEXT_CHARS,
    MAX_TOKENS_CAP,
    NOT_BUILT,
    Metadata,
    _refuse,
    _Strict,
)
from pfec.common.node.openai.responses_items import Items, chat_messages
from pfec.common.node.openai.tools import MAX_SCHEMA_BYTES, MAX_TOOLS, MAX_TOOLS_BYTES, FunctionDef, Name
from pfec.common.plan.prefix_store import MAX_SALT_CHARS

MAX_INCLUDE = 16
TEXT_ONLY = "only function tools are served here"


class _Closed(BaseModel):
    """No null-means-default validator: a discriminated union's members take none."""

    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionTool(FunctionDef):
    """A function tool as the Responses API writes it: flat, not nested under ``function``."""

    type: Literal["function"]

    def chat(self) -> dict[str, Any]:
        """As the chat request takes it."""
        return {"type": "function", "function": self.model_dump(exclude_none=True, exclude={"type"})}

    def echoed(self) -> dict[str, Any]:
        """As a response echoes it (OpenAI's ``FunctionTool``)."""
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict}


class HostedTool(_Strict):
    """A tool of another type (web search, file search, MCP, ...): always refused, naming its ``type``."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Any

    @field_validator("type")
    @classmethod
    def _hosted(cls, v: Any) -> Any:
        shown = repr(v)[:64] if isinstance(v, str) else type(v).__name__
        raise ValueError(f"{TEXT_ONLY} (type \"function\"), not {shown}")


def _tool_kind(tool: Any) -> str:
    """Which model a tool is validated as (a tag no body has as a key: ``client_path`` skips it)."""
    if isinstance(tool, FunctionTool) or (isinstance(tool, dict) and tool.get("type") == "function"):
        return "function-tool"
    return "hosted-tool"


Tool = Annotated[Annotated[FunctionTool, Tag("function-tool")] | Annotated[HostedTool, Tag("hosted-tool")],
                 Discriminator(_tool_kind)]


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: Name


class OtherChoice(_Strict):
    """A ``tool_choice`` object naming a hosted tool or allowed tools: refused, naming its ``type``."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Any

    @field_validator("type")
    @classmethod
    def _other(cls, v: Any) -> Any:
        shown = repr(v)[:64] if isinstance(v, str) else type(v).__name__
        raise ValueError(f"{TEXT_ONLY}: tool_choice is \"auto\", \"none\", \"required\" or "
                         f"{{\"type\": \"function\", \"name\": ...}}, not type {shown}")


def _choice_kind(choice: Any) -> str:
    if isinstance(choice, str):
        return "choice-mode"
    if isinstance(choice, FunctionChoice) or (isinstance(choice, dict) and choice.get("type") == "function"):
        return "choice-function"
    return "choice-other"


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("choice-mode")]
    | Annotated[FunctionChoice, Tag("choice-function")] | Annotated[OtherChoice, Tag("choice-other")],
    Discriminator(_choice_kind)]


class FormatText(_Closed):
    type: Literal["text"]


class FormatJSONObject(_Closed):
    type: Literal["json_object"]


class FormatJSONSchema(_Closed):
    """Structured output by a JSON schema (the chat request's ``response_format.json_schema``, flat)."""

    type: Literal["json_schema"]
    name: Name
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = Field(default=None, max_length=4096)
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _size(cls, v: dict[str, Any]) -> dict[str, Any]:
        size = len(json.dumps(v, separators=(",", ":")))
        if size > MAX_SCHEMA_BYTES:
            raise ValueError(f"{size} bytes of JSON, above the limit of {MAX_SCHEMA_BYTES}")
        return v


TextFormat = Annotated[FormatText | FormatJSONObject | FormatJSONSchema, Field(discriminator="type")]


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: None = None

    @field_validator("verbosity", mode="before")
    @classmethod
    def _verbosity(cls, v: Any) -> Any:
        if v is not None:
            raise _refuse("text.verbosity", "verbosity changes the answer and is not served here")
        return v


class Reasoning(_Strict):
    """Reasoning settings: only none (this node's model does not reason); a summary asks for nothing."""

    effort: Literal["none"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None

    @field_validator("effort", mode="before")
    @classmethod
    def _effort(cls, v: Any) -> Any:
        if v is not None and v != "none":
            raise ValueError("reasoning efforts are not served here (they change a reasoning model's "
                             "answer); send \"none\", null or leave reasoning out")
        return v


class StreamOptions(_Strict):
    include_obfuscation: bool | None = Field(
        default=None, description="Accepted and ignored: no event is padded against length side channels.")


class ResponsesRequest(_Strict):
    """``POST /v1/responses``."""

    #: Accepted and ignored: they change nothing in the answer here (``ignored()`` names the ones sent).
    IGNORED: ClassVar[tuple[str, ...]] = (
        "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier", "user",
        "max_tool_calls", "prompt_cache_options")
    NOT_BUILT_FIELDS: ClassVar[dict[str, str]] = {
        "conversation": "the Conversations API is not served here: continue with previous_response_id, or "
                        "send the whole input",
        "prompt": "prompt templates are not served here",
        "context_management": f"context management (compaction) is {NOT_BUILT}",
    }

    model: str = Field(max_length=256)
    input: Annotated[str, Field(max_length=MAX_TEXT_CHARS)] | Items
    instructions: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP,
                                          description="Left out: the rest of the context, up to the node's "
                                          "limit.")
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS,
                                             pattern=r"^[A-Za-z0-9_.:-]+$")
    store: bool = Field(default=True, description="false: not kept for a later previous_response_id.")
    truncation: Literal["disabled"] | None = None
    cache_salt: str | None = Field(
        default=None, min_length=1, max_length=MAX_SALT_CHARS,
        description="Prefix-cache isolation (as vLLM's): a request reuses only caches of its own salt.")
    background: bool = Field(default=False, description="Only false: a response is served while asked.")
    top_logprobs: int | None = Field(default=None, ge=0, le=20, description="Only 0.")
    include: Annotated[list[Annotated[str, Field(max_length=128)]], Field(max_length=MAX_INCLUDE)] | None = (
        None)
    reasoning: Reasoning | None = None
    # Accepted and ignored (IGNORED), still typed and bounded.
    metadata: Metadata | None = None
    service_tier: str | None = Field(default=None, max_length=32)
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_HINT_CHARS)
    prompt_cache_retention: str | None = Field(default=None, max_length=32)
    prompt_cache_options: Annotated[dict[Annotated[str, Field(max_length=64)], str | int | bool | None],
                                    Field(max_length=8)] | None = None
    safety_identifier: str | None = Field(default=None, max_length=MAX_HINT_CHARS)
    user: str | None = Field(default=None, max_length=256)
    max_tool_calls: int | None = Field(default=None, ge=1, le=1 << 16,
                                       description="Bounds hosted tools' calls: none are served here.")
    conversation: None = None
    prompt: None = None
    context_management: None = None

    @field_validator(*NOT_BUILT_FIELDS, mode="before")
    @classmethod
    def _not_built(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            name = str(info.field_name)
            raise _refuse(name, cls.NOT_BUILT_FIELDS[name])
        return v

    @field_validator("tools")
    @classmethod
    def _tools_size(cls, v: list[Any] | None) -> list[Any] | None:
        size = sum(len(t.model_dump_json(exclude_none=True)) for t in v or ())
        if size > MAX_TOOLS_BYTES:
            raise ValueError(f"{size} bytes of JSON, above the limit of {MAX_TOOLS_BYTES}")
        return v

    @field_validator("truncation", mode="before")
    @classmethod
    def _truncation(cls, v: Any) -> Any:
        if v == "auto":
            raise ValueError(f"truncation auto (dropping the conversation's first items to fit the context) "
                             f"is {NOT_BUILT}; send \"disabled\", null or leave it out")
        return v

    @field_validator("background")
    @classmethod
    def _background(cls, v: bool) -> bool:
        if v:
            raise ValueError("background responses are not served here; send false or leave it out")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise ValueError(f"logprobs are {NOT_BUILT}; send 0, null or leave top_logprobs out")
        return v

    @field_validator("include")
    @classmethod
    def _include(cls, v: list[str] | None) -> list[str] | None:
        if v and "message.output_text.logprobs" in v:
            raise ValueError(f"message.output_text.logprobs: logprobs are {NOT_BUILT}")
        return v

    @property
    def salt(self) -> str:
        return self.cache_salt or ""

    @property
    def format(self) -> FormatText | FormatJSONObject | FormatJSONSchema | None:
        return None if self.text is None else self.text.format

    def ignored(self) -> list[str]:
        """The accepted fields this request sent that changed nothing."""
        names = [name for name in self.IGNORED if getattr(self, name) is not None]
        if self.include:
            names.append("include")
        if self.reasoning is not None:
            names.append("reasoning")
        if self.stream_options is not None and self.stream_options.include_obfuscation is not None:
            names.append("stream_options.include_obfuscation")
        return names

    def function_tools(self) -> list[FunctionTool]:
        return [t for t in self.tools or () if isinstance(t, FunctionTool)]

    def chat_body(self, prior: Sequence[Mapping[str, Any]], input_messages: list[dict[str, Any]],
                  ) -> dict[str, Any]:
        """The chat request this one stands for: the instructions as the system prompt, then the previous
        response's conversation (``prior``), then the input (converted: ``input_messages``)."""
        messages: list[Any] = [] if self.instructions is None else [
            {"role": "system", "content": self.instructions}]
        messages += [dict(m) for m in prior] + input_messages
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "temperature": self.temperature, "top_p": self.top_p,
            "max_completion_tokens": self.max_output_tokens, "cache_salt": self.cache_salt,
            "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools is not None:
            body["tools"] = [t.chat() for t in self.function_tools()]
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            body["tool_choice"] = choice
        form = self.format
        if isinstance(form, FormatJSONSchema):
            spec = {"name": form.name, "schema": form.schema_, "description": form.description,
                    "strict": form.strict}
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {k: v for k, v in spec.items() if v is not None}}
        elif form is not None:
            body["response_format"] = {"type": form.type}
        return {k: v for k, v in body.items() if v is not None}

    def input_messages(self) -> list[dict[str, Any]]:
        """The input as chat messages (the one converter: ``responses_items.chat_messages``)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return chat_messages(self.input)

    def echoed(self) -> dict[str, Any]:
        """The request's settings as a response object repeats them."""
        choice = self.tool_choice
        form = self.format
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "model": self.model, "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id, "store": self.store,
            "temperature": self.temperature, "top_p": self.top_p, "truncation": "disabled",
            "tools": [t.echoed() for t in self.function_tools()],
            "tool_choice": (choice.model_dump() if isinstance(choice, FunctionChoice)
                            else choice if isinstance(choice, str) else "auto"),
            "text": {"format": form.model_dump(by_alias=True, exclude_none=True) if form is not None
                     else {"type": "text"}},
            "metadata": self.metadata or {}, "user": self.user, "reasoning": None,
            "service_tier": "default", "background": False,
        }


# --------------------------------------------------------------------------- chat's words as this API's

_PATHS: tuple[tuple[str, str], ...] = (
    ("response_format.json_schema.", "text.format."), ("response_format", "text.format"),
    ("tool_choice.function.", "tool_choice."), ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"), ("messages", "input"))


def client(param: str | None) -> str | None:
    """A chat request's field as the Responses request spells it (``tools.0.function.parameters`` is
    ``tools.0.parameters``, ``response_format.json_schema.schema`` is ``text.format.schema``)."""
    if param is None:
        return None
    parts = param.split(".")
    if len(parts) >= 3 and parts[0] == "tools" and parts[2] == "function":
        return ".".join([*parts[:2], *parts[3:]])
    for chat, ours in _PATHS:
        if param == chat.rstrip(".") or param.startswith(chat if chat.endswith(".") else chat + "."):
            return ("input" if chat == "messages" else ours + param[len(chat):]).rstrip(".")
    return param


def client_message(param: str | None, message: str) -> str:
    """An error message that opens with the chat field's name, opened with this API's instead."""
    ours = client(param)
    if param is not None and ours is not None and message.startswith(param):
        return ours + message[len(param):]
    return message
