"""SGLang: POST /generate (`text` / `input_ids` + `sampling_params`), GET /get_model_info."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bridges.common import BridgeError, Completion, engine_of, int_list, request_id, sse
from bridges.constraints import sglang_constraint
from bridges.registry import Operation, Protocol
from bridges.sampling_table import sampling_kwargs
from bridges.serving import Handler, JSONAnswer, Plan, route
from engine.request import GenerationRequest, LoraRef, RequestOutput, TextPrompt, TokensPrompt
from engine.sampling_params import SamplingParams


def render_error(err: BridgeError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.status}}


def _finish(reason: str | None, stop_reason: str | int | None, length: int) -> dict[str, Any] | None:
    if reason == "length":
        return {"type": "length", "length": length}
    if reason == "stop":
        return {"type": "stop", "matched": stop_reason}
    if reason is None:
        return None
    return {"type": reason, "message": reason}


def _params(sp: dict[str, Any], return_logprob: bool, top_logprobs: int) -> SamplingParams:
    return SamplingParams(**sampling_kwargs("sglang", sp), logprobs=return_logprob, top_logprobs=top_logprobs,
                          constraint=sglang_constraint(sp))


def lower(body: dict[str, Any], rid: str) -> tuple[list[GenerationRequest], bool]:
    """Returns the requests (a batch fans out) and whether the body was a batch."""
    if "text" in body:
        batch = isinstance(body["text"], list)
        prompts = [TextPrompt(t) for t in (body["text"] if batch else [body["text"]])]
    else:
        ids = body["input_ids"]
        batch = isinstance(ids[0], list)
        prompts = [TokensPrompt(int_list(x)) for x in (ids if batch else [ids])]
    sps = body.get("sampling_params") or {}
    if isinstance(sps, list):
        if len(sps) != len(prompts):
            raise BridgeError(400, "sampling_params: a list must have one entry per prompt", param="sampling_params")
    else:
        sps = [sps] * len(prompts)
    logprob, top = bool(body.get("return_logprob")), body.get("top_logprobs_num") or 0
    rid = body.get("rid") or rid
    lora = LoraRef(name=body["lora_path"]) if body.get("lora_path") else None
    reqs = [GenerationRequest(rid if len(prompts) == 1 else f"{rid}-{i}", p, _params(sp, logprob, top), lora=lora)
            for i, (p, sp) in enumerate(zip(prompts, sps))]
    return reqs, batch


def _meta(rid: str, c: Completion | RequestOutput, n_out: int, started: float, logprobs: list | None) -> dict[str, Any]:
    reason = c.finish_reason
    meta: dict[str, Any] = {"id": rid, "finish_reason": _finish(reason, c.stop_reason, n_out),
                            "prompt_tokens": c.num_prompt_tokens, "completion_tokens": n_out,
                            "cached_tokens": c.num_cached_tokens, "e2e_latency": time.monotonic() - started}
    if logprobs is not None:
        meta["output_token_logprobs"] = [[e.logprob, e.token_id, None] for e in logprobs]
        meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in e.top] for e in logprobs]
    return meta


class Generate(Handler):
    schema = "sglang-generate"
    logprob_fields = ("return_logprob", "top_logprobs_num", "return_logprob")

    def render_error(self, err: BridgeError) -> dict[str, Any]:
        return render_error(err)

    def error_event(self, err: BridgeError, plan: Plan) -> bytes:
        return sse(render_error(err)) + sse("[DONE]")  # the stream still ends as SGLang's do

    async def lower(self, request: Request, body: dict[str, Any]) -> Plan:
        reqs, batch = lower(body, request_id("sgl"))
        return Plan(reqs, bool(body.get("stream")), body, context=(batch, time.monotonic()))

    async def render_final(self, request: Request, plan: Plan, results: list[list[Completion]]) -> Response:
        batch, started = plan.context
        answers = []
        for req, comps in zip(plan.requests, results):
            for c in comps:
                answers.append({"text": c.text, "output_ids": c.token_ids,
                                "meta_info": _meta(req.request_id, c, len(c.token_ids), started,
                                                   c.logprobs if req.params.logprobs else None)})
        return JSONAnswer(answers if batch or len(answers) > 1 else answers[0])

    async def render_stream(self, request: Request, plan: Plan,
                            outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[bytes]:
        reqs, (_, started) = plan.requests, plan.context
        texts: dict[tuple[int, int], str] = {}
        ids: dict[tuple[int, int], list[int]] = {}
        lps: dict[tuple[int, int], list] = {}
        async for i, out in outputs:  # each event: that sample's text and ids so far, as SGLang streams
            key = (i, out.index)
            texts[key] = texts.get(key, "") + out.text_delta
            ids.setdefault(key, []).extend(out.new_token_ids)
            lps.setdefault(key, []).extend(out.logprobs or [])
            yield sse({"text": texts[key], "output_ids": ids[key], "index": i * reqs[i].params.n + out.index,
                       "meta_info": _meta(reqs[i].request_id, out, len(ids[key]), started,
                                          lps[key] if reqs[i].params.logprobs else None)})
        yield sse("[DONE]")


generate = route(Generate())


async def get_model_info(request: Request) -> Response:
    info = engine_of(request).model_info
    return JSONResponse({"model_path": info.path, "tokenizer_path": info.path, "is_generation": True,
                         "served_model_name": info.name, "max_context_length": info.max_model_len})


PROTOCOL = Protocol("sglang", (
    Operation("POST", "/generate", generate, "SGLang generation", ("sglang-generate",), streams=True,
              claims=lambda body: "text" in body or "input_ids" in body, claim_hint="`text` / `input_ids` (SGLang)"),
    Operation("GET", "/get_model_info", get_model_info, "SGLang model info"),
))
