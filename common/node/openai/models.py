"""The OpenAI-compatible API's request models: every field typed and bounded (``extra="forbid"``: an unknown
parameter is a 400 naming it), checked strictly on the raw JSON before anything is tokenised.

The fields OpenAI's chat and completions APIs define fall into four kinds:

- honoured: ``messages``/``prompt``, ``max_tokens``, ``max_completion_tokens``, ``temperature``, ``top_p``,
  ``seed``, ``stop``, ``stream``, ``stream_options.include_usage`` and vLLM's ``cache_salt``;
- accepted at the values that match what the node does, refused with the reason otherwise: ``n`` 1,
  penalties 0, ``logit_bias`` empty, no logprobs, ``modalities`` text, ``echo`` false, ``best_of`` 1;
- tool calls: ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``tool`` messages and an assistant's
  ``tool_calls`` (``openai.tools``); structured output, ``response_format`` (``openai.structured``: it
  and ``tool_choice`` required or named are enforced by constrained decoding);
- accepted and ignored, because they change nothing in the answer (vLLM ignores them too): ``IGNORED``;
  each response names the ones a request sent (``ignored()``), in a header;
- refused as not built: legacy function calls, audio, reasoning settings, web search, ``suffix``.

An explicit null of an optional field means its default, as in OpenAI's own API. Bounds that depend on the
node (``max_tokens`` against ``limits.max_completion_tokens``, the prompt against the model's context) are
checked by ``openai.http`` with the same error shape; ``client_path`` names a field as the client wrote it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from pfec.common.node.openai.structured import Constraint, ResponseFormat, constraint
from pfec.common.node.openai.tools import MAX_CALL_ID_CHARS, ToolCalls, ToolsMixin
from pfec.common.plan.prefix_store import MAX_SALT_CHARS

MAX_TEXT_CHARS = 1 << 20  # one message's or prompt's characters (the body size bounds it first)
MAX_MESSAGES = 256
MAX_STOP = 4  # as OpenAI's API
MAX_STOP_CHARS = 64
MAX_TOKENS_CAP = 1 << 16  # static cap; limits.max_completion_tokens is the configured one
MAX_ID_CHARS = 128
# OpenAI's own bounds on metadata: refused beyond them although the node ignores it, so a request that works
# here works there.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_HINT_CHARS = 1024  # an ignored identifier (prompt_cache_key, safety_identifier): generous, still bounded
MAX_PATH_PART_CHARS = 64  # a client's map key quoted in an error is cut here (only the body bounds it)
NOT_BUILT = "not built yet on this node"

Stop = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
         Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]],
    Field(max_length=MAX_METADATA_KEYS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info: ValidationInfo) -> Any:
        """An explicit null of a field that cannot be null means its default (OpenAI's clients send
        ``"temperature": null``); a field that may be null keeps it (``max_tokens``: no limit asked)."""
        if v is None and info.field_name is not None:
            spec = cls.model_fields[info.field_name]
            if not spec.is_required() and not _nullable(spec.annotation):
                return spec.default
        return v


def _nullable(annotation: Any) -> bool:
    none = type(None)
    return annotation is None or annotation is none or none in get_args(annotation)


def _refuse(field: str, why: str) -> ValueError:
    return ValueError(f"{why}; send null or leave {field} out")


class TextPart(_Strict):
    """A content part; only text parts are served (no images, audio or files)."""

    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT_CHARS)


Parts = Annotated[list[TextPart], Field(max_length=64)]


class ChatMessage(_Strict):
    """One message of a conversation. An assistant message may have null content: its turn rendered as its
    refusal if it has one, else as empty text (and its ``tool_calls``). A ``tool`` message is a call's
    result: it names the call (``tool_call_id``)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Parts | None = Field(default=None, validate_default=True)
    name: str | None = Field(default=None, max_length=64, description="Accepted and ignored.")
    refusal: str | None = Field(default=None, max_length=MAX_TEXT_CHARS,
                                description="An assistant's refusal: its text when content is null.")
    tool_calls: ToolCalls | None = None  # an assistant's (an empty list: none)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=MAX_CALL_ID_CHARS,
                                     validate_default=True)  # a tool message's, only
    # What the openai SDK's message objects carry back as nulls when a client echoes a reply.
    function_call: None = None
    audio: None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v: str | list[TextPart] | None, info: ValidationInfo) -> str | list[TextPart] | None:
        role = info.data.get("role")
        if v is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message needs content (only an assistant's may be null)")
        return v

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, v: Any, info: ValidationInfo) -> Any:
        if v and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, v: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if (v is None) == (role == "tool"):
            raise ValueError("a tool message names its call (tool_call_id); no other message does")
        return v

    @field_validator("function_call", "audio", mode="before")
    @classmethod
    def _only_null(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            raise _refuse(str(info.field_name), f"an assistant's {info.field_name} is {NOT_BUILT}")
        return v

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def rendered(self) -> dict[str, Any]:
        """The message as the node keeps it (a developer message is the system prompt); the chat template
        gets it through ``tools.template_messages``."""
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.rendered() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = Field(
        default=None, description="Accepted and ignored: no chunk is padded against length side channels.")


class Prediction(_Strict):
    """Predicted output: a latency hint only (the answer is the model's either way), accepted and ignored."""

    type: Literal["content"]
    content: Text | Parts


class _Generation(_Strict):
    """What both completion endpoints share."""

    #: Accepted and ignored: they change nothing in the answer here (``ignored()`` names the ones sent).
    IGNORED: ClassVar[tuple[str, ...]] = (
        "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
        "safety_identifier", "user")

    model: str = Field(max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 63,
                             description="Honoured: the sampler's generator is seeded with it.")
    stop: Stop | list[Stop] | None = Field(default=None)
    n: int = Field(default=1, description="Only 1: one completion per request.")
    presence_penalty: float = Field(default=0.0, description="Only 0 (no penalties here).")
    frequency_penalty: float = Field(default=0.0, description="Only 0 (no penalties here).")
    logit_bias: dict[str, float] | None = Field(default=None,
                                                description="Only empty (it changes the answer).")
    cache_salt: str | None = Field(
        default=None, min_length=1, max_length=MAX_SALT_CHARS,
        description="Prefix-cache isolation (as vLLM's): a request reuses only caches of its own salt.")
    # Accepted and ignored (IGNORED), still typed and bounded.
    user: str | None = Field(default=None, max_length=256)
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: str | None = Field(default=None, max_length=32)
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_HINT_CHARS)
    prompt_cache_retention: str | None = Field(default=None, max_length=32)
    safety_identifier: str | None = Field(default=None, max_length=MAX_HINT_CHARS)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n = 1 is supported (one completion per request)")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("penalties are not supported (only 0)")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v: Any) -> Any:
        if v is not None and v != {}:  # refused whole, not entry by entry (it may bias a whole vocabulary)
            raise ValueError("logit_bias changes the answer and is not supported here; send {} or null")
        return v

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def salt(self) -> str:
        """The store's salt ("" without one: the shared namespace)."""
        return self.cache_salt or ""

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def ignored(self) -> list[str]:
        """The accepted fields this request sent that changed nothing (a null is the default: not listed)."""
        names = [name for name in self.IGNORED if getattr(self, name) is not None]
        if self.stream_options is not None and self.stream_options.include_obfuscation is not None:
            names.append("stream_options.include_obfuscation")
        return names


class ChatCompletionRequest(_Generation, ToolsMixin):
    """``POST /v1/chat/completions`` (the tool-call fields: ``ToolsMixin``)."""

    IGNORED: ClassVar[tuple[str, ...]] = (*_Generation.IGNORED, "prediction")
    # Refused whenever set: what each would need.
    NOT_BUILT_FIELDS: ClassVar[dict[str, str]] = {
        "functions": f"function calling (the legacy form of tools) is {NOT_BUILT}",
        "function_call": f"function calling (the legacy form of tool_choice) is {NOT_BUILT}",
        "audio": "audio output is not served here (text only)",
        "reasoning_effort": "reasoning settings are not served here (they change a reasoning model's answer)",
        "verbosity": "verbosity changes the answer and is not served here",
        "web_search_options": "web search is not served here",
    }

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP,
                                   description="Left out: the rest of the context, up to the node's limit.")
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    logprobs: bool = Field(default=False, description="Only false.")
    top_logprobs: int | None = Field(default=None, ge=0, le=20, description="Only 0.")
    response_format: ResponseFormat | None = None
    modalities: list[Literal["text"]] | None = Field(default=None, max_length=2)
    prediction: Prediction | None = None  # ignored: a latency hint only
    functions: None = None
    function_call: None = None
    audio: None = None
    reasoning_effort: None = None
    verbosity: None = None
    web_search_options: None = None

    @field_validator(*NOT_BUILT_FIELDS, mode="before")
    @classmethod
    def _not_built(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:  # refused on sight: no use validating a schema the node will not use
            name = str(info.field_name)
            raise _refuse(name, cls.NOT_BUILT_FIELDS[name])
        return v

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("max_tokens") is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: bool) -> bool:
        if v:
            raise ValueError(f"logprobs are {NOT_BUILT}; send false, null or leave it out")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise ValueError(f"logprobs are {NOT_BUILT}; send 0, null or leave top_logprobs out")
        return v

    @field_validator("modalities", mode="before")
    @classmethod
    def _modalities(cls, v: Any) -> Any:
        if isinstance(v, list) and "audio" in v:
            raise ValueError("audio output is not served here: modalities may be [\"text\"] only")
        return v

    @property
    def limit(self) -> int | None:
        """The client's token limit (None: the rest of the context, up to the node's limit)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def limit_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def rendered(self) -> list[dict[str, Any]]:
        return [m.rendered() for m in self.messages]

    def constraint(self) -> Constraint | None:
        """What ``response_format`` and ``tool_choice`` hold the reply to (None: free text)."""
        return constraint(self.response_format, self)

    def ignored(self) -> list[str]:
        names = super().ignored()
        if self.parallel_tool_calls is not None and self.offered() is None:
            names.append("parallel_tool_calls")  # no tools offered: it means nothing
        # Message fields the chat template never sees, once per field (not per message).
        if any(m.name is not None for m in self.messages):
            names.append("messages.*.name")
        if any(m.refusal is not None and m.content is not None for m in self.messages):
            names.append("messages.*.refusal")
        return names


class CompletionRequest(_Generation):
    """``POST /v1/completions`` (a raw prompt; no chat template)."""

    NOT_BUILT_FIELDS: ClassVar[dict[str, str]] = {
        "logprobs": f"logprobs are {NOT_BUILT}",
        "suffix": "suffix (text inserted after the completion) is not served here",
    }

    prompt: str = Field(min_length=1, max_length=MAX_TEXT_CHARS)
    # OpenAI's and vLLM's default for this endpoint is 16; an explicit null asks for the rest of the context.
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_TOKENS_CAP)
    echo: bool = Field(default=False, description="Only false.")
    best_of: int = Field(default=1, description="Only 1.")
    logprobs: None = None
    suffix: None = None

    @field_validator(*NOT_BUILT_FIELDS, mode="before")
    @classmethod
    def _not_built(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            name = str(info.field_name)
            raise _refuse(name, cls.NOT_BUILT_FIELDS[name])
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only best_of = 1 is supported (one completion per request)")
        return v

    @property
    def limit(self) -> int | None:
        return self.max_tokens

    @property
    def limit_field(self) -> str:
        return "max_tokens"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage`` object, with the prompt tokens served from a cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def openai_error(message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body (what its clients parse into ``BadRequestError`` and the like)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# --------------------------------------------------------------------------- errors as the client wrote them


def client_path(loc: tuple[int | str, ...], body: Any) -> str | None:
    """A validation error's location as the client wrote it (``messages.1.content``), walking the body.

    Pydantic's locations also hold the union member tried (``constrained-str``, ``list[TextPart]``) and
    ``[key]`` for a map key: none of them is in the body, so only the steps the body has are kept, and a
    last step it lacks (a missing or unknown field)."""
    parts: list[str] = []
    node = body
    for i, step in enumerate(loc):
        if body is None:
            if not (isinstance(step, int) or step.isidentifier()):
                continue
        elif isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node):
            node = node[step]
        elif isinstance(node, dict) and isinstance(step, str) and (step in node or i == len(loc) - 1):
            node = node.get(step)
        else:
            continue  # a union member's tag or a map key's marker: not the client's
        text = str(step)
        parts.append(text if len(text) <= MAX_PATH_PART_CHARS else text[:MAX_PATH_PART_CHARS] + "...")
    return ".".join(parts) or None


def validation_error(exc: ValidationError, raw: bytes) -> dict[str, Any]:
    """OpenAI's error body for a request that did not validate: the first bad field by the client's path,
    what each union member said of it, and how many other fields were bad."""
    errors = exc.errors()
    if any(e["type"] == "json_invalid" for e in errors):
        return openai_error("request body is not JSON (send one JSON object, UTF-8)")
    try:
        body = json.loads(raw)  # pydantic parsed it; its size and depth were checked before
    except ValueError:
        body = None  # (Python's parser and pydantic's differ at the edges): tags are then dropped by shape
    paths = [client_path(tuple(e["loc"]), body) for e in errors]
    reasons: dict[str | None, list[str]] = {}
    for e, path in zip(errors, paths, strict=True):
        if shallow_error(e["type"], path, paths):
            continue
        why = "not a parameter of this API" if e["type"] == "extra_forbidden" else str(e["msg"]).removeprefix(
            "Value error, ")
        said = reasons.setdefault(path, [])
        if why not in said:
            said.append(why)
    param, said = next(iter(reasons.items()))
    more = f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else ""
    return openai_error(f"{param or 'request'}: {', or '.join(said)}{more}", param)


def shallow_error(kind: str, path: str | None, paths: list[str | None]) -> bool:
    """A union member's plain type mismatch where another member went deeper (content sent as a list of
    parts, one part bad): the deeper error is the one that says what to fix."""
    if path is None or not (kind.endswith("_type") or kind == "none_required"):
        return False
    return any(p is not None and p.startswith(path + ".") for p in paths)
