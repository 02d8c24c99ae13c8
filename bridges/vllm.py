"""vLLM native POST /generate. Non-stream: {"text": [prompt + output]}. Stream, as the spec: each
delta as {"text": [delta]} followed by "\\0"; `--vllm-stream cumulative` sends what vLLM's own server
sends, {"text": [prompt + output so far]} followed by "\\n". `--full-text-enabled` makes deltas
cumulative (output only)."""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from bridges.common import (BridgeError, collect, endpoint, ending_with_error_event, engine_of, int_list, primed,
                            read_json, replay, request_id, served_model_or_adapter, stop_list)
from engine.protocol import EngineClient
from engine.request import GenerationRequest, TextPrompt
from engine.sampling_params import SamplingParams


def render_error(err: BridgeError) -> dict[str, Any]:
    return {"error": err.message, "object": "error", "type": err.kind, "param": err.param, "code": err.status}


def lower(request: Request, engine: EngineClient, body: dict[str, Any], rid: str) -> GenerationRequest:
    lora = served_model_or_adapter(request, body.get("model"))
    params = SamplingParams(
        max_tokens=body.get("max_tokens") or engine.model_info.max_model_len,
        temperature=1.0 if body.get("temperature") is None else float(body["temperature"]),
        top_p=float(body.get("top_p") or 1.0), top_k=body.get("top_k") or 0, min_p=body.get("min_p") or 0.0,
        repetition_penalty=float(body.get("repetition_penalty") or 1.0),
        presence_penalty=float(body.get("presence_penalty") or 0.0),
        frequency_penalty=float(body.get("frequency_penalty") or 0.0),
        seed=body.get("seed"), stop=stop_list(body.get("stop")),
        # the spec: ids beyond int32 are ignored
        stop_token_ids=[t for t in int_list(body.get("stop_token_ids")) if 0 <= t < 2**31],
        include_stop_str_in_output=bool(body.get("include_stop_str_in_output")),
        skip_special_tokens=body.get("skip_special_tokens") is not False,
        ignore_eos=bool(body.get("ignore_eos")), min_tokens=body.get("min_tokens") or 0,
    )
    return GenerationRequest(rid, TextPrompt(body["prompt"]), params, lora=lora)


@endpoint(render_error)
async def generate(request: Request) -> Response:
    engine = engine_of(request)
    body = await read_json(request, "vllm-generate")
    req = lower(request, engine, body, request_id("vllm"))
    settings = request.app.state.settings
    if not body.get("stream"):
        (c,) = await collect(engine, req)
        return JSONResponse({"text": [body["prompt"] + c.text]})
    first, rest = await primed(engine, req)
    cumulative = settings.vllm_stream == "cumulative"

    async def chunks() -> AsyncIterator[bytes]:
        text = ""
        async with aclosing(replay(first, rest)) as outs:
            async for out in outs:
                if not out.text_delta and not out.finished:
                    continue
                text += out.text_delta
                if cumulative:
                    yield (json.dumps({"text": [body["prompt"] + text]}, ensure_ascii=False) + "\n").encode()
                elif out.text_delta:
                    shown = text if settings.full_text_enabled else out.text_delta
                    yield json.dumps({"text": [shown]}, ensure_ascii=False).encode() + b"\0"

    def error_event(err: BridgeError) -> bytes:
        return json.dumps(render_error(err), ensure_ascii=False).encode() + (b"\n" if cumulative else b"\0")

    return StreamingResponse(ending_with_error_event(chunks(), error_event), media_type="application/json")
