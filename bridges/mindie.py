"""MindIE native POST /infer: text, or an SSE stream with prefill_time / decode_time per token."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bridges import textgen
from bridges.common import BridgeError, Completion, engine_of, request_id, sse
from bridges.registry import Operation, Protocol
from bridges.serving import Handler, Plan, route
from engine.request import RequestOutput


def render_error(err: BridgeError) -> dict[str, Any]:
    return {"error": err.message, "error_type": err.kind}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


class Infer(Handler):
    schema = "mindie-infer"
    logprob_fields = textgen.LOGPROB_FIELDS

    def render_error(self, err: BridgeError) -> dict[str, Any]:
        return render_error(err)

    async def lower(self, request: Request, body: dict[str, Any]) -> Plan:
        tg = await textgen.lower(engine_of(request), request_id("mindie"), body["inputs"], body.get("parameters"))
        return Plan([tg.request], bool(body.get("stream")), body, headers=textgen.ignored_header(tg), context=tg)

    async def render_final(self, request: Request, plan: Plan, results: list[list[Completion]]) -> Response:
        ((c,),) = results
        tg: textgen.TextGenRequest = plan.context
        result: dict[str, Any] = {"generated_text": c.text}
        if tg.details:  # the spec: details only when asked for
            result["details"] = {"finish_reason": textgen.finish_reason(c.finish_reason, c.stop_reason),
                                 "generated_tokens": len(c.token_ids), "seed": tg.seed}
        return JSONResponse(result)

    async def render_stream(self, request: Request, plan: Plan,
                            outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[bytes]:
        tg: textgen.TextGenRequest = plan.context
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
