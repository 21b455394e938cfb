"""Structured output and forced tool calls (issue 38, items 1 and 2): what a reply must be, as a grammar
the model room enforces token by token (``common/model/constrained.py``; the node never imports it).

- ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object), ``json_schema`` (JSON
  matching ``json_schema.schema``, bounded in size and depth, its shape checked before it is compiled;
  enforced whether ``strict`` is true or not; strict, an object that does not say what other properties
  it takes takes none, as OpenAI's strict mode has them written: ``tools.closed``).
- ``tool_choice`` ``required``: one or more Hermes calls (one without ``parallel_tool_calls``) to the
  declared tools, each call's arguments matching that tool's ``parameters`` (closed objects). A named
  function: one call to it. ``auto`` stays unconstrained, unless ``response_format`` asks for JSON: then
  the reply is the JSON or calls. ``none``: the tools are not offered; ``response_format`` alone decides.
- ``Constraint`` is plain data (JSON Schemas as JSON text); the worker turns it into the model room's
  grammar, and a schema the grammar library cannot compile into a 400 naming the field (``fields``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, field_validator

from pfec.common.node.openai.tools import (
    CLOSE,
    MAX_DESCRIPTION_CHARS,
    OPEN,
    Name,
    NamedToolChoice,
    Tool,
    ToolsMixin,
    _Closed,
    checked_schema,
    closed,
)

if TYPE_CHECKING:
    from pfec.common.model.constrained import Compiled
    from pfec.common.model.llm import ModelRuntime

ANY_OBJECT: dict[str, Any] = {"type": "object"}
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class ResponseFormatText(_Closed):
    type: Literal["text"]


class ResponseFormatJSONObject(_Closed):
    type: Literal["json_object"]


class JSONSchemaFormat(_Closed):
    name: Name
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    schema_: dict[str, Any] | None = Field(
        default=None, alias="schema", description="A JSON Schema (bounded in size and depth); left out: any "
        "JSON object.")
    strict: bool | None = Field(default=None, description="Accepted; the schema is enforced either way.")

    @field_validator("schema_")
    @classmethod
    def _schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if v is None else checked_schema(v, top=False)


class ResponseFormatJSONSchema(_Closed):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema,
                           Field(discriminator="type")]


@dataclass(frozen=True)
class Constraint:
    """What a reply must be. ``content``: the JSON Schema of a JSON reply; ``call``: of one call's body
    (``{"name": ..., "arguments": ...}``) between ``open`` and ``close``; None: not allowed. ``fields``:
    the client's field of each schema a failed compile may be blamed on, with the schema (the content's
    first, then each tool's parameters)."""

    content: str | None
    call: str | None
    parallel: bool
    fields: tuple[tuple[str, str], ...]
    open: str = OPEN + "\n"
    close: str = "\n" + CLOSE


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _arguments(tool: Tool) -> dict[str, Any]:
    """A tool's arguments schema: an object (its parameters' top may leave the type out), closed
    (``tools.closed``: a small model otherwise invents properties until ``max_tokens``)."""
    parameters = tool.function.parameters
    return NO_ARGUMENTS if parameters is None else closed({**parameters, "type": "object"})


def constraint(response_format: Any, tools: ToolsMixin) -> Constraint | None:
    """The constraint ``response_format`` and ``tool_choice`` put on a reply (None: free text)."""
    fields: list[tuple[str, str]] = []
    content = None
    if isinstance(response_format, ResponseFormatJSONObject):
        content = _dumps(ANY_OBJECT)
    elif isinstance(response_format, ResponseFormatJSONSchema):
        spec = response_format.json_schema
        schema = ANY_OBJECT if spec.schema_ is None else spec.schema_
        content = _dumps(closed(schema) if spec.strict else schema)
        fields.append(("response_format.json_schema.schema", content))
    choice = tools.tool_choice
    offered = bool(tools.tools) and choice != "none"
    if choice == "required" or isinstance(choice, NamedToolChoice):
        content, fields = None, []  # a call is the answer: no JSON content
    elif not offered or content is None:  # auto without JSON asked: unconstrained, as before
        return None if content is None else Constraint(content, None, False, tuple(fields))
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    bodies = []
    for i, tool in enumerate(tools.tools or ()):
        if named is not None and tool.function.name != named:
            continue
        arguments = _arguments(tool)
        bodies.append({"type": "object", "properties": {"name": {"const": tool.function.name},
                                                        "arguments": arguments},
                       "required": ["name", "arguments"], "additionalProperties": False})
        fields.append((f"tools.{i}.function.parameters", _dumps(arguments)))
    call = _dumps(bodies[0] if len(bodies) == 1 else {"anyOf": bodies})
    return Constraint(content, call, tools.parallel and named is None, tuple(fields))


def blamed(constraint: Constraint | None) -> str:
    """The field a grammar that failed as a whole is blamed on."""
    return "tool_choice" if constraint is not None and constraint.call is not None else "response_format"


class ConstraintError(ValueError):
    """A constraint the grammar library cannot compile: the client's field to blame, and why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def compiled(runtime: ModelRuntime, constraint: Constraint) -> Compiled:
    """Worker thread: the constraint as the model room's compiled grammar (cached there per grammar). A
    ConstraintError names the first schema the library cannot compile on its own (else ``tool_choice`` or
    ``response_format``: the grammar as a whole)."""
    from pfec.common.model import constrained  # deferred: torch

    grammar = constrained.Grammar(constraint.content, constraint.call, constraint.open, constraint.close,
                                  constraint.parallel)
    try:
        return constrained.compile_grammar(runtime, grammar)
    except constrained.GrammarError as exc:
        try:
            culprit = constrained.first_error(runtime, [schema for _, schema in constraint.fields])
        except constrained.GrammarError:  # the tokenizer, not a schema
            culprit = None
        field, why = blamed(constraint), str(exc)
        if culprit is not None:
            field, why = constraint.fields[culprit[0]][0], culprit[1]
        raise ConstraintError(field, f"{field}: the grammar library ({constrained.LIBRARY}) cannot compile "
                              f"it: {why}") from None
