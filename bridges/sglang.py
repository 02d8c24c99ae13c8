"""SGLang: POST /generate (`text` / `input_ids` + `sampling_params`), GET /get_model_info."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bridges import unserved_fields
from bridges.common import BridgeError, Completion, int_list, request_id, sse
from bridges.constraints import sglang_constraint
from bridges.context import ServingContext, Tokenizer, with_context
from bridges.errors import ErrorInfo
from bridges.openai import TokenNames
from bridges.registry import Operation, Protocol
from bridges.sampling_table import sampling_kwargs
from bridges.serving import Handler, JSONAnswer, Plan, route
from engine.request import GenerationRequest, LoraRef, RequestOutput, TextPrompt, TokenLogprob, TokensPrompt
from engine.sampling_params import SamplingParams


def render_error(err: ErrorInfo) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.openai_type, "param": err.param, "code": err.status}}


def _finish(reason: str | None, stop_reason: str | int | None, length: int) -> dict[str, Any] | None:
    if reason == "length":
        return {"type": "length", "length": length}
    if reason == "stop":
        return {"type": "stop", "matched": stop_reason}
    if reason is None:
        return None
    return {"type": reason, "message": reason}


def _params(sp: dict[str, Any], return_logprob: bool, top_logprobs: int, start: int) -> SamplingParams:
    """``start``: logprob_start_len; from 0 up the prompt's logprobs are computed too (the engine's
    prompt logprobs, with as many top candidates as the output's), and shown from that position."""
    prompt_logprobs = top_logprobs if return_logprob and start >= 0 else None
    return SamplingParams(**sampling_kwargs("sglang", sp), logprobs=return_logprob, top_logprobs=top_logprobs,
                          prompt_logprobs=prompt_logprobs, constraint=sglang_constraint(sp))


def per_prompt(body: dict[str, Any], name: str, count: int, default: Any) -> list[Any]:
    """SGLang's fields that take one value for every prompt or a list with one per prompt."""
    value = body.get(name)
    if isinstance(value, list):
        if len(value) != count:
            raise BridgeError(400, f"{name}: a list must have one entry per prompt ({count})", param=name)
        return [default if v is None else v for v in value]
    return [default if value is None else value] * count


def lower(body: dict[str, Any], rid: str) -> tuple[list[GenerationRequest], bool, list[str]]:
    """Returns the requests (a batch fans out), whether the body was a batch, and the fields accepted with
    no effect (bridges/unserved_fields.py)."""
    if "text" in body:
        batch = isinstance(body["text"], list)
        prompts: list[TextPrompt | TokensPrompt] = [TextPrompt(t) for t in (body["text"] if batch else [body["text"]])]
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
    ignored = unserved_fields.sglang(body, sps)
    n = len(prompts)
    logprobs = per_prompt(body, "return_logprob", n, False)
    tops = per_prompt(body, "top_logprobs_num", n, 0)
    starts = per_prompt(body, "logprob_start_len", n, -1)
    loras = per_prompt(body, "lora_path", n, None)
    rid = body.get("rid") or rid
    reqs = [GenerationRequest(rid if n == 1 else f"{rid}-{i}", p, _params(sp, bool(logprobs[i]), int(tops[i]),
                                                                          int(starts[i])),
                              lora=LoraRef(name=loras[i]) if loras[i] else None)
            for i, (p, sp) in enumerate(zip(prompts, sps))]
    return reqs, batch, ignored


def input_logprobs(entries: list[TokenLogprob | None], prompt_ids: list[int], start: int,
                   name: TokenNames | None = None) -> dict[str, list]:
    """SGLang's input_token_logprobs / input_top_logprobs from prompt position ``start`` (past the prompt's
    end: its last token): [logprob, token id, text] each (the text null unless ``name``:
    return_text_in_logprobs), the first prompt token's logprob null."""
    start = min(start, len(prompt_ids) - 1)
    tokens, tops = [], []
    for pos in range(start, len(prompt_ids)):
        e = entries[pos] if pos < len(entries) else None
        tokens.append([None if e is None else e.logprob, prompt_ids[pos], _text(name, prompt_ids[pos])])
        tops.append(None if e is None else [[lp, t, _text(name, t)] for t, lp in e.top])
    return {"input_token_logprobs": tokens, "input_top_logprobs": tops}


def _text(name: TokenNames | None, token_id: int) -> str | None:
    return None if name is None else name(token_id)


def _meta(rid: str, c: Completion | RequestOutput, n_out: int, started: float, logprobs: list | None,
          name: TokenNames | None = None) -> dict[str, Any]:
    reason = c.finish_reason
    meta: dict[str, Any] = {"id": rid, "finish_reason": _finish(reason, c.stop_reason, n_out),
                            "prompt_tokens": c.num_prompt_tokens, "completion_tokens": n_out,
                            "cached_tokens": c.num_cached_tokens, "e2e_latency": time.monotonic() - started}
    if logprobs is not None:
        meta["output_token_logprobs"] = [[e.logprob, e.token_id, _text(name, e.token_id)] for e in logprobs]
        meta["output_top_logprobs"] = [[[lp, t, _text(name, t)] for t, lp in e.top] for e in logprobs]
    return meta


@dataclass(frozen=True)
class SglangContext:
    batch: bool  # the body was a batch: the answer is a list even of one
    started: float  # monotonic time of arrival (meta_info.e2e_latency)
    tokenizer: Tokenizer  # the prompts' ids, for input_token_logprobs
    names: TokenNames | None = None  # return_text_in_logprobs: each logprob entry's token text


class Generate(Handler[SglangContext]):
    schema = "sglang-generate"
    logprob_fields = ("logprob_start_len", "top_logprobs_num", "return_logprob")
    legacy = False

    def render_error(self, err: ErrorInfo) -> dict[str, Any]:
        return render_error(err)

    def error_event(self, err: ErrorInfo, plan: Plan) -> bytes:
        return sse(render_error(err)) + sse("[DONE]")  # the stream still ends as SGLang's do

    async def lower(self, body: dict[str, Any], ctx: ServingContext) -> Plan[SglangContext]:
        rid = request_id("sgl")
        reqs, batch, ignored = lower(body, rid)
        names = TokenNames(ctx.tokenizer, as_ids=False) if body.get("return_text_in_logprobs") else None
        return Plan(reqs, bool(body.get("stream")), body,
                    context=SglangContext(batch, time.monotonic(), ctx.tokenizer, names),
                    headers=unserved_fields.report(ignored, body.get("rid") or rid))

    async def _input_logprobs(self, plan: Plan[SglangContext], i: int,
                              entries: list[TokenLogprob | None] | None) -> dict[str, list]:
        """The prompt's logprobs from logprob_start_len, where they were asked for."""
        if entries is None:
            return {}
        start = per_prompt(plan.body, "logprob_start_len", len(plan.requests), -1)[i]
        prompt_ids = await plan.context.tokenizer.prompt_ids(plan.requests[i].prompt)
        return input_logprobs(entries, prompt_ids, int(start), plan.context.names)

    async def render_final(self, plan: Plan[SglangContext], results: list[list[Completion]]) -> Response:
        batch, started = plan.context.batch, plan.context.started
        answers = []
        for i, (req, comps) in enumerate(zip(plan.requests, results)):
            prompt_part = await self._input_logprobs(plan, i, comps[0].prompt_logprobs)
            for c in comps:
                answers.append({"text": c.text, "output_ids": c.token_ids,
                                "meta_info": _meta(req.request_id, c, len(c.token_ids), started,
                                                   c.logprobs if req.params.logprobs else None,
                                                   plan.context.names) | prompt_part})
        return JSONAnswer(answers if batch or len(answers) > 1 else answers[0])

    async def render_stream(self, plan: Plan[SglangContext],
                            outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncGenerator[bytes, None]:
        reqs, started = plan.requests, plan.context.started
        texts: dict[tuple[int, int], str] = {}
        ids: dict[tuple[int, int], list[int]] = {}
        lps: dict[tuple[int, int], list] = {}
        async for i, out in outputs:  # each event: that sample's text and ids so far, as SGLang streams
            key = (i, out.index)
            texts[key] = texts.get(key, "") + out.text_delta
            ids.setdefault(key, []).extend(out.new_token_ids)
            lps.setdefault(key, []).extend(out.logprobs or [])
            meta = _meta(reqs[i].request_id, out, len(ids[key]), started, lps[key] if reqs[i].params.logprobs else None,
                         plan.context.names)
            if out.prompt_logprobs is not None:  # once, with the first output (as the engine sends them)
                meta |= await self._input_logprobs(plan, i, out.prompt_logprobs)
            yield sse({"text": texts[key], "output_ids": ids[key], "index": i * reqs[i].params.n + out.index,
                       "meta_info": meta})
        yield sse("[DONE]")


generate = route(Generate())


@with_context
async def get_model_info(request: Request, ctx: ServingContext) -> Response:
    info = ctx.model
    return JSONResponse({"model_path": info.path, "tokenizer_path": info.path, "is_generation": True,
                         "served_model_name": info.name, "max_context_length": info.max_model_len})


PROTOCOL = Protocol("sglang", (
    Operation("POST", "/generate", generate, "SGLang generation", ("sglang-generate",), streams=True,
              claims=lambda body: "text" in body or "input_ids" in body, claim_hint="`text` / `input_ids` (SGLang)"),
    Operation("GET", "/get_model_info", get_model_info, "SGLang model info"),
))
