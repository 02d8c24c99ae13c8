"""MindIE native POST /infer: text, or an SSE stream with prefill_time / decode_time per token."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bridges import textgen
from bridges.common import (BridgeError, bridge_error_from, collect, endpoint, engine_of, primed, read_json, replay,
                            request_id, sse, sse_response)


def render_error(err: BridgeError) -> dict[str, Any]:
    return {"error": err.message, "error_type": err.kind}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


@endpoint(render_error)
async def infer(request: Request) -> Response:
    body = await read_json(request, "mindie-infer")
    engine = engine_of(request)
    tg = await textgen.lower(engine, request_id("mindie"), body["inputs"], body.get("parameters"))
    if not body.get("stream"):
        (c,) = await collect(engine, tg.request)
        result: dict[str, Any] = {"generated_text": c.text}
        if tg.details:  # the spec: details only when asked for
            result["details"] = {"finish_reason": textgen.finish_reason(c.finish_reason, c.stop_reason),
                                 "generated_tokens": len(c.token_ids), "seed": tg.seed}
        return JSONResponse(result, headers=textgen.ignored_header(tg))
    first, rest = await primed(engine, tg.request)

    async def events() -> AsyncIterator[bytes]:
        text = ""
        try:
            async with aclosing(replay(first, rest)) as outs:
                async for out in outs:
                    if not out.new_token_ids and not out.finished:
                        continue
                    text += out.text_delta
                    t = out.timings
                    is_first = out.num_output_tokens == len(out.new_token_ids)
                    event: dict[str, Any] = {"prefill_time": _ms(t.prefill_s) if is_first else None,
                                             "decode_time": None if is_first else _ms(t.last_token_gap_s)}
                    if out.finished:
                        event["generated_text"] = text
                    if out.finished and tg.details:
                        event["details"] = {"finish_reason": textgen.finish_reason(out.finish_reason, out.stop_reason),
                                            "generated_tokens": out.num_output_tokens, "seed": tg.seed}
                    event["token"] = {"id": out.new_token_ids, "text": out.text_delta}
                    yield sse(event)
        except Exception as exc:
            yield sse(render_error(bridge_error_from(exc)))

    resp = sse_response(events())
    resp.headers.update(textgen.ignored_header(tg))
    return resp


ROUTES = [Route("/infer", infer, methods=["POST"])]
