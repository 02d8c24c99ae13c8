"""Triton: POST /v2/models/{model}/generate, /generate_stream, /infer; GET /v2/models/{model},
/v2/health/ready, /v2/health/live. Errors are {"error": ...} with 400; after the first event of a
stream an error is sent as a data event."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bridges import textgen
from bridges.common import BridgeError, Completion, request_id, sse
from bridges.context import ServingContext, with_context
from bridges.errors import ErrorInfo
from bridges.registry import Operation, Protocol
from bridges.serving import C, Handler, Plan, route
from engine.request import RequestOutput


def render_error(err: ErrorInfo) -> dict[str, Any]:
    return {"error": err.message}


def _model(request: Request, ctx: ServingContext) -> str:
    """The path's model: the served one, else 404."""
    name = request.path_params["model"]
    served = ctx.model.name
    if name != served:
        raise BridgeError(404, f"Request for unknown model: '{name}' is not found (serving '{served}')",
                          param="model")
    return name


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


@dataclass(frozen=True)
class TritonContext:
    model: str  # the served model, which the path names
    rid: str  # the answer's id: the body's, else a fresh one
    tg: textgen.TextGenRequest


class _TritonHandler(Handler[C]):
    logprob_fields = textgen.LOGPROB_FIELDS
    legacy = False

    def render_error(self, err: ErrorInfo) -> dict[str, Any]:
        return render_error(err)

    async def read(self, request: Request, ctx: ServingContext) -> dict[str, Any]:
        _model(request, ctx)  # an unknown model is a 404 before the body is looked at
        return await super().read(request, ctx)


class Generate(_TritonHandler[TritonContext]):
    """generate and generate_stream: text in, text out (the stream: one data event per token)."""

    schema = "triton-generate"

    def __init__(self, stream: bool) -> None:
        self.stream = stream

    async def lower(self, body: dict[str, Any], ctx: ServingContext) -> Plan[TritonContext]:
        rid = body.get("id") or request_id("triton")
        tg = textgen.lower(rid, body["text_input"], body.get("parameters"))
        return Plan([tg.request], self.stream, body, headers=tg.headers, context=TritonContext(ctx.model.name, rid, tg))

    async def render_final(self, plan: Plan[TritonContext], results: list[list[Completion]]) -> Response:
        ((c,),) = results
        tg = plan.context.tg
        result: dict[str, Any] = {"id": plan.context.rid, "model_name": plan.context.model, "model_version": None,
                                  "text_output": c.text}
        if tg.details or tg.perf_stat:
            details: dict[str, Any] = {"finish_reason": textgen.finish_reason(c.finish_reason, c.stop_reason),
                                       "generated_tokens": len(c.token_ids), "first_token_cost": None,
                                       "decode_cost": None}
            if tg.perf_stat:
                details["perf_stat"] = [[t, _ms(s)] for t, s in zip(c.token_ids, c.token_latencies_s)]
                details["queue_wait_time"] = round(c.queue_s * 1e6)
                details["prefill_time"] = _ms(c.prefill_s)
                details["decode_time"] = _ms(c.decode_s)
            result["details"] = details
        return JSONResponse(result)

    async def render_stream(self, plan: Plan[TritonContext],
                            outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncGenerator[bytes, None]:
        model, rid, tg = plan.context.model, plan.context.rid, plan.context.tg
        batch_size = (plan.body.get("parameters") or {}).get("batch_size") or 1
        perf: list[list[Any]] = []
        async for _, out in outputs:
            if not out.new_token_ids and not out.finished:
                continue
            t = out.timings
            is_first = out.num_output_tokens == len(out.new_token_ids)
            latency = t.prefill_s if is_first else t.last_token_gap_s
            perf += [[tid, _ms(latency)] for tid in out.new_token_ids]
            event: dict[str, Any] = {"id": rid, "model_name": model, "model_version": None,
                                     "text_output": out.text_delta}
            if tg.details or tg.perf_stat:
                details: dict[str, Any] = {"generated_tokens": out.num_output_tokens, "first_token_cost": None,
                                           "decode_cost": None, "batch_size": batch_size,
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


class Infer(_TritonHandler[str]):
    """Token ids in (a UINT32 tensor), the input ids followed by the generated ids out, as the spec's example."""

    schema = "triton-infer"

    async def lower(self, body: dict[str, Any], ctx: ServingContext) -> Plan[str]:
        """The plan's context: the answer's id."""
        rid = body.get("id") or request_id("triton")
        tensor = body["inputs"][0]
        shape = tensor["shape"]
        if shape[-1] != len(tensor["data"]) or (len(shape) == 2 and shape[0] != 1):
            raise BridgeError(400, f"inputs[0].shape {shape} does not match {len(tensor['data'])} data items")
        tg = textgen.lower(rid, tensor["data"], body.get("parameters"))
        return Plan([tg.request], False, body, headers=tg.headers, context=rid)

    async def render_final(self, plan: Plan[str], results: list[list[Completion]]) -> Response:
        ((c,),) = results
        tensor = plan.body["inputs"][0]
        data = list(tensor["data"]) + c.token_ids
        return JSONResponse({"id": plan.context, "outputs": [{"name": plan.body["outputs"][0]["name"],
                                                               "shape": [1, len(data)], "datatype": "UINT32",
                                                               "data": data}]})


generate = route(Generate(stream=False))
generate_stream = route(Generate(stream=True))
infer = route(Infer())


@with_context
async def model_metadata(request: Request, ctx: ServingContext) -> Response:
    try:
        name = _model(request, ctx)
    except BridgeError as err:
        return JSONResponse(render_error(err.info), status_code=err.status)
    info = ctx.model
    return JSONResponse({"name": name, "versions": ["1"], "platform": "spark-server",
                         "max_model_len": info.max_model_len,
                         "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
                         "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]})


@with_context
async def health_ready(request: Request, ctx: ServingContext) -> Response:
    return Response(status_code=200 if ctx.engine.is_healthy() else 503)


async def health_live(request: Request) -> Response:
    return Response(status_code=200)


PROTOCOL = Protocol("triton", (
    Operation("POST", "/v2/models/{model}/generate", generate, "Triton text generation", ("triton-generate",)),
    Operation("POST", "/v2/models/{model}/generate_stream", generate_stream, "Triton streaming generation",
              ("triton-generate",), streams=True),
    Operation("POST", "/v2/models/{model}/infer", infer, "Triton token-id inference", ("triton-infer",)),
    Operation("GET", "/v2/models/{model}", model_metadata, "Triton model metadata"),
    Operation("GET", "/v2/health/ready", health_ready, "Triton readiness"),
    Operation("GET", "/v2/health/live", health_live, "Triton liveness"),
))
