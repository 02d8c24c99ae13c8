"""Triton: POST /v2/models/{model}/generate, /generate_stream, /infer; GET /v2/models/{model},
/v2/health/ready, /v2/health/live. Errors are {"error": ...} with 400; after the first event of a
stream an error is sent as a data event."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bridges import textgen
from bridges.common import (BridgeError, bridge_error_from, collect, endpoint, engine_of, primed, read_json,
                            replay, request_id, sse, sse_response)


def render_error(err: BridgeError) -> dict[str, Any]:
    return {"error": err.message}


def _model(request: Request) -> str:
    name = request.path_params["model"]
    served = engine_of(request).model_info.name
    if name != served:
        raise BridgeError(404, f"Request for unknown model: '{name}' is not found (serving '{served}')",
                          param="model")
    return name


async def _read(request: Request, schema: str) -> dict[str, Any]:
    try:
        return await read_json(request, schema)
    except BridgeError as err:
        err.status = 400  # Triton answers every malformed request with 400
        raise


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


async def _lower_text_request(request: Request) -> tuple[str, dict[str, Any], Any, str, textgen.TextGenRequest]:
    """(model, body, engine, id, lowered request) of a generate / generate_stream call."""
    model = _model(request)
    body = await _read(request, "triton-generate")
    engine = engine_of(request)
    rid = body.get("id") or request_id("triton")
    return model, body, engine, rid, await textgen.lower(engine, rid, body["text_input"], body.get("parameters"))


@endpoint(render_error)
async def generate(request: Request) -> Response:
    model, body, engine, rid, tg = await _lower_text_request(request)
    (c,) = await collect(engine, tg.request)
    result: dict[str, Any] = {"id": rid, "model_name": model, "model_version": None, "text_output": c.text}
    if tg.details or tg.perf_stat:
        details: dict[str, Any] = {"finish_reason": textgen.finish_reason(c.finish_reason, c.stop_reason),
                                   "generated_tokens": len(c.token_ids), "first_token_cost": None,
                                   "decode_cost": None}
        if tg.perf_stat:
            # per-token latency is only known on the stream; the whole-call split is reported here
            details["perf_stat"] = [[t, None] for t in c.token_ids]
            details["queue_wait_time"] = round(c.queue_s * 1e6)
            details["prefill_time"] = _ms(c.prefill_s)
            details["decode_time"] = _ms(c.decode_s)
        result["details"] = details
    return JSONResponse(result, headers=textgen.ignored_header(tg))


@endpoint(render_error)
async def generate_stream(request: Request) -> Response:
    model, body, engine, rid, tg = await _lower_text_request(request)
    first, rest = await primed(engine, tg.request)
    batch_size = (body.get("parameters") or {}).get("batch_size") or 1

    async def events() -> AsyncIterator[bytes]:
        perf: list[list[Any]] = []
        try:
            async with aclosing(replay(first, rest)) as outs:
                async for out in outs:
                    if not out.new_token_ids and not out.finished:
                        continue
                    t = out.timings
                    is_first = out.num_output_tokens == len(out.new_token_ids)
                    latency = t.prefill_s if is_first else t.last_token_gap_s
                    perf += [[tid, _ms(latency)] for tid in out.new_token_ids]
                    event: dict[str, Any] = {"id": rid, "model_name": model, "model_version": None,
                                             "text_output": out.text_delta}
                    if tg.details or tg.perf_stat:
                        details: dict[str, Any] = {"generated_tokens": out.num_output_tokens,
                                                   "first_token_cost": None, "decode_cost": None,
                                                   "batch_size": batch_size,
                                                   "queue_wait_time": round(t.queue_s * 1e6)}
                        if out.finished:
                            details = {"finish_reason": textgen.finish_reason(out.finish_reason, out.stop_reason),
                                       **details}
                        if tg.perf_stat:
                            details["perf_stat"] = list(perf)
                        event["details"] = details
                    event["prefill_time"] = _ms(t.prefill_s) if is_first else None
                    event["decode_time"] = None if is_first else _ms(t.last_token_gap_s)
                    yield sse(event)
        except Exception as exc:  # the stream has started: the error goes in a data event
            yield sse(render_error(bridge_error_from(exc)))

    resp = sse_response(events())
    resp.headers.update(textgen.ignored_header(tg))
    return resp


@endpoint(render_error)
async def infer(request: Request) -> Response:
    _model(request)
    body = await _read(request, "triton-infer")
    engine = engine_of(request)
    rid = body.get("id") or request_id("triton")
    tensor = body["inputs"][0]
    shape = tensor["shape"]
    if shape[-1] != len(tensor["data"]) or (len(shape) == 2 and shape[0] != 1):
        raise BridgeError(400, f"inputs[0].shape {shape} does not match {len(tensor['data'])} data items")
    tg = await textgen.lower(engine, rid, tensor["data"], body.get("parameters"))
    (c,) = await collect(engine, tg.request)
    # as the spec's example: the input ids followed by the generated ids
    data = list(tensor["data"]) + c.token_ids
    return JSONResponse({"id": rid, "outputs": [{"name": body["outputs"][0]["name"], "shape": [1, len(data)],
                                                 "datatype": "UINT32", "data": data}]},
                        headers=textgen.ignored_header(tg))


async def model_metadata(request: Request) -> Response:
    try:
        name = _model(request)
    except BridgeError as err:
        return JSONResponse(render_error(err), status_code=404)
    info = engine_of(request).model_info
    return JSONResponse({"name": name, "versions": ["1"], "platform": "spark-server", "max_model_len": info.max_model_len,
                         "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
                         "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]})


async def health_ready(request: Request) -> Response:
    engine = getattr(request.app.state, "engine", None)
    ready = engine is not None and engine.is_healthy()
    return Response(status_code=200 if ready else 503)


async def health_live(request: Request) -> Response:
    return Response(status_code=200)


ROUTES = [
    Route("/v2/models/{model}/generate", generate, methods=["POST"]),
    Route("/v2/models/{model}/generate_stream", generate_stream, methods=["POST"]),
    Route("/v2/models/{model}/infer", infer, methods=["POST"]),
    Route("/v2/models/{model}", model_metadata, methods=["GET"]),
    Route("/v2/health/ready", health_ready, methods=["GET"]),
    Route("/v2/health/live", health_live, methods=["GET"]),
]
