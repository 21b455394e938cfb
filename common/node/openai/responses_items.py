"""A conversation as an agent framework keeps it, turned into the chat messages the OpenAI face rendered:
the one converter of Responses API items, for ``POST /v1/responses``'s ``input`` (``openai.responses``)
and ``POST /handoffs {"conversation": {"messages": [...]}}`` (the sender's control API).

Each entry is taken in either shape:

- a chat-completions message, exactly as ``/v1/chat/completions`` takes it (``ChatMessage``: text parts,
  an assistant's ``tool_calls`` with null content, ``tool`` results);
- a Responses API item, as the OpenAI Agents SDK keeps its conversation state (``to_input_list()``): a
  ``message`` (``input_text``/``output_text``/``refusal`` parts; ``annotations``, ``logprobs``, ``id``,
  ``status`` and ``provider_data`` accepted and ignored), an easy input message (``role`` and
  ``content`` only), a ``function_call`` and a ``function_call_output``.

``chat_messages`` converts them the way the Agents SDK's own converter (0.24,
``Converter.items_to_messages``) turns items into the request it sends to ``/v1/chat/completions``: an
assistant output message (one with an ``id``) joins its text parts with newlines and takes the calls that
follow it; a call with no message before it opens an assistant message of null content; a call's output is
a ``tool`` message. So the prompt renders to the token ids the chat endpoint rendered, and the cache it
stored is found. An item of another type (``reasoning`` included: this node's model writes none) is refused
naming its ``type`` (``input.N.type``: a 400; ``conversation.messages.N.type``: a 422, as every invalid field
of ``POST /handoffs``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from pfec.common.node.openai.models import MAX_ID_CHARS, MAX_TEXT_CHARS, ChatMessage
from pfec.common.node.openai.tools import MAX_ARGUMENTS_CHARS, MAX_CALL_ID_CHARS, Name, ToolCall

MAX_ITEMS = 1024  # a conversation's items (calls and their outputs are items of their own)
MAX_PARTS = 64
MAX_IGNORED = 256  # a part's annotations or logprobs, an item's provider_data keys: ignored, still bounded
ITEM_TYPES = ("message", "function_call", "function_call_output")

Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
Ignored = Annotated[list[Any], Field(max_length=MAX_IGNORED)]
ProviderData = Annotated[dict[Annotated[str, Field(max_length=64)], Any], Field(max_length=MAX_IGNORED)]
ItemId = Annotated[str, Field(max_length=MAX_ID_CHARS)]
Status = Literal["in_progress", "completed", "incomplete"]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextItemPart(_Closed):
    """A text part as the Responses API writes it (``text`` too, as the chat API does)."""

    type: Literal["input_text", "output_text", "text"]
    text: Text
    annotations: Ignored | None = None
    logprobs: Ignored | None = None


class RefusalPart(_Closed):
    type: Literal["refusal"]
    refusal: Text


Part = Annotated[TextItemPart | RefusalPart, Field(discriminator="type")]


class MessageItem(_Closed):
    """A Responses ``message`` item, or an easy input message (no ``type``)."""

    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | Annotated[list[Part], Field(max_length=MAX_PARTS)]
    id: ItemId | None = None  # the SDK's placeholder "__fake_id__" on what a chat model returned
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None
    provider_data: ProviderData | None = None

    @field_validator("content")
    @classmethod
    def _refusal(cls, v: str | list[Any], info: Any) -> str | list[Any]:
        if isinstance(v, list) and info.data.get("role") != "assistant" and any(
                isinstance(p, RefusalPart) for p in v):
            raise ValueError("only an assistant message carries a refusal part")
        return v

    @property
    def output(self) -> bool:
        """An assistant's output message, as the SDK tells one from an easy input message (it has an id)."""
        return self.role == "assistant" and self.id is not None

    def texts(self) -> list[str]:
        if isinstance(self.content, str):
            return [self.content]
        return [p.text for p in self.content if isinstance(p, TextItemPart)]

    def refusal(self) -> str | None:
        found = [p.refusal for p in self.content if isinstance(p, RefusalPart)] if isinstance(
            self.content, list) else []
        return found[-1] if found else None


class FunctionCallItem(_Closed):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_CALL_ID_CHARS)
    name: Name
    arguments: str = Field(max_length=MAX_ARGUMENTS_CHARS)
    id: ItemId | None = None
    status: Status | None = None
    provider_data: ProviderData | None = None


class FunctionCallOutputItem(_Closed):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_CALL_ID_CHARS)
    output: Text | Annotated[list[TextItemPart], Field(max_length=MAX_PARTS)]
    id: ItemId | None = None
    status: Status | None = None
    provider_data: ProviderData | None = None


class UnknownItem(_Closed):
    """An item of a type no converter here takes: always refused, naming its ``type``."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Any

    @field_validator("type")
    @classmethod
    def _unknown(cls, v: Any) -> Any:
        shown = repr(v)[:64] if isinstance(v, str | int | float | bool) or v is None else type(v).__name__
        raise ValueError(f"unknown item type {shown}; a conversation's items are chat messages or the "
                         f"Responses API's {', '.join(ITEM_TYPES)} items")


def _kind(item: Any) -> str:
    """Which model an entry is validated as (pydantic's tag)."""
    if isinstance(item, BaseModel):
        return {MessageItem: "message", FunctionCallItem: "function_call",
                FunctionCallOutputItem: "function_call_output"}.get(type(item), "chat")
    if not isinstance(item, dict):
        return "chat"  # refused there: not an object
    if "type" not in item:
        parts = item.get("content")
        responses_parts = isinstance(parts, list) and any(
            isinstance(p, dict) and p.get("type") != "text" for p in parts)
        return "message" if responses_parts else "chat"
    return item["type"] if item["type"] in ITEM_TYPES else "unknown"


Item = Annotated[
    Annotated[ChatMessage, Tag("chat")] | Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[UnknownItem, Tag("unknown")],
    Discriminator(_kind)]
Items = Annotated[list[Item], Field(min_length=1, max_length=MAX_ITEMS)]


def chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """The chat messages ``items`` stand for, as the OpenAI face keeps them (``ChatMessage.rendered``)."""
    out: list[ChatMessage] = []
    pending: dict[str, Any] | None = None  # the assistant message that calls attach to

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            out.append(ChatMessage(**pending))
            pending = None

    for item in items:
        if isinstance(item, ChatMessage):
            flush()
            out.append(item)
        elif isinstance(item, MessageItem) and item.output:
            text = "\n".join(item.texts()) if item.texts() else None
            refusal = item.refusal()
            if (pending is not None and pending["tool_calls"] and pending.get("refusal") is None
                    and pending["content"] is None):  # a streamed turn: its calls came before its text
                pending.update(content=text, refusal=refusal)
            else:
                flush()
                pending = {"role": "assistant", "content": text, "refusal": refusal, "tool_calls": []}
        elif isinstance(item, MessageItem):
            flush()
            out.append(ChatMessage(role=item.role, content="".join(item.texts())))
        elif isinstance(item, FunctionCallItem):
            if pending is None:
                pending = {"role": "assistant", "content": None, "refusal": None, "tool_calls": []}
            pending["tool_calls"].append(ToolCall.model_validate({
                "id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments or "{}"}}))
        elif isinstance(item, FunctionCallOutputItem):
            flush()
            output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            out.append(ChatMessage(role="tool", content=output, tool_call_id=item.call_id))
        else:  # UnknownItem never validates
            raise TypeError(f"not a conversation item: {type(item).__name__}")
    flush()
    return [m.rendered() for m in out]
