"""vLLM native POST /generate. Non-stream: {"text": [prompt + output]}. Stream, as the spec: each
delta as {"text": [delta]} followed by "\\0"; `--vllm-stream cumulative` sends what vLLM's own server
sends, {"text": [prompt + output so far]} followed by "\\n". `--full-text-enabled` makes deltas
cumulative (output only)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response

from bridges.common import Completion, request_id, requested_adapter
from bridges.context import ServingContext
from bridges.errors import ErrorInfo
from bridges.registry import Operation, Protocol
from bridges.sampling_table import sampling_kwargs
from bridges.serving import Handler, Plan, route
from engine.request import GenerationRequest, RequestOutput, TextPrompt
from engine.sampling_params import SamplingParams


def render_error(err: ErrorInfo) -> dict[str, Any]:
    return {"error": err.message, "object": "error", "type": err.openai_type, "param": err.param, "code": err.status}


@dataclass(frozen=True)
class VllmContext:
    cumulative: bool  # --vllm-stream cumulative: prompt + output so far, a JSON per line (vLLM's own server)
    full_text: bool  # --full-text-enabled: each spec event carries the output so far


class Generate(Handler[VllmContext]):
    schema = "vllm-generate"
    media_type = "application/json"
    legacy = False

    def render_error(self, err: ErrorInfo) -> dict[str, Any]:
        return render_error(err)

    def error_event(self, err: ErrorInfo, plan: Plan[VllmContext]) -> bytes:
        end = b"\n" if plan.context.cumulative else b"\0"
        return json.dumps(render_error(err), ensure_ascii=False).encode() + end

    async def lower(self, body: dict[str, Any], ctx: ServingContext) -> Plan[VllmContext]:
        lora = requested_adapter(ctx, body.get("model"))
        kw = sampling_kwargs("vllm", body, context=ctx.model.max_model_len)
        # the spec: stop ids beyond int32 are ignored
        kw["stop_token_ids"] = [t for t in kw.get("stop_token_ids", []) if 0 <= t < 2**31]
        req = GenerationRequest(request_id("vllm"), TextPrompt(body["prompt"]), SamplingParams(**kw), lora=lora)
        shape = VllmContext(cumulative=ctx.options.vllm_stream == "cumulative", full_text=ctx.options.full_text_enabled)
        return Plan([req], bool(body.get("stream")), body, context=shape)

    async def render_final(self, plan: Plan[VllmContext], results: list[list[Completion]]) -> Response:
        ((c,),) = results
        return JSONResponse({"text": [plan.body["prompt"] + c.text]})

    async def render_stream(self, plan: Plan[VllmContext],
                            outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncGenerator[bytes, None]:
        shape, prompt = plan.context, plan.body["prompt"]
        text = ""
        async for _, out in outputs:
            if not out.text_delta and not out.finished:
                continue
            text += out.text_delta
            if shape.cumulative:
                yield (json.dumps({"text": [prompt + text]}, ensure_ascii=False) + "\n").encode()
            elif out.text_delta:  # the spec: each delta (or, with fullTextEnabled, the output so far) followed by \0
                yield json.dumps({"text": [text if shape.full_text else out.text_delta]}, ensure_ascii=False).encode() \
                    + b"\0"


generate = route(Generate())


PROTOCOL = Protocol("vllm", (
    Operation("POST", "/generate", generate, "vLLM native generation", ("vllm-generate",), streams=True,
              claims=lambda body: "prompt" in body, claim_hint="`prompt` (vLLM)"),
))
