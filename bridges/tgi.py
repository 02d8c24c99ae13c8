"""TGI: POST /generate, POST /generate_stream, and the root POST / of the HF `text_generation` client.
/generate and /generate_stream answer in the spec's shape by default (token id as a list, special null;
--tgi-compat hf: the HF shape there too); the root, which only that client calls, always answers in the
shape it reads (an int id, a bool special, a non-streaming answer as a one-element array)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from bridges import textgen
from bridges.common import BridgeError, Completion, by_logprob, request_id, sse
from bridges.context import ServingContext, Tokenizer
from bridges.errors import ErrorInfo
from bridges.registry import Operation, Protocol
from bridges.serving import Handler, JSONAnswer, Plan, route
from engine.request import RequestOutput

# TGI's default --max-best-of: the most sequences one request may sample to answer with the best
MAX_BEST_OF = 2


def render_error(err: ErrorInfo) -> dict[str, Any]:
    kinds = {422: "validation", 400: "validation", 404: "validation", 429: "overloaded", 503: "overloaded",
             504: "generation"}
    return {"error": err.message, "error_type": kinds.get(err.status, "generation")}


@dataclass(frozen=True)
class TgiContext:
    """What rendering a TGI answer needs: the lowered parameters and the answer's shape."""

    tg: textgen.TextGenRequest
    inputs: str  # the prompt as sent (return_full_text puts it before the answer)
    hf: bool  # the HF client's shape: an int id, a bool special, logprobs (else the spec's)
    full_text: bool  # --full-text-enabled: each stream event's token text is the output so far
    root: bool  # the HF client's root POST /: a non-streaming answer is a one-element array
    tokenizer: Tokenizer

    def token(self, token_id: int, text: str, logprob: float | None, stream: bool = False) -> dict[str, Any]:
        if self.hf:
            return {"id": token_id, "text": text, "logprob": logprob, "special": self.tokenizer.is_special(token_id)}
        # the MindIE document: a stream event's token.id is a list, details.tokens[].id an int
        return {"id": [token_id] if stream else token_id, "text": text, "logprob": None, "special": None}

    def generated_text(self, text: str) -> str:
        return (self.inputs if self.tg.return_full_text else "") + text


class Generate(Handler[TgiContext]):
    """/generate (stream when the body says so), /generate_stream (always), and the HF client's root
    (stream when the body says so; a non-streaming answer is a one-element array there)."""

    schema = "tgi-generate"
    logprob_fields = textgen.LOGPROB_FIELDS
    invalid_status = 422  # TGI: 422 for a body that parses but is invalid (400 only for one that is not JSON)
    legacy = False

    def __init__(self, always_stream: bool = False, hf_root: bool = False) -> None:
        self.always_stream = always_stream
        self.hf_root = hf_root

    def render_error(self, err: ErrorInfo) -> dict[str, Any]:
        return render_error(err)

    async def lower(self, body: dict[str, Any], ctx: ServingContext) -> Plan[TgiContext]:
        tg = textgen.lower(request_id("tgi"), body["inputs"], body.get("parameters"), max_best_of=MAX_BEST_OF,
                           invalid_status=self.invalid_status)
        stream = self.always_stream or bool(body.get("stream"))
        if stream and tg.best_of > 1:
            raise BridgeError(422, "`best_of` != 1 is not supported when streaming tokens", param="best_of")
        if stream and tg.decoder_input_details:  # the spec: "对于流式接口，该参数只能为false"
            raise BridgeError(422, "decoder_input_details must be false on a stream (the prompt's tokens are only "
                                   "returned by the non-streaming /generate)", param="decoder_input_details")
        shape = TgiContext(tg, body["inputs"], hf=self.hf_root or ctx.options.tgi_compat == "hf",
                           full_text=ctx.options.full_text_enabled, root=self.hf_root, tokenizer=ctx.tokenizer)
        return Plan([tg.request], stream, body, context=shape, headers=tg.headers)

    async def render_final(self, plan: Plan[TgiContext], results: list[list[Completion]]) -> Response:
        ((*samples,),) = results
        shape, tg = plan.context, plan.context.tg
        # best_of: the sequence of the highest logprob sum answers; the others follow in best_of_sequences
        ranked = by_logprob(samples)
        c = ranked[0]
        result: dict[str, Any] = {"generated_text": shape.generated_text(c.text)}
        if tg.details or tg.decoder_input_details or shape.hf:
            prefill = await self._prefill(shape) if tg.decoder_input_details else []
            details = self._sequence(shape, c, prefill)
            details["prompt_tokens"] = c.num_prompt_tokens
            if tg.best_of > 1:
                details["best_of_sequences"] = [
                    {"generated_text": shape.generated_text(other.text)} | self._sequence(shape, other, prefill)
                    for other in ranked[1:]]
            result["details"] = details
        return JSONAnswer([result] if shape.root else result)

    @staticmethod
    async def _prefill(shape: TgiContext) -> list[dict[str, Any]]:
        tok = shape.tokenizer
        return [{"id": i, "text": tok.decode([i]), "logprob": None, **({} if shape.hf else {"special": None})}
                for i in await tok.prompt_ids(shape.tg.request.prompt)]

    @staticmethod
    def _sequence(shape: TgiContext, c: Completion, prefill: list[dict[str, Any]]) -> dict[str, Any]:
        """One sequence's details: its finish, tokens (and top tokens where asked), the prompt's prefill."""
        tg, tok = shape.tg, shape.tokenizer
        logprobs = [e.logprob for e in c.logprobs] if c.logprobs else [None] * len(c.token_ids)
        out: dict[str, Any] = {
            "finish_reason": textgen.finish_reason(c.finish_reason, c.stop_reason),
            "generated_tokens": len(c.token_ids), "seed": tg.seed, "prefill": prefill,
            "tokens": [shape.token(t, tok.decode([t]), lp) for t, lp in zip(c.token_ids, logprobs)]}
        if tg.top_n_tokens:
            out["top_tokens"] = [[shape.token(t, tok.decode([t]), v) for t, v in e.top] for e in c.logprobs]
        return out

    async def render_stream(self, plan: Plan[TgiContext],
                            outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncGenerator[bytes, None]:
        shape, tg = plan.context, plan.context.tg
        text = ""
        async for _, out in outputs:
            ids = out.new_token_ids
            texts = out.texts_per_token()  # each token its own text, also when outputs were merged
            lps = [e.logprob for e in out.logprobs] if out.logprobs else [None] * len(ids)
            for k, token_id in enumerate(ids):
                last = k == len(ids) - 1
                text += texts[k]
                shown = text if shape.full_text else texts[k]
                event: dict[str, Any] = {"token": shape.token(token_id, shown, lps[k], stream=True),
                                         "generated_text": None, "details": None}
                if shape.hf:
                    event["top_tokens"] = None
                if last and out.finished:
                    event["generated_text"] = shape.generated_text(text)
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
), render_unclaimed=render_error)
