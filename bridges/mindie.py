"""MindIE native POST /infer: text, or an SSE stream with prefill_time / decode_time per token."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response

from bridges import textgen
from bridges.common import Completion, request_id, sse
from bridges.context import ServingContext
from bridges.errors import ErrorInfo
from bridges.registry import Operation, Protocol
from bridges.serving import Handler, Plan, route
from engine.request import RequestOutput


def render_error(err: ErrorInfo) -> dict[str, Any]:
    return {"error": err.message, "error_type": err.openai_type}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


class Infer(Handler[textgen.TextGenRequest]):
    schema = "mindie-infer"
    logprob_fields = textgen.LOGPROB_FIELDS
    legacy = False

    def render_error(self, err: ErrorInfo) -> dict[str, Any]:
        return render_error(err)

    async def lower(self, body: dict[str, Any], ctx: ServingContext) -> Plan[textgen.TextGenRequest]:
        tg = textgen.lower(request_id("mindie"), body["inputs"], body.get("parameters"))
        return Plan([tg.request], bool(body.get("stream")), body, headers=tg.headers, context=tg)

    async def render_final(self, plan: Plan[textgen.TextGenRequest], results: list[list[Completion]]) -> Response:
        ((c,),) = results
        tg = plan.context
        result: dict[str, Any] = {"generated_text": c.text}
        if tg.details:  # the spec: details only when asked for
            result["details"] = {"finish_reason": textgen.finish_reason(c.finish_reason, c.stop_reason),
                                 "generated_tokens": len(c.token_ids), "seed": tg.seed}
        return JSONResponse(result)

    async def render_stream(self, plan: Plan[textgen.TextGenRequest],
                            outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncGenerator[bytes, None]:
        tg = plan.context
        text = ""
        async for _, out in outputs:
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


infer = route(Infer())


PROTOCOL = Protocol("mindie", (
    Operation("POST", "/infer", infer, "MindIE native inference", ("mindie-infer",), streams=True),
))
