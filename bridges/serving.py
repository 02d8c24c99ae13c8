"""The one serving path every HTTP protocol goes through (SGLang's ``OpenAIServingBase``, TGI's single
error conversion): read and validate the body, lower it, start every engine request and wait for its
first output before committing to a 200, then stream or collect, and render. A protocol supplies only
what is its own, as a ``Handler``: its schema, ``lower``, ``render_stream`` / ``render_final`` and its
error forms. Errors are mapped in one place: a status code before the first byte (``endpoint``), the
protocol's own error event after it (``ending_with_error_event``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

import schemas
from bridges.answer_volume import RENDER_IN_THREAD_ENTRIES, check_answer_volume, collected_entries
from bridges.common import (
    Completion,
    check_fan_out,
    checked_body,
    client_identity,
    collect_all,
    ending_with_error_event,
    endpoint,
    merged,
    protocol_status,
    read_json,
    sse,
    start_streams,
)
from bridges.context import ServingContext, with_context
from bridges.errors import ErrorInfo
from engine.request import GenerationRequest, RequestOutput

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# The most JSON values one json.dumps call serializes when an answer is rendered (~1,000 logprob
# entries, a few milliseconds): the C encoder holds the GIL for the whole call, so one call over a
# 60 MB answer would stall the event loop for seconds even from a worker thread.
_PIECE_VALUES = 4096


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def _num_values(value: Any, cap: int) -> int:
    """How many JSON values ``value`` holds, itself included, counted up to ``cap``."""
    n, stack = 0, [value]
    while stack and n < cap:
        v = stack.pop()
        n += 1
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return n


def json_pieces(value: Any, out: list[str]) -> None:
    """``value`` as compact JSON (what JSONResponse writes), in pieces of at most ``_PIECE_VALUES``
    values each: a large container is split into its members, small neighbours grouped."""
    if _num_values(value, _PIECE_VALUES) < _PIECE_VALUES or not isinstance(value, (dict, list, tuple)) or (
            isinstance(value, dict) and not all(isinstance(k, str) for k in value)):
        out.append(_dumps(value))
        return
    if isinstance(value, dict):
        out.append("{")
        for i, (key, member) in enumerate(value.items()):
            out.append(("," if i else "") + _dumps(key) + ":")
            json_pieces(member, out)
        out.append("}")
        return
    out.append("[")
    group: list[Any] = []
    size, first = 0, True

    def flush() -> None:
        nonlocal group, size, first
        if group:
            out.append(("" if first else ",") + _dumps(group)[1:-1])
            group, size, first = [], 0, False

    for member in value:
        n = _num_values(member, _PIECE_VALUES)
        if n >= _PIECE_VALUES:
            flush()
            if not first:
                out.append(",")
            json_pieces(member, out)
            first = False
            continue
        if size + n > _PIECE_VALUES:
            flush()
        group.append(member)
        size += n
    flush()
    out.append("]")


class JSONAnswer(JSONResponse):
    """A JSON answer serialized in pieces (``json_pieces``): rendered in a worker thread, a large one
    leaves the event loop free between pieces."""

    def render(self, content: Any) -> bytes:
        out: list[str] = []
        json_pieces(content, out)
        return "".join(out).encode("utf-8")


C = TypeVar("C")  # a protocol's own rendering context


@dataclass
class Plan(Generic[C]):
    """A lowered request: what goes to the engine, and what rendering needs to know about it."""

    requests: list[GenerationRequest]
    stream: bool
    body: dict[str, Any]
    context: C  # the protocol's own (model name, response id, shape switches...): a small frozen dataclass
    headers: dict[str, str] = field(default_factory=dict)  # e.g. X-Ignored-Parameters


class Handler(Generic[C]):
    """One protocol operation. Subclasses set ``schema`` and implement ``lower`` and the renderers:
    ``lower(body, ctx)`` makes the plan from the body and the serving context alone (no request, no app);
    the renderers make the answer from the plan and the engine's outputs."""

    schema: str = ""
    invalid_status: int = 400  # a body that parses but is invalid (TGI: 422)
    statuses: ClassVar[dict[int, int]] = {}  # the protocol's own status for a common one (Anthropic: 429 -> 529)
    media_type: str = "text/event-stream"
    # the body fields an answer-volume refusal names: (prompt logprobs, the output's top candidates, the
    # output's logprobs)
    logprob_fields: tuple[str, str, str] = ("prompt_logprobs", "logprobs", "logprobs")

    def logprob_fields_of(self, body: dict[str, Any]) -> tuple[str, str, str]:
        """``logprob_fields`` for this body, where one field can ask for another's logprobs."""
        return self.logprob_fields

    def render_error(self, err: ErrorInfo) -> dict[str, Any]:
        """The protocol's error body for ``err`` (its status is the protocol's already)."""
        raise NotImplementedError

    def error_event(self, err: ErrorInfo, plan: Plan[C]) -> bytes:
        """A failure after the first byte, in the stream's own framing."""
        return sse(self.render_error(err))

    async def read(self, request: Request, ctx: ServingContext) -> dict[str, Any]:
        """The body, parsed and checked against ``schema``."""
        return await read_json(request, self.schema, ctx.options.max_request_items)

    async def lower(self, body: dict[str, Any], ctx: ServingContext) -> Plan[C]:
        raise NotImplementedError

    def render_stream(self, plan: Plan[C],
                      outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncGenerator[bytes, None]:
        """The stream's events from (request position, output) pairs as they come."""
        raise NotImplementedError

    async def render_final(self, plan: Plan[C], results: list[list[Completion]]) -> Response:
        """The whole answer: per request, its samples."""
        raise NotImplementedError


async def _body(request: Request, ctx: ServingContext, handler: Handler, parsed: Any, validated: bool
                ) -> dict[str, Any]:
    """The request's body checked against the handler's schema; ``parsed``: the body parsed already (a
    shared path's dispatcher parses it once to choose the protocol), else None; ``validated``: ``parsed``
    was read by the handler's own ``read`` already."""
    if validated:
        return parsed
    if parsed is None:
        return await handler.read(request, ctx)
    return await checked_body(parsed, handler.schema, large=len(await request.body()) > schemas.OFF_LOOP_BYTES)


async def serve(request: Request, ctx: ServingContext, handler: Handler, body: Any = None,
                validated: bool = False) -> Response:
    """The whole exchange: the body read and checked (unless given), lowered, the fan-out and answer
    volume checked, the engine requests started, and the answer streamed or collected and rendered."""
    body = await _body(request, ctx, handler, body, validated)
    plan = await handler.lower(body, ctx)
    check_fan_out(ctx.options.max_seqs_per_request, len(plan.requests), max(r.params.n for r in plan.requests))
    await check_answer_volume(ctx, plan.requests, handler.logprob_fields_of(plan.body))
    client = client_identity(request)
    for r in plan.requests:
        r.client = r.client or client
    if plan.stream:
        # every request admitted and its first output in before the 200: a refusal is still a 4xx
        streams = merged(await start_streams(ctx, plan.requests))
        rendered = handler.render_stream(plan, streams)
        events = ending_with_error_event(rendered, lambda err: handler.error_event(
            protocol_status(err, handler.invalid_status, handler.statuses), plan))
        headers = {**SSE_HEADERS, **plan.headers} if handler.media_type == "text/event-stream" else plan.headers
        return StreamingResponse(events, media_type=handler.media_type, headers=headers)
    results = await collect_all(ctx, plan.requests)
    if collected_entries(plan.requests, results) > RENDER_IN_THREAD_ENTRIES:
        # building and serializing a large answer takes seconds of CPU: not on the event loop, where it
        # would stall every other client (their WebSockets time out)
        response = await asyncio.to_thread(asyncio.run, handler.render_final(plan, results))
    else:
        response = await handler.render_final(plan, results)
    response.headers.update(plan.headers)
    return response


def route(handler: Handler):
    """The endpoint of a handler, called with the request and the serving context (and, on a path several
    protocols share, the body its dispatcher parsed): ``serve`` with every failure in that protocol's
    error form."""

    @with_context
    async def run(request: Request, ctx: ServingContext, body: Any = None) -> Response:
        return await serve(request, ctx, handler, body)

    run.__name__ = type(handler).__name__
    return endpoint(handler.render_error, invalid_status=handler.invalid_status, statuses=handler.statuses)(run)
