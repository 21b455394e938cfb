"""What the OpenAI face's endpoints share below their own shapes: a request's job between the event loop
and the model worker (``Job``, ``Served``, ``consume``), the errors it may end in (``ServingError``,
OpenAI's error body) and the strict reading of a request body (``read_body``).

``openai.http`` (chat and completions) and ``openai.responses`` (the Responses API) both build on it;
neither imports the other's handlers through it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from pfec.common.node.control import MAX_BODY_KEY
from pfec.common.node.openai.models import openai_error, validation_error
from pfec.common.plan.handoff import json_depth

if TYPE_CHECKING:
    from pfec.common.model.serving import Completion

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger("pfec.openai")
IGNORED_HEADER = "X-PFEC-Ignored-Fields"  # the accepted fields a request sent that changed nothing


class ServingError(ValueError):
    """A request the node cannot serve: the parameter, the reason and the HTTP status."""

    def __init__(self, param: str | None, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


class Disconnected(Exception):
    """The streaming client went away: the job stops at its next token."""


@dataclass
class Served:
    """What the worker job returns to the handler."""

    completion: Completion
    origin: dict[str, Any] = field(default_factory=dict)  # where the cached tokens came from


@dataclass
class Job:
    """A request's hop between the loop and the worker thread."""

    loop: asyncio.AbstractEventLoop
    started: asyncio.Event = field(default_factory=asyncio.Event)
    texts: asyncio.Queue[str] = field(default_factory=asyncio.Queue)
    gone: threading.Event = field(default_factory=threading.Event)

    def mark_started(self) -> None:  # worker thread
        self.loop.call_soon_threadsafe(self.started.set)

    def on_text(self, text: str) -> None:  # worker thread
        if self.gone.is_set():
            raise Disconnected
        self.loop.call_soon_threadsafe(self.texts.put_nowait, text)


def consume(future: asyncio.Future[Any]) -> None:
    """Retrieve the outcome of a job nobody awaits (its client left; a cache's upkeep)."""
    if future.cancelled():
        return
    exc = future.exception()
    if exc is not None and not isinstance(exc, Disconnected):
        log.warning("a serving job nobody awaited failed: %r", exc)


def error_response(exc: ServingError) -> web.Response:
    kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
    return web.json_response(openai_error(str(exc), exc.param, kind), status=exc.status)


async def read_body(request: web.Request, model: type[M], max_depth: int) -> M | web.Response:
    """The body validated strictly as ``model``: 413 over the control API's body limit, 400 for JSON
    nested past the depth limit, not JSON, or any field out of bounds (the first bad field named)."""
    limit = request.config_dict.get(MAX_BODY_KEY, 1 << 20)
    if request.content_length is not None and request.content_length > limit:
        return web.json_response(openai_error(f"request body of {request.content_length} bytes is above the "
                                              f"{limit}-byte limit"), status=413)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return web.json_response(openai_error(f"request body is above the {limit}-byte limit"), status=413)
    depth = json_depth(raw)
    if depth > max_depth:
        return web.json_response(openai_error(f"request body nests JSON {depth} levels deep, above the limit "
                                              f"of {max_depth}"), status=400)
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        return web.json_response(validation_error(exc, raw), status=400)


def ignored_header(names: list[str]) -> dict[str, str]:
    """The response header naming the fields a request sent that changed nothing (none: no header)."""
    return {IGNORED_HEADER: ", ".join(names)} if names else {}
