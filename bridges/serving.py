"""The one serving path every HTTP protocol goes through (SGLang's ``OpenAIServingBase``, TGI's single
error conversion): read and validate the body, lower it, start every engine request and wait for its
first output before committing to a 200, then stream or collect, and render. A protocol supplies only
what is its own, as a ``Handler``: its schema, ``lower``, ``render_stream`` / ``render_final`` and its
error forms. Errors are mapped in one place: a status code before the first byte (``endpoint``), the
protocol's own error event after it (``ending_with_error_event``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from bridges.common import (BridgeError, Completion, check_fan_out, collect_all, endpoint, ending_with_error_event,
                            merged, read_json, sse, start_streams)
from engine.request import GenerationRequest, RequestOutput

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class Plan:
    """A lowered request: what goes to the engine, and what rendering needs to know about it."""

    requests: list[GenerationRequest]
    stream: bool
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)  # e.g. X-Ignored-Parameters
    context: Any = None  # the protocol's own (model name, response id, shape switches...)


class Handler:
    """One protocol operation. Subclasses set ``schema`` and implement ``lower`` and the renderers."""

    schema: str = ""
    invalid_status: int = 400  # a body that parses but is invalid (TGI: 422)
    media_type: str = "text/event-stream"

    def render_error(self, err: BridgeError) -> dict[str, Any]:
        raise NotImplementedError

    def error_event(self, err: BridgeError, plan: Plan) -> bytes:
        """A failure after the first byte, in the stream's own framing."""
        return sse(self.render_error(err))

    async def read(self, request: Request) -> dict[str, Any]:
        return await read_json(request, self.schema)

    async def lower(self, request: Request, body: dict[str, Any]) -> Plan:
        raise NotImplementedError

    def render_stream(self, request: Request, plan: Plan,
                      outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[bytes]:
        """The stream's events from (request position, output) pairs as they come."""
        raise NotImplementedError

    async def render_final(self, request: Request, plan: Plan, results: list[list[Completion]]) -> Response:
        """The whole answer: per request, its samples."""
        raise NotImplementedError


async def serve(request: Request, handler: Handler) -> Response:
    body = await handler.read(request)
    plan = await handler.lower(request, body)
    check_fan_out(request, len(plan.requests), max(r.params.n for r in plan.requests))
    if plan.stream:
        # every request admitted and its first output in before the 200: a refusal is still a 4xx
        streams = await start_streams(request, plan.requests)
        events = ending_with_error_event(handler.render_stream(request, plan, merged(streams)),
                                         lambda err: handler.error_event(err, plan))
        headers = {**SSE_HEADERS, **plan.headers} if handler.media_type == "text/event-stream" else plan.headers
        return StreamingResponse(events, media_type=handler.media_type, headers=headers)
    response = await handler.render_final(request, plan, await collect_all(request, plan.requests))
    response.headers.update(plan.headers)
    return response


def route(handler: Handler):
    """The Starlette endpoint of a handler: ``serve`` with every failure in that protocol's error form."""

    async def run(request: Request) -> Response:
        return await serve(request, handler)

    run.__name__ = type(handler).__name__
    return endpoint(handler.render_error, invalid_status=handler.invalid_status)(run)
