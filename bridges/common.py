"""What every HTTP bridge shares: body parsing and validation, request ids, SSE framing, and streaming
that reports early errors with a proper status (errors themselves: bridges/errors.py's one table)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import ClientDisconnect, HTTPConnection, Request
from starlette.responses import JSONResponse, Response

import schemas
from bridges.context import ServingContext
from bridges.errors import BridgeError, ErrorInfo, error_info
from bridges.validation_worker import shared_worker
from engine.request import GenerationRequest, LoraRef, RequestOutput, TokenLogprob
from schemas.json_body import JsonBodyError, JsonSyntaxError, parse_json

logger = logging.getLogger("spark_server.requests")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer; nobody reads it


def requested_adapter(ctx: ServingContext, name: Any) -> LoraRef | None:
    """The adapter a request's model name selects, None for the served model (also when the name is
    omitted, empty, "default" or "null", as vLLM and FastDeploy accept, or one of its further names),
    or 404 naming what exists."""
    served = ctx.model.name
    if name in (None, "", "default", "null", "None", served) or name in ctx.options.model_aliases:
        return None
    if name in ctx.adapters:
        return LoraRef(name=name)
    known = ", ".join([served, *ctx.adapters.registered])
    raise BridgeError(404, f"The model `{name}` does not exist (served: {known}).", param="model",
                      kind="model_not_found")


async def read_json(request: Request, schema: str, max_items: int) -> dict[str, Any]:
    """The request's body: JSON (at most ``max_items`` values in an array or object), an object, valid
    against ``schema``; a large body is parsed and checked off the event loop."""
    raw = await request.body()
    if len(raw) > schemas.OFF_LOOP_BYTES:
        return await checked_body(await schemas.off_loop(parse_body, raw, max_items), schema, large=True)
    return _checked_body(raw, max_items, schema)


async def read_any_json(request: Request, max_items: int) -> Any:
    """The request's body as JSON of any shape (a shared path's dispatcher looks at it before a schema
    is chosen); a large body is parsed off the event loop."""
    raw = await request.body()
    if len(raw) > schemas.OFF_LOOP_BYTES:
        return await schemas.off_loop(parse_body, raw, max_items)
    return parse_body(raw, max_items)


async def checked_body(body: Any, schema: str, large: bool) -> dict[str, Any]:
    """A parsed body as an object valid against ``schema``; ``large``: checked in the validation worker
    process (schemas/off_process.py), off the event loop and the serving process's GIL."""
    if not large:
        return _checked(body, schema)
    if not isinstance(body, dict):
        raise BridgeError(400, "request body must be a JSON object")
    violation = await schemas.off_loop(shared_worker().first_violation, schema, body)
    if violation is not None:
        raise _refusal(*violation)
    return body


def _checked_body(raw: bytes, max_items: int, schema: str) -> dict[str, Any]:
    return _checked(parse_body(raw, max_items), schema)


def _checked(body: Any, schema: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BridgeError(400, "request body must be a JSON object")
    check(schema, body)
    return body


def parse_body(raw: bytes, max_items: int) -> Any:
    """The body as JSON (UTF-8, bounded depth and sizes, no lone surrogates), or a 400 saying what is wrong."""
    try:
        return parse_json(raw, max_items=max_items)
    except JsonSyntaxError as exc:
        raise BridgeError(400, exc.message.replace("request is", "request body is", 1), kind="invalid_json") from None
    except JsonBodyError as exc:
        raise BridgeError(400, exc.message) from None


def parse_json_field(text: str, field: str) -> Any:
    """JSON text a request carries inside a string (a schema, a tool call's arguments), parsed exactly
    as bodies are (UTF-8, no NaN, at most 64 levels deep): deep nesting is a 400 naming the field,
    never a RecursionError (a 500) from plain json.loads."""
    try:
        return parse_json(text)
    except JsonBodyError as exc:
        message = exc.message.replace("request is not", "is not", 1).replace("the request nests", "nests", 1)
        # "$..." is the place inside the text: under the field's own name
        message = field + (message[1:] if message.startswith("$") else " " + message)
        raise BridgeError(400, message, param=field) from None


def check(schema: str, body: Any) -> None:
    error = schemas.first_error(schema, body)
    if error is not None:
        raise _refusal(schemas.describe(error), list(error.absolute_path))


def _refusal(message: str, path: list[str | int]) -> BridgeError:
    return BridgeError(400, message, param=".".join(str(p) for p in path) or None)


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse(data: Any) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


async def ending_with_error_event(events: AsyncGenerator[bytes, None],
                                  error_event: Callable[[ErrorInfo], bytes]) -> AsyncGenerator[bytes, None]:
    """A stream whose failure after the first byte (the status is sent by then) ends it with the
    protocol's own error event, never a cut connection."""
    try:
        async with aclosing(events):
            async for chunk in events:
                yield chunk
    except Exception as exc:
        yield error_event(error_info(exc))


def client_identity(connection: HTTPConnection, key: str | None = None) -> str | None:
    """Who a request comes from, for the scheduler's fair share of the running slots between clients: the
    name of the credential that let it in where credentials tell clients apart (a Spark signing key), else
    the peer's IP address (not the port: one client's many connections are one client). The one --api-key
    is shared by every client, so it names none."""
    if key:
        return f"key:{key}"
    peer = connection.client
    return f"addr:{peer.host}" if peer is not None and peer.host else None


async def _generate(ctx: ServingContext, req: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
    await ctx.adapters.resolve(req)
    async with aclosing(ctx.engine.generate(req)) as stream:
        async for out in stream:
            yield out


async def primed(ctx: ServingContext, req: GenerationRequest
                 ) -> tuple[RequestOutput, AsyncGenerator[RequestOutput, None]]:
    """Start generating and wait for the first output, so errors before it still get a 4xx/5xx status
    instead of a 200 stream. The caller must close the returned iterator (or exhaust it)."""
    stream = _generate(ctx, req)
    try:
        first = await stream.__anext__()
    except BaseException:
        await stream.aclose()
        raise
    return first, stream


async def replay(first: RequestOutput, rest: AsyncGenerator[RequestOutput, None]
                 ) -> AsyncGenerator[RequestOutput, None]:
    async with aclosing(rest):
        yield first
        async for out in rest:
            yield out


@dataclass(slots=True)
class Completion:
    """Everything a non-streaming answer needs, per sample index."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)  # per token, the text it released (RequestOutput's)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    token_latencies_s: list[float] = field(default_factory=list)  # per token: the time it took
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    first_token_s: float | None = None
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0


def by_logprob(comps: list[Completion], length_penalty: float | None = None) -> list[Completion]:
    """Samples from the highest cumulative logprob down (best_of, in vLLM's and TGI's sense); with
    ``length_penalty`` a sample's score is divided by its length ** length_penalty, as in beam search."""
    penalty = 0.0 if length_penalty is None else length_penalty

    def score(c: Completion) -> float:
        return sum(e.logprob for e in c.logprobs) / (max(1, len(c.token_ids)) ** penalty)

    return sorted(comps, key=score, reverse=True)


async def collect(ctx: ServingContext, req: GenerationRequest) -> list[Completion]:
    done = {i: Completion(i) for i in range(req.params.n)}
    async with aclosing(_generate(ctx, req)) as stream:
        async for out in stream:
            c = done[out.index]
            c.text += out.text_delta
            if out.new_token_ids:  # the first token took the prefill; later ones the gap before them
                gaps = [out.timings.last_token_gap_s] * len(out.new_token_ids)
                if not c.token_ids:
                    gaps[0] = out.timings.prefill_s
                c.token_latencies_s += gaps
            c.token_ids += out.new_token_ids
            if out.new_token_ids:
                c.token_texts += out.texts_per_token()
            elif out.text_delta:  # text released with no token (a held stop-string prefix): the last token's
                c.token_texts[-1:] = ["".join(c.token_texts[-1:]) + out.text_delta]
            c.logprobs += out.logprobs or []
            if out.prompt_logprobs is not None:
                c.prompt_logprobs = out.prompt_logprobs
            c.num_prompt_tokens = out.num_prompt_tokens
            c.num_cached_tokens = out.num_cached_tokens
            t = out.timings
            c.first_token_s, c.queue_s, c.prefill_s, c.decode_s = t.first_token_s, t.queue_s, t.prefill_s, t.decode_s
            if out.finished:
                c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
    return [done[i] for i in sorted(done)]


def error_response(info: ErrorInfo, render: Callable[[ErrorInfo], dict[str, Any]],
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """``info`` rendered by a protocol's ``render``, with its status (and Retry-After where retrying helps)."""
    return JSONResponse(render(info), status_code=info.status,
                        headers={"Retry-After": "1", **(headers or {})} if info.retry_after else headers)


def protocol_status(info: ErrorInfo, invalid_status: int = 400, statuses: dict[int, int] | None = None) -> ErrorInfo:
    """``info`` with the status a protocol answers it with: ``invalid_status`` for a request that parses
    as JSON but is invalid (TGI's 422), and the protocol's own for a few (``statuses``: Anthropic's 529)."""
    status = invalid_status if info.status == 400 and info.kind != "invalid_json" else info.status
    return info.with_status((statuses or {}).get(status, status))


async def _client_disconnected(request: Request) -> None:
    """Returns when the client hangs up (call only after the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work``; if the client hangs up first, cancel it, which aborts its engine requests (a
    non-streaming completion would otherwise keep generating for nobody, as vLLM's
    ``with_cancellation`` avoids too). Streaming responses watch for disconnects themselves."""
    try:
        await request.body()  # cached for the handler; the watcher may only read what comes after it
    except ClientDisconnect:  # gone mid-body: nobody to answer, and not a server error
        if asyncio.iscoroutine(work):
            work.close()
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_client_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return task.result()


def endpoint(render: Callable[[ErrorInfo], dict[str, Any]], invalid_status: int = 400,
             statuses: dict[int, int] | None = None):
    """Wrap a handler so any failure becomes that protocol's error body with the right status, and a
    client that hangs up cancels the work. ``invalid_status``: the status of a request that parses as
    JSON but is invalid (TGI answers 422; a body that is not JSON stays 400). ``statuses``: a
    protocol's own status for one of the common ones (Anthropic: 529 for a busy server)."""

    def wrap(handler: Callable[..., Awaitable[Response]]):
        async def run(request: Request, *args: Any) -> Response:  # args: the serving context, a parsed body
            try:
                return await unless_disconnected(request, handler(request, *args))
            except Exception as exc:
                err = protocol_status(error_info(exc), invalid_status, statuses)
                if err.status >= 500:
                    logger.error("request id=%s path=%s failed with %d: %s", getattr(request.state, "request_id", "-"),
                                 request.url.path, err.status, err.message, exc_info=exc)
                return error_response(err, render)

        run.__name__ = handler.__name__
        run.__doc__ = handler.__doc__
        if getattr(handler, "takes_context", False):
            run.takes_context = True  # type: ignore[attr-defined]
        return run

    return wrap


def int_list(values: list[Any] | None) -> list[int]:
    """Token ids from JSON: JSON Schema's "integer" admits 7.0, the engine wants 7."""
    return [int(v) for v in values or []]


def stop_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else [s for s in value if s]


async def merged(streams: list[AsyncGenerator[RequestOutput, None]]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave several engine streams as outputs arrive; (stream position, output)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:  # leaving early aborts the engine request at once
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as exc:  # surfaces in the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def check_fan_out(limit: int, num_prompts: int, n: int) -> None:
    """A request may start at most ``limit`` (--max-seqs-per-request) sequences (prompts x n), checked
    before any."""
    if num_prompts * n > limit:
        raise BridgeError(400, f"{num_prompts} prompt(s) x n={n} would start {num_prompts * n} sequences; at most "
                               f"{limit} per request (--max-seqs-per-request)", param="n")


async def start_streams(ctx: ServingContext, reqs: list[GenerationRequest]
                        ) -> list[AsyncGenerator[RequestOutput, None]]:
    """Prime every request (errors before the first token get a proper status), then stream them.
    All or nothing: when one is refused, the ones already started are aborted."""
    started: list[tuple[RequestOutput, AsyncGenerator[RequestOutput, None]]] = []
    try:
        for r in reqs:
            started.append(await primed(ctx, r))
    except BaseException:
        for _, rest in started:
            await rest.aclose()  # leaves the engine stream early: aborts it and frees its cache
        raise
    return [replay(first, rest) for first, rest in started]


async def collect_all(ctx: ServingContext, reqs: list[GenerationRequest]) -> list[list[Completion]]:
    """``collect`` for a fan-out (prompt lists, batches), all or nothing: when one request fails, the
    others are cancelled, which aborts their engine requests, and the failure is raised."""
    tasks = [asyncio.ensure_future(collect(ctx, r)) for r in reqs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
