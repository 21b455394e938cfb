"""The OpenAI-compatible API's request models: every field typed and bounded (``extra="forbid"``: an unknown
or unsupported parameter is a 400 naming it), checked strictly on the raw JSON before anything is
tokenised. What a field may not be (``n`` other than 1, penalties, tools) is refused with the reason.

Bounds that depend on the node (``max_tokens`` against ``limits.max_completion_tokens``, the prompt against
the model's context) are checked by ``openai_http`` with the same error shape.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pfec.common.plan.prefix_store import MAX_SALT_CHARS

MAX_TEXT_CHARS = 1 << 20  # one message's or prompt's characters (the body size bounds it first)
MAX_MESSAGES = 256
MAX_STOP = 4  # as OpenAI's API
MAX_STOP_CHARS = 64
MAX_TOKENS_CAP = 1 << 16  # static cap; limits.max_completion_tokens is the configured one
MAX_ID_CHARS = 128

Stop = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    """A content part; only text parts are served (no images, audio or files)."""

    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT_CHARS)


Parts = Annotated[list[TextPart], Field(max_length=64)]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | Parts
    name: str | None = Field(default=None, max_length=64)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def rendered(self) -> dict[str, str]:
        """The message as the chat template takes it (a developer message is the system prompt)."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    """What both completion endpoints share."""

    model: str = Field(max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 63)
    stop: Stop | list[Stop] | None = Field(default=None)
    n: int = Field(default=1, description="Only 1: one completion per request.")
    presence_penalty: float = Field(default=0.0, description="Only 0 (no penalties here).")
    frequency_penalty: float = Field(default=0.0, description="Only 0 (no penalties here).")
    user: str | None = Field(default=None, max_length=256, description="Accepted and ignored.")
    cache_salt: str | None = Field(
        default=None, min_length=1, max_length=MAX_SALT_CHARS,
        description="Prefix-cache isolation (as vLLM's): a request reuses only caches of its own salt.")

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


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)

    @model_validator(mode="after")
    def _one_limit(self) -> ChatCompletionRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def limit_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def rendered(self) -> list[dict[str, str]]:
        return [m.rendered() for m in self.messages]


class CompletionRequest(_Generation):
    """``POST /v1/completions`` (a raw prompt; no chat template)."""

    prompt: str = Field(min_length=1, max_length=MAX_TEXT_CHARS)
    max_tokens: int = Field(default=16, ge=1, le=MAX_TOKENS_CAP)
    echo: bool = Field(default=False, description="Only false.")

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @property
    def limit(self) -> int:
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
