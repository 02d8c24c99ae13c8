"""TGI: POST /generate, POST /generate_stream, and the root POST / of the HF `text_generation` client.
/generate and /generate_stream answer in the spec's shape by default (token id as a list, special null;
--tgi-compat hf: the HF shape there too); the root, which only that client calls, always answers in the
shape it reads (an int id, a bool special, a non-streaming answer as a one-element array)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from bridges import textgen
from bridges.common import BridgeError, Completion, engine_of, request_id, sse
from bridges.registry import Operation, Protocol
from bridges.serving import Handler, JSONAnswer, Plan, route
from engine.protocol import EngineClient
from engine.request import RequestOutput


def render_error(err: BridgeError) -> dict[str, Any]:
    kinds = {422: "validation", 400: "validation", 404: "validation", 429: "overloaded", 503: "overloaded",
             504: "generation"}
    return {"error": err.message, "error_type": kinds.get(err.status, "generation")}


class Shape:
    def __init__(self, hf: bool, full_text: bool) -> None:
        self.hf = hf
        self.full_text = full_text

    def token(self, engine: EngineClient, token_id: int, text: str, logprob: float | None,
              stream: bool = False) -> dict[str, Any]:
        if self.hf:
            return {"id": token_id, "text": text, "logprob": logprob,
                    "special": token_id in engine.tokenizer.all_special_ids}
        # the MindIE document: a stream event's token.id is a list, details.tokens[].id an int
        return {"id": [token_id] if stream else token_id, "text": text, "logprob": None, "special": None}


class Generate(Handler):
    """/generate (stream when the body says so), /generate_stream (always), and the HF client's root
    (stream when the body says so; a non-streaming answer is a one-element array there)."""

    schema = "tgi-generate"
    logprob_fields = textgen.LOGPROB_FIELDS
    invalid_status = 422  # TGI: 422 for a body that parses but is invalid (400 only for one that is not JSON)

    def __init__(self, always_stream: bool = False, hf_root: bool = False) -> None:
        self.always_stream = always_stream
        self.hf_root = hf_root

    def render_error(self, err: BridgeError) -> dict[str, Any]:
        return render_error(err)

    def _shape(self, request: Request) -> Shape:
        s = request.app.state.settings
        return Shape(hf=self.hf_root or s.tgi_compat == "hf", full_text=s.full_text_enabled)

    async def lower(self, request: Request, body: dict[str, Any]) -> Plan:
        tg = await textgen.lower(engine_of(request), request_id("tgi"), body["inputs"], body.get("parameters"))
        stream = self.always_stream or bool(body.get("stream"))
        if stream and tg.decoder_input_details:  # the spec: "对于流式接口，该参数只能为false"
            raise BridgeError(422, "decoder_input_details must be false on a stream (the prompt's tokens are only "
                                   "returned by the non-streaming /generate)", param="decoder_input_details")
        return Plan([tg.request], stream, body, headers=textgen.ignored_header(tg), context=(tg, self._shape(request)))

    async def render_final(self, request: Request, plan: Plan, results: list[list[Completion]]) -> Response:
        ((c,),) = results
        tg, shape = plan.context
        engine = engine_of(request)
        text = (plan.body["inputs"] if tg.return_full_text else "") + c.text
        result: dict[str, Any] = {"generated_text": text}
        if tg.details or tg.decoder_input_details or shape.hf:
            logprobs = [e.logprob for e in c.logprobs] if c.logprobs else [None] * len(c.token_ids)
            tokens = [shape.token(engine, t, engine.tokenizer.decode([t]), lp) for t, lp in zip(c.token_ids, logprobs)]
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
        return JSONAnswer([result] if self.hf_root else result)

    async def render_stream(self, request: Request, plan: Plan,
                            outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[bytes]:
        tg, shape = plan.context
        engine = engine_of(request)
        text = ""
        async for _, out in outputs:
            ids = out.new_token_ids
            texts = out.texts_per_token()  # each token its own text, also when outputs were merged
            lps = [e.logprob for e in out.logprobs] if out.logprobs else [None] * len(ids)
            for k, token_id in enumerate(ids):
                last = k == len(ids) - 1
                text += texts[k]
                shown = text if shape.full_text else texts[k]
                event: dict[str, Any] = {"token": shape.token(engine, token_id, shown, lps[k], stream=True),
                                         "generated_text": None, "details": None}
                if shape.hf:
                    event["top_tokens"] = None
                if last and out.finished:
                    event["generated_text"] = (plan.body["inputs"] if tg.return_full_text else "") + text
                if last and out.finished and tg.details:  # the spec: details only with details=true
                    event["details"] = {"finish_reason": textgen.finish_reason(out.finish_reason, out.stop_reason),
                                        "generated_tokens": out.num_output_tokens, "seed": tg.seed,
                                        "prompt_tokens": out.num_prompt_tokens}
                yield sse(event)


generate = route(Generate())
generate_stream = route(Generate(always_stream=True))
root = route(Generate(hf_root=True))


PROTOCOL = Protocol("tgi", (
    Operation("POST", "/generate", generate, "TGI generation", ("tgi-generate",), streams=True,
              claims=lambda body: "inputs" in body, claim_hint="`inputs` (TGI)"),
    Operation("POST", "/generate_stream", generate_stream, "TGI streaming generation", ("tgi-generate",),
              streams=True),
    Operation("POST", "/", root, "the HF `text_generation` client's generate and generate_stream",
              ("tgi-generate",), streams=True),
), render_unclaimed=lambda message: {"error": message, "error_type": "validation"})
