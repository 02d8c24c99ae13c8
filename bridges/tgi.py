"""TGI: POST /generate, POST /generate_stream, and with --tgi-compat hf the root POST / of the HF
`text_generation` client. Spec shape by default (token id as a list, special null); HF shape with an
int id and a bool special."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bridges import textgen
from bridges.common import (BridgeError, collect, endpoint, ending_with_error_event, engine_of, primed, read_json,
                            replay, request_id, sse, sse_response)
from engine.protocol import EngineClient


def render_error(err: BridgeError) -> dict[str, Any]:
    kinds = {422: "validation", 400: "validation", 404: "validation", 429: "overloaded", 503: "overloaded",
             504: "generation"}
    return {"error": err.message, "error_type": kinds.get(err.status, "generation")}


# TGI answers 422 for a body that parses but is invalid (400 only for one that is not JSON)
tgi_endpoint = endpoint(render_error, invalid_status=422)


async def _read(request: Request) -> dict[str, Any]:
    return await read_json(request, "tgi-generate")


class Shape:
    def __init__(self, hf: bool, full_text: bool) -> None:
        self.hf = hf
        self.full_text = full_text

    def token(self, engine: EngineClient, token_id: int, text: str, logprob: float | None) -> dict[str, Any]:
        if self.hf:
            return {"id": token_id, "text": text, "logprob": logprob,
                    "special": token_id in engine.tokenizer.all_special_ids}
        return {"id": [token_id], "text": text, "logprob": None, "special": None}


def _shape(request: Request) -> Shape:
    s = request.app.state.settings
    return Shape(hf=s.tgi_compat == "hf", full_text=s.full_text_enabled)


async def generate_response(request: Request, body: dict[str, Any], shape: Shape) -> tuple[dict[str, Any], dict]:
    engine = engine_of(request)
    tg = await textgen.lower(engine, request_id("tgi"), body["inputs"], body.get("parameters"))
    (c,) = await collect(engine, tg.request)
    text = (body["inputs"] if tg.return_full_text else "") + c.text
    result: dict[str, Any] = {"generated_text": text}
    if tg.details or tg.decoder_input_details or shape.hf:
        lp = {e.token_id: e for e in c.logprobs}
        tokens = [shape.token(engine, t, engine.tokenizer.decode([t]), lp[t].logprob if t in lp else None)
                  for t in c.token_ids]
        details: dict[str, Any] = {"finish_reason": textgen.finish_reason(c.finish_reason, c.stop_reason),
                                   "generated_tokens": len(c.token_ids), "seed": tg.seed,
                                   "prompt_tokens": c.num_prompt_tokens, "prefill": [], "tokens": tokens}
        if tg.decoder_input_details:
            ids = await engine.encode_prompt(tg.request.prompt)
            details["prefill"] = [{"id": i, "text": engine.tokenizer.decode([i]), "logprob": None,
                                   **({} if shape.hf else {"special": None})} for i in ids]
        if tg.top_n_tokens:
            details["top_tokens"] = [[shape.token(engine, t, engine.tokenizer.decode([t]), v) for t, v in e.top]
                                     for e in c.logprobs]
        result["details"] = details
    return result, textgen.ignored_header(tg)


async def stream_events(request: Request, body: dict[str, Any], shape: Shape) -> tuple[AsyncIterator[bytes], dict]:
    engine = engine_of(request)
    tg = await textgen.lower(engine, request_id("tgi"), body["inputs"], body.get("parameters"))
    if tg.decoder_input_details:  # the spec: "对于流式接口，该参数只能为false"
        raise BridgeError(422, "decoder_input_details must be false on a stream (the prompt's tokens are only "
                               "returned by the non-streaming /generate)", param="decoder_input_details")
    first, rest = await primed(engine, tg.request)

    async def events() -> AsyncIterator[bytes]:
        text = ""
        async with aclosing(replay(first, rest)) as outs:
            async for out in outs:
                ids = out.new_token_ids or ([] if not out.finished else [])
                lps = {e.token_id: e.logprob for e in out.logprobs or []}
                for k, token_id in enumerate(ids):
                    last = k == len(ids) - 1
                    delta = out.text_delta if last else ""
                    text += delta
                    shown = text if shape.full_text else delta
                    event: dict[str, Any] = {"token": shape.token(engine, token_id, shown, lps.get(token_id)),
                                             "generated_text": None, "details": None}
                    if shape.hf:
                        event["top_tokens"] = None
                    if last and out.finished:
                        event["generated_text"] = (body["inputs"] if tg.return_full_text else "") + text
                    if last and out.finished and tg.details:  # the spec: details only with details=true
                        event["details"] = {"finish_reason": textgen.finish_reason(out.finish_reason, out.stop_reason),
                                            "generated_tokens": out.num_output_tokens, "seed": tg.seed,
                                            "prompt_tokens": out.num_prompt_tokens}
                    yield sse(event)

    return ending_with_error_event(events(), lambda err: sse(render_error(err))), textgen.ignored_header(tg)


@tgi_endpoint
async def generate(request: Request) -> Response:
    body = await _read(request)
    shape = _shape(request)
    if body.get("stream"):
        events, headers = await stream_events(request, body, shape)
        resp = sse_response(events)
        resp.headers.update(headers)
        return resp
    result, headers = await generate_response(request, body, shape)
    return JSONResponse(result, headers=headers)


@tgi_endpoint
async def generate_stream(request: Request) -> Response:
    body = await _read(request)
    events, headers = await stream_events(request, body, _shape(request))
    resp = sse_response(events)
    resp.headers.update(headers)
    return resp


@tgi_endpoint
async def root(request: Request) -> Response:
    """The HF `text_generation` client: POST / with `stream`; non-stream answers a JSON array."""
    body = await _read(request)
    shape = Shape(hf=True, full_text=request.app.state.settings.full_text_enabled)
    if body.get("stream"):
        events, _ = await stream_events(request, body, shape)
        return sse_response(events)
    result, headers = await generate_response(request, body, shape)
    return JSONResponse([result], headers=headers)


def routes(settings: Any) -> list[Route]:
    out = [Route("/generate_stream", generate_stream, methods=["POST"])]
    if settings.tgi_compat == "hf":
        out.append(Route("/", root, methods=["POST"]))
    return out
