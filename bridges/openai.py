"""OpenAI: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (with vLLM's extras)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bridges import reasoning as thinking
from bridges import tool_formats, tools, unserved_fields
from bridges.common import BridgeError, Completion, by_logprob, int_list, now, request_id, requested_adapter, sse
from bridges.constraints import openai_constraint
from bridges.context import ServingContext, Tokenizer, with_context
from bridges.errors import ErrorInfo
from bridges.registry import Operation, Protocol
from bridges.sampling_table import sampling_kwargs
from bridges.serving import Handler, JSONAnswer, Plan, route
from bridges.tools import ToolPlan
from engine.request import (
    ChatPrompt,
    GenerationRequest,
    LoraRef,
    Prompt,
    RequestOutput,
    TextPrompt,
    TokenLogprob,
    TokensPrompt,
)
from engine.sampling_params import SamplingParams


def render_error(err: ErrorInfo) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.openai_type, "param": err.param,
                      "code": err.code or err.status}}


def engine_priority(priority: int | None) -> int:
    """vLLM's priority (default 0, lower is more urgent, any integer) on the engine's 1 (most urgent)
    .. 5 (default) scale: 0 -> 5, -1 -> 4, ..., -4 and below -> 1; above 0 stays at the default."""
    return max(1, min(5, 5 + (priority or 0)))


def _error_event(err: ErrorInfo) -> bytes:
    """A failure mid-stream, as vLLM's OpenAI server sends it: an error event, then [DONE]."""
    return sse(render_error(err)) + sse("[DONE]")


def check_model(ctx: ServingContext, body: dict[str, Any]) -> tuple[str, LoraRef | None]:
    """(the model name to answer with, the adapter it selects or None for the served model). SGLang's
    ``lora_path`` names the adapter beside the base model (routers that route by model name pass it on)."""
    if body.get("lora_path"):
        lora = requested_adapter(ctx, body["lora_path"])
        return body.get("model") or ctx.model.name, lora
    lora = requested_adapter(ctx, body.get("model"))
    if lora is not None and lora.name is not None:  # a registered adapter is selected by its name
        return lora.name, lora
    return ctx.model.name, lora


def banned_ids(tokenizer: Tokenizer, words: list[str] | None) -> list[int]:
    """OpenAI-style bad_words: each must be one token (alone or after a space) to be banned."""
    ids: list[int] = []
    for word in words or []:
        forms = [tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word)]
        singles = [f[0] for f in forms if len(f) == 1]
        if not singles:
            raise BridgeError(400, f"bad_words: {word!r} is more than one token; only single-token words "
                                   "can be banned", param="bad_words")
        ids += singles
    return ids


def sampling_params(ctx: ServingContext, body: dict[str, Any], endpoint: str, logprobs: bool,
                    top_logprobs: int) -> SamplingParams:
    """The body's sampling fields through the one table; what the table cannot say (best_of, the
    tokenizer-dependent bad_words, -1 truncation) is settled here."""
    defaults = dict(ctx.options.openai_sampling_defaults)
    if endpoint == "completions":
        defaults.pop("max_tokens", None)  # vLLM: a completions body's max_tokens defaults to 16 whatever the model says
    kw = sampling_kwargs("openai", body, endpoint=endpoint, context=ctx.model.max_model_len, server_defaults=defaults,
                         max_tokens_cap=ctx.options.openai_max_tokens_cap)
    n = kw.get("n", 1)
    best_of = body.get("best_of")
    if best_of is not None:
        if best_of < n:
            raise BridgeError(400, f"best_of ({best_of}) must be at least n ({n})", param="best_of")
        if body.get("stream") and best_of != n:
            raise BridgeError(400, "best_of > n cannot stream: the best samples are known only at the end",
                              param="best_of")
        kw["n"] = best_of  # generate them all; the n best are returned (ranked in ``best_samples``)
    if body.get("use_beam_search"):
        raise BridgeError(400, "use_beam_search: beam search is not supported (best_of ranks sampled answers)",
                          param="use_beam_search")
    if kw.get("truncate_prompt_tokens") == -1:
        kw["truncate_prompt_tokens"] = ctx.model.max_model_len - 1
    kw["banned_token_ids"] = banned_ids(ctx.tokenizer, body.get("bad_words")) + kw.get("banned_token_ids", [])
    ranked = best_of is not None and best_of > n
    return SamplingParams(**kw, logprobs=logprobs or ranked, top_logprobs=top_logprobs,
                          constraint=openai_constraint(body))


def best_samples(comps: list[Completion], n: int, length_penalty: float | None) -> list[Completion]:
    """vLLM's best_of: the n samples with the highest cumulative logprob, renumbered 0..n-1 in that order.
    With ``length_penalty`` the score is divided by length ** length_penalty, as in beam search."""
    if len(comps) <= n:
        return comps
    best = by_logprob(comps, length_penalty)[:n]
    for i, c in enumerate(best):
        c.index = i
    return best


def finish_fields(finish_reason: str | None, stop_reason: str | int | None) -> dict[str, Any]:
    return {"finish_reason": finish_reason, "stop_reason": stop_reason}


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0, reasoning_tokens: int = 0) -> dict[str, Any]:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}  # FastDeploy's and OpenAI's shape
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def token_ids_named(ctx: ServingContext, body: dict[str, Any]) -> bool:
    """A request's return_tokens_as_token_ids, else the server's (vLLM's --return-tokens-as-token-ids)."""
    own = body.get("return_tokens_as_token_ids")
    return bool(own) if own is not None else ctx.options.return_tokens_as_token_ids


class TokenNames:
    """How logprobs name tokens: their text, or 'token_id:{id}' (vLLM's return_tokens_as_token_ids).
    Each id is decoded once per answer: an answer with many logprobs names the same tokens over and
    over, and a decode costs more than the rest of an entry's rendering."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self._names: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> str:
        name = self._names.get(token_id)
        if name is None:
            name = f"token_id:{token_id}" if self.as_ids else self.tokenizer.decode([token_id])
            self._names[token_id] = name
        return name

    def utf8(self, token_id: int) -> list[int]:
        """The name's UTF-8 bytes (OpenAI's ``bytes``); shared, never to be changed."""
        data = self._bytes.get(token_id)
        if data is None:
            data = self._bytes[token_id] = list(self(token_id).encode())
        return data


def chat_logprobs(name: TokenNames, entries: list[TokenLogprob]) -> dict[str, Any]:
    def item(tid: int, lp: float) -> dict[str, Any]:
        return {"token": name(tid), "logprob": lp, "bytes": name.utf8(tid)}

    return {"content": [item(e.token_id, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(name: TokenNames, entries: list[TokenLogprob], offset: int = 0,
                        unscored: int | None = None) -> dict[str, Any]:
    """The legacy completions' logprobs object; each token's text_offset counts from ``offset``. ``unscored``:
    a first token with no logprob (an echoed prompt's first, which nothing before it predicts)."""
    rows: list[tuple[int, float | None, list[tuple[int, float]] | None]] = [(e.token_id, e.logprob, e.top)
                                                                            for e in entries]
    if unscored is not None:
        rows.insert(0, (unscored, None, None))
    tokens, offsets, pos = [], [], offset
    tops: list[dict[str, float | None] | None] = []
    for token_id, logprob, top in rows:
        text = name(token_id)
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
        # OpenAI's and vLLM's: the chosen token's logprob always among them, so up to logprobs + 1 entries
        tops.append(None if top is None else {text: logprob, **{name(t): lp for t, lp in top}})
    return {"tokens": tokens, "token_logprobs": [logprob for _, logprob, _ in rows], "text_offset": offsets,
            "top_logprobs": tops}


async def echoed_logprobs(answer: OpenAIContext, prompt: Prompt, prompt_entries: list[TokenLogprob | None] | None,
                          entries: list[TokenLogprob]) -> dict[str, Any]:
    """vLLM's echo with logprobs: the prompt's tokens and then the answer's, offsets from the echoed text's
    start (the prompt's own logprobs are asked for with the answer's: ``lower_completion``)."""
    ids = await answer.tokenizer.prompt_ids(prompt)
    scored = [e for e in (prompt_entries or [])[1:] if e is not None]
    return completion_logprobs(answer.names, scored + entries, unscored=ids[0] if ids else None)


def prompt_logprobs_field(name: TokenNames, entries: list[TokenLogprob | None] | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt position None (the first) or {token id: {logprob, rank,
    decoded_token}} for the prompt's own token and the top candidates."""
    if entries is None:
        return None
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        ranked = {tid: {"logprob": lp, "rank": r + 1, "decoded_token": name(tid)} for r, (tid, lp) in enumerate(e.top)}
        if e.token_id not in ranked:
            ranked = {e.token_id: {"logprob": e.logprob, "rank": None, "decoded_token": name(e.token_id)}, **ranked}
        out.append({str(k): v for k, v in ranked.items()})
    return out


def arrival_time(out: RequestOutput) -> float | None:
    """FastDeploy's stream field: seconds from the request's arrival to this output's newest token."""
    t = out.timings
    return None if t.first_token_s is None else round(t.first_token_s + t.decode_s, 6)


def response_id(prefix: str, body: dict[str, Any]) -> str:
    """vLLM: the caller's request_id names the answer, else a fresh one."""
    return f"{prefix}-{body['request_id']}" if body.get("request_id") else request_id(prefix)


# ---- /v1/completions ---------------------------------------------------------------------------


def completion_prompts(body: dict[str, Any]) -> list[Prompt]:
    if body.get("prompt_token_ids") is not None:  # FastDeploy: the prompt as ids
        return [TokensPrompt(int_list(body["prompt_token_ids"]))]
    p = body["prompt"]
    add_special = body.get("add_special_tokens") is not False
    if isinstance(p, str):
        return [TextPrompt(p, add_special_tokens=add_special)]
    if all(isinstance(x, str) for x in p):
        return [TextPrompt(x, add_special_tokens=add_special) for x in p]
    if all(isinstance(x, (int, float)) for x in p):
        return [TokensPrompt(int_list(p))]
    return [TokensPrompt(int_list(x)) for x in p]


def scores_only(body: dict[str, Any]) -> bool:
    """vLLM's echo without generation: ``max_tokens`` 0 with ``echo`` returns the prompt (with its tokens'
    logprobs where ``logprobs`` asks), the one token generated to compute them dropped."""
    return bool(body.get("echo")) and body.get("max_tokens") == 0


def lower_completion(ctx: ServingContext, body: dict[str, Any], rid: str) -> list[GenerationRequest]:
    lp = body.get("logprobs")
    if body.get("max_tokens") == 0:
        if not body.get("echo"):
            raise BridgeError(400, "max_tokens must be at least 1 (0 only with echo: the prompt returned, nothing "
                                   "generated)", param="max_tokens")
        body = {**body, "max_tokens": 1}
    params = sampling_params(ctx, body, "completions", lp is not None, lp or 0)
    if body.get("echo") and lp is not None and params.prompt_logprobs is None:
        params = replace(params, prompt_logprobs=lp)  # vLLM: echoed text comes with its tokens' logprobs, the prompt's
    prompts = completion_prompts(body)
    return [GenerationRequest(f"{rid}-{i}", p, params, priority=engine_priority(body.get("priority")))
            for i, p in enumerate(prompts)]


def _echo_text(tokenizer: Tokenizer, prompt: Prompt) -> str:
    if isinstance(prompt, TextPrompt):
        return prompt.text
    assert isinstance(prompt, TokensPrompt)  # completions take text or token ids, never messages
    return tokenizer.decode(prompt.token_ids)


@dataclass(frozen=True, slots=True)
class OpenAIContext:
    """What rendering an OpenAI answer needs besides the requests."""

    model: str
    rid: str
    names: TokenNames
    tokenizer: Tokenizer  # echo of token prompts, return_token_ids' prompt ids
    tools: ToolPlan | None = None  # chat with tools: the answer is parsed for calls
    reasoning: thinking.ReasoningParser | None = None  # chat with --reasoning-parser: thinking split out
    reasoning_state: thinking.State = "undecided"  # where the answer begins (the prompt's end)


class _OpenAIHandler(Handler[OpenAIContext]):
    legacy = False

    def render_error(self, err: ErrorInfo) -> dict[str, Any]:
        return render_error(err)

    def error_event(self, err: ErrorInfo, plan: Plan[OpenAIContext]) -> bytes:
        return _error_event(err)


class Completions(_OpenAIHandler):
    schema = "openai-completion"

    def logprob_fields_of(self, body: dict[str, Any]) -> tuple[str, str, str]:
        if body.get("echo") and body.get("prompt_logprobs") is None:  # logprobs asks for the prompt's too
            return ("logprobs", "logprobs", "logprobs")
        return self.logprob_fields

    async def lower(self, body: dict[str, Any], ctx: ServingContext) -> Plan[OpenAIContext]:
        model, lora = check_model(ctx, body)
        rid = response_id("cmpl", body)
        reqs = lower_completion(ctx, body, rid)
        for r in reqs:
            r.lora = lora
        names = TokenNames(ctx.tokenizer, token_ids_named(ctx, body))
        return Plan(reqs, bool(body.get("stream")), body, context=OpenAIContext(model, rid, names, ctx.tokenizer),
                    headers=unserved_fields.report(unserved_fields.openai(body), rid))

    async def render_final(self, plan: Plan[OpenAIContext], results: list[list[Completion]]) -> Response:
        body, answer = plan.body, plan.context
        n = body.get("n") or 1
        choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
        for i, (req, comps) in enumerate(zip(plan.requests, results)):
            prompt_tokens += comps[0].num_prompt_tokens
            cached += comps[0].num_cached_tokens
            if scores_only(body):  # the prompt alone: what was generated to score it is not the answer's
                comps = [Completion(c.index, prompt_logprobs=c.prompt_logprobs, finish_reason="length",
                                    num_prompt_tokens=c.num_prompt_tokens, num_cached_tokens=c.num_cached_tokens)
                         for c in comps]
            completion_tokens += sum(len(c.token_ids) for c in comps)  # best_of: every sample generated counts
            prefix = _echo_text(answer.tokenizer, req.prompt) if body.get("echo") else ""
            for c in best_samples(comps, n, body.get("length_penalty")):
                logprobs = None
                if body.get("logprobs") is not None:
                    logprobs = (await echoed_logprobs(answer, req.prompt, comps[0].prompt_logprobs, c.logprobs)
                                if body.get("echo") else completion_logprobs(answer.names, c.logprobs))
                choice = {"index": i * n + c.index, "text": prefix + c.text, "logprobs": logprobs,
                          **finish_fields(c.finish_reason, c.stop_reason)}
                if req.params.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_field(answer.names, comps[0].prompt_logprobs)
                if body.get("return_token_ids"):
                    choice["prompt_token_ids"] = await answer.tokenizer.prompt_ids(req.prompt)
                    choice["token_ids"] = choice["completion_token_ids"] = c.token_ids  # vLLM's, FastDeploy's
                choices.append(choice)
        return JSONAnswer({"id": answer.rid, "object": "text_completion", "created": now(), "model": answer.model,
                           "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached)})

    def render_stream(self, plan: Plan[OpenAIContext],
                      outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncGenerator[bytes, None]:
        return _stream_completions(plan.body, plan.requests, outputs, plan.context)


def _stream_usage(body: dict[str, Any]) -> tuple[bool, bool]:
    """(usage in a last chunk, usage in every chunk): stream_options.include_usage / continuous_usage_stats."""
    options = body.get("stream_options") or {}
    include = bool(options.get("include_usage"))
    return include, include and bool(options.get("continuous_usage_stats"))


async def _stream_completions(body: dict[str, Any], reqs: list[GenerationRequest],
                              outputs: AsyncIterator[tuple[int, RequestOutput]],
                              answer: OpenAIContext) -> AsyncGenerator[bytes, None]:
    n, rid, model, name = reqs[0].params.n, answer.rid, answer.model, answer.names
    include_usage, continuous = _stream_usage(body)
    created = now()
    echoed: set[int] = set()
    # each prompt's logprobs, which come with its first sample's first output only: its siblings echo them too
    prompt_entries: dict[int, list[TokenLogprob | None]] = {}
    with_prompt_ids: set[int] = set()
    offsets: dict[int, int] = {}
    prompt_tokens: dict[int, int] = {}
    completion_tokens = 0
    async for i, out in outputs:
        index = i * n + out.index
        text = out.text_delta
        if scores_only(body):  # the prompt alone: what was generated to score it is not the answer's
            out = replace(out, text_delta="", new_token_ids=[], token_texts=None, logprobs=None,
                          finish_reason="length" if out.finished else None, stop_reason=None)
            text = ""
        echoing = bool(body.get("echo")) and index not in echoed
        if echoing:
            echoed.add(index)
            text = _echo_text(answer.tokenizer, reqs[i].prompt) + text
        prompt_tokens[i] = out.num_prompt_tokens
        completion_tokens += len(out.new_token_ids)
        if not text and not out.finished and not out.new_token_ids:
            continue
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}
        if out.prompt_logprobs is not None:
            prompt_entries[i] = out.prompt_logprobs
        if echoing and body.get("logprobs") is not None:  # the prompt's tokens, then the first of the answer
            choice["logprobs"] = await echoed_logprobs(answer, reqs[i].prompt, prompt_entries.get(i),
                                                       out.logprobs or [])
        elif reqs[i].params.logprobs and out.logprobs:
            choice["logprobs"] = completion_logprobs(name, out.logprobs, offsets.get(index, 0))
        if out.prompt_logprobs is not None and body.get("prompt_logprobs") is not None:
            # a whole prompt's worth at once: rendered off the event loop
            choice["prompt_logprobs"] = await asyncio.to_thread(prompt_logprobs_field, name, out.prompt_logprobs)
        offsets[index] = offsets.get(index, 0) + len(text)
        if out.finished:
            choice.update(finish_fields(out.finish_reason, out.stop_reason))
        if body.get("return_token_ids"):  # vLLM's token_ids, FastDeploy's names; the prompt's with the first
            choice["token_ids"] = choice["completion_token_ids"] = out.new_token_ids
            if index not in with_prompt_ids:
                with_prompt_ids.add(index)
                choice["prompt_token_ids"] = await answer.tokenizer.prompt_ids(reqs[i].prompt)
        choice["arrival_time"] = arrival_time(out)
        chunk = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
        if include_usage:
            chunk["usage"] = usage(sum(prompt_tokens.values()), completion_tokens) if continuous else None
        yield await asyncio.to_thread(sse, chunk) if out.prompt_logprobs else sse(chunk)
    if include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                   "usage": usage(sum(prompt_tokens.values()), completion_tokens)})
    yield sse("[DONE]")


# ---- /v1/chat/completions ----------------------------------------------------------------------


def prompt_ids_of(body: dict[str, Any]) -> list[Any] | None:
    """FastDeploy's prompt as token ids: ``prompt_token_ids``, or ``messages`` given as a list of ids."""
    if body.get("prompt_token_ids") is not None:
        return body["prompt_token_ids"]
    messages = body["messages"]
    ids = [isinstance(m, (int, float)) for m in messages]
    if any(ids) and not all(ids):
        raise BridgeError(400, "messages: either message objects or token ids, not both", param="messages")
    return messages if all(ids) else None


def lower_chat(ctx: ServingContext, body: dict[str, Any], rid: str) -> tuple[GenerationRequest, ToolPlan]:
    # a request's own chat_template is rendered by the engine in a bounded sandbox (engine/template_sandbox.py)
    info, options = ctx.model, ctx.options
    prompt_ids = prompt_ids_of(body)
    if body.get("tools") and body.get("tool_choice", "auto") == "auto" \
            and not options.enable_auto_tool_choice:
        raise BridgeError(400, 'tool_choice "auto" needs the server to run with --enable-auto-tool-choice',
                          param="tool_choice")
    tool_format = tool_formats.get_format(options.tool_call_parser)
    tool_plan = tools.plan(body, body["messages"] if prompt_ids is not body["messages"] else [],
                           native=info.chat_template_tools, fmt=tool_format)
    messages = tool_plan.messages
    want_logprobs = bool(body.get("logprobs"))
    if body.get("top_logprobs") and not want_logprobs:
        raise BridgeError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    params = sampling_params(ctx, body, "chat", want_logprobs, body.get("top_logprobs") or 0)
    if tool_plan.constraint is not None:  # tool_choice required / named: the calls' format is enforced
        if params.constraint is not None:
            raise BridgeError(400, f"tool_choice {body.get('tool_choice')!r} already constrains the answer; "
                                   f"drop {params.constraint.field}", param=params.constraint.field)
        params.constraint = tool_plan.constraint
    if tool_plan.parse and not tool_format.skip_special_tokens:  # its call marker is a special token (vLLM too)
        params.skip_special_tokens = False
    kwargs = dict(body.get("chat_template_kwargs") or {})
    if body.get("documents") is not None:
        kwargs["documents"] = body["documents"]
    prompt: Prompt
    if prompt_ids is not None:  # FastDeploy: the prompt as ids (messages beside prompt_token_ids: for the record)
        prompt = TokensPrompt(int_list(prompt_ids))
    elif body.get("disable_chat_template"):  # FastDeploy: the contents as written
        prompt = TextPrompt("".join(m.content for m in messages), add_special_tokens=False)
    else:
        add_generation = body.get("add_generation_prompt")
        continue_final = bool(body.get("continue_final_message"))
        prompt = ChatPrompt(messages, chat_template_kwargs=kwargs,
                            add_generation_prompt=(not continue_final) if add_generation is None else add_generation,
                            continue_final_message=continue_final, chat_template=body.get("chat_template"),
                            add_special_tokens=bool(body.get("add_special_tokens")), tools=tool_plan.template_tools)
    return GenerationRequest(rid, prompt, params, priority=engine_priority(body.get("priority"))), tool_plan


def _echo_prefix(body: dict[str, Any], req: GenerationRequest) -> str:
    """vLLM's chat echo: the answer starts with the last message when it is the assistant's own."""
    if not body.get("echo") or not isinstance(req.prompt, ChatPrompt) or not req.prompt.messages:
        return ""
    last = req.prompt.messages[-1]
    return last.content if last.role == "assistant" else ""


async def plan_reasoning(ctx: ServingContext, body: dict[str, Any], req: GenerationRequest
                         ) -> tuple[thinking.ReasoningParser | None, thinking.State]:
    """With --reasoning-parser: the answer's thinking is split out (bridges/reasoning.py), structured output
    and tool calls apply after it, and FastDeploy's reasoning_max_tokens caps it. Returns the parser (None
    without one) and where the answer begins."""
    parser = thinking.get_parser(ctx.options.reasoning_parser)
    budget = body.get("reasoning_max_tokens")
    if parser is None:
        if budget is not None:
            raise BridgeError(400, "reasoning_max_tokens needs the server to run with --reasoning-parser: without "
                                   "one the thinking is not told apart from the answer", param="reasoning_max_tokens")
        return None, "undecided"
    return parser, await thinking.prepare(ctx.engine, parser, req, budget)


class ChatCompletions(_OpenAIHandler):
    schema = "openai-chat"
    logprob_fields = ("prompt_logprobs", "top_logprobs", "logprobs")

    async def lower(self, body: dict[str, Any], ctx: ServingContext) -> Plan[OpenAIContext]:
        model, lora = check_model(ctx, body)
        rid = response_id("chatcmpl", body)
        req, tool_plan = lower_chat(ctx, body, rid)
        req.lora = lora
        names = TokenNames(ctx.tokenizer, token_ids_named(ctx, body))
        parser, state = await plan_reasoning(ctx, body, req)
        answer = OpenAIContext(model, rid, names, ctx.tokenizer, tool_plan if tool_plan.parse else None, parser, state)
        return Plan([req], bool(body.get("stream")), body, context=answer,
                    headers=unserved_fields.report(unserved_fields.openai(body), rid))

    async def render_final(self, plan: Plan[OpenAIContext], results: list[list[Completion]]) -> Response:
        body, answer, (req,), (comps,) = plan.body, plan.context, plan.requests, results
        prefix = _echo_prefix(body, req)
        token_ids = bool(body.get("return_token_ids"))
        prompt_ids = await answer.tokenizer.prompt_ids(req.prompt) if token_ids else None
        choices = []
        reasoning_tokens = 0
        for c in best_samples(comps, body.get("n") or 1, body.get("length_penalty")):
            text, thought = prefix + c.text, None
            if answer.reasoning is not None:  # the thinking apart; the content alone is read for calls
                splitter = answer.reasoning.splitter(answer.reasoning_state)
                thought, text = thinking.feed_output(splitter, c.token_texts, final=True)
                thought = thought if splitter.thought else None
                text = prefix + text
                reasoning_tokens += splitter.reasoning_tokens
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = c.finish_reason
            if answer.tools is not None:
                content, calls = answer.tools.parse_answer(text)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": [x.as_dict() for x in calls]}
                    finish = "tool_calls" if finish == "stop" else finish
            if answer.reasoning is not None:  # vLLM's field, null when the answer did not think
                message["reasoning_content"] = thought
                message["content"] = message["content"] or None
            if token_ids:  # FastDeploy puts them in the message
                message["prompt_token_ids"], message["completion_token_ids"] = prompt_ids, c.token_ids
            choice = {"index": c.index, "message": message,
                      "logprobs": chat_logprobs(answer.names, c.logprobs) if body.get("logprobs") else None,
                      **finish_fields(finish, c.stop_reason)}
            if token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        result = {"id": answer.rid, "object": "chat.completion", "created": now(), "model": answer.model,
                  "choices": choices, "usage": usage(comps[0].num_prompt_tokens, sum(len(c.token_ids) for c in comps),
                                                     comps[0].num_cached_tokens, reasoning_tokens)}
        if token_ids:
            result["prompt_token_ids"] = prompt_ids
        if req.params.prompt_logprobs is not None:
            result["prompt_logprobs"] = prompt_logprobs_field(answer.names, comps[0].prompt_logprobs)
        return JSONAnswer(result)

    def render_stream(self, plan: Plan[OpenAIContext],
                      outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncGenerator[bytes, None]:
        return _stream_chat(plan.body, plan.requests[0], outputs, plan.context)


class _ChatStream:
    """One streamed chat answer: the fields every chunk shares, the running token counts, and each
    sample's parsers (the thinking apart, tool calls apart from the content)."""

    def __init__(self, body: dict[str, Any], req: GenerationRequest, answer: OpenAIContext) -> None:
        self.req, self.answer = req, answer
        self.include_usage, self.continuous = _stream_usage(body)
        self.token_ids = bool(body.get("return_token_ids"))
        self.created = now()
        self.prefix = _echo_prefix(body, req)
        self.started: set[int] = set()
        self.prompt_tokens = self.completion_tokens = 0
        self.parsers: dict[int, Any] = {}  # per sample, with tools: content vs completed calls
        self.splitters: dict[int, thinking.ReasoningSplitter] = {}  # per sample, with a reasoning parser
        self.num_calls: dict[int, int] = {}

    def count(self, out: RequestOutput) -> None:
        self.prompt_tokens = out.num_prompt_tokens
        self.completion_tokens += len(out.new_token_ids)

    def reasoning_tokens(self) -> int:
        return sum(s.reasoning_tokens for s in self.splitters.values())

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, 0, self.reasoning_tokens())

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        data = {"id": self.answer.rid, "object": "chat.completion.chunk", "created": self.created,
                "model": self.answer.model, "choices": choices, **extra}
        if self.include_usage:
            data["usage"] = self.usage() if self.continuous else None
        return sse(data)

    async def opening(self, out: RequestOutput) -> bytes:
        """A sample's first chunk: the role, an echoed prompt, and (when asked) the prompt's ids and logprobs."""
        self.started.add(out.index)
        delta: dict[str, Any] = {"role": "assistant", "content": self.prefix}
        extra: dict[str, Any] = {}
        if self.token_ids:  # vLLM: prompt ids in the first chunk; FastDeploy: in the delta
            ids = await self.answer.tokenizer.prompt_ids(self.req.prompt)
            extra["prompt_token_ids"] = delta["prompt_token_ids"] = ids
        first = [{"index": out.index, "delta": delta, "logprobs": None, "finish_reason": None}]
        if out.prompt_logprobs is None:
            return self.chunk(first, **extra)
        # a whole prompt's worth at once: rendered off the event loop
        extra["prompt_logprobs"] = await asyncio.to_thread(prompt_logprobs_field, self.answer.names,
                                                           out.prompt_logprobs)
        return await asyncio.to_thread(self.chunk, first, **extra)

    def split(self, out: RequestOutput) -> tuple[str, list[Any], str]:
        """This output's (content, completed tool calls, thinking)."""
        text, calls, thought = out.text_delta, [], ""
        answer = self.answer
        if answer.reasoning is not None:  # the thinking apart; the content alone is read for calls
            splitter = self.splitters.setdefault(out.index, answer.reasoning.splitter(answer.reasoning_state))
            thought, text = thinking.feed_output(splitter, out.texts_per_token() if out.new_token_ids else [],
                                                 "" if out.new_token_ids else out.text_delta, final=out.finished)
        if answer.tools is not None:
            parser = self.parsers.setdefault(out.index, answer.tools.stream_parser())
            text, calls = parser.feed(text, final=out.finished)
        return text, calls, thought

    def call_chunks(self, index: int, calls: list[Any]) -> list[bytes]:
        """Each completed call: its id and name, then its arguments (as OpenAI streams them)."""
        chunks = []
        for call in calls:
            k = self.num_calls.get(index, 0)
            self.num_calls[index] = k + 1
            head = {"index": k, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            chunks.append(self.chunk([{"index": index, "delta": {"tool_calls": [head]}, "logprobs": None,
                                       "finish_reason": None}]))
            chunks.append(self.chunk([{"index": index, "delta": {"tool_calls": [{"index": k, "function": {
                "arguments": call.arguments}}]}, "logprobs": None, "finish_reason": None}]))
        return chunks

    def content_chunk(self, out: RequestOutput, text: str, thought: str) -> bytes:
        delta: dict[str, Any] = {"reasoning_content": thought} if thought else {}
        if text:
            delta["content"] = text
        if self.token_ids:
            delta["completion_token_ids"] = out.new_token_ids
        logprobs = chat_logprobs(self.answer.names, out.logprobs) if self.req.params.logprobs and out.logprobs else None
        choice = {"index": out.index, "delta": delta, "logprobs": logprobs, "finish_reason": None,
                  "arrival_time": arrival_time(out)}  # FastDeploy's
        if self.token_ids:
            choice["token_ids"] = out.new_token_ids
        if out.finished:
            called = self.num_calls.get(out.index) and out.finish_reason == "stop"
            choice.update(finish_fields("tool_calls" if called else out.finish_reason, out.stop_reason))
        return self.chunk([choice])


async def _stream_chat(body: dict[str, Any], req: GenerationRequest, outputs: AsyncIterator[tuple[int, RequestOutput]],
                       answer: OpenAIContext) -> AsyncGenerator[bytes, None]:
    stream = _ChatStream(body, req, answer)
    async for _, out in outputs:
        stream.count(out)
        if out.index not in stream.started:
            yield await stream.opening(out)
        ids_due = stream.token_ids and bool(out.new_token_ids)  # each token's id goes out even without text
        if not out.text_delta and not out.finished and not ids_due:
            continue
        text, calls, thought = stream.split(out)
        for chunk in stream.call_chunks(out.index, calls):
            yield chunk
        if text or thought or out.finished or ids_due:
            yield stream.content_chunk(out, text, thought)
    if stream.include_usage:
        yield sse({"id": answer.rid, "object": "chat.completion.chunk", "created": stream.created,
                   "model": answer.model, "choices": [], "usage": stream.usage()})
    yield sse("[DONE]")


# ---- /v1/models --------------------------------------------------------------------------------


@with_context
async def models(request: Request, ctx: ServingContext) -> Response:
    info = ctx.model
    created = now()
    data = [{"id": name, "object": "model", "created": created, "owned_by": "spark-server", "root": info.path,
             "parent": None, "max_model_len": info.max_model_len}
            for name in (info.name, *ctx.options.model_aliases)]  # vLLM lists every name
    for name, path in ctx.adapters.registered.items():
        data.append({"id": name, "object": "model", "created": created, "owned_by": "spark-server", "root": path,
                     "parent": info.name, "max_model_len": info.max_model_len})
    return JSONResponse({"object": "list", "data": data})


completions = route(Completions())
chat_completions = route(ChatCompletions())


PROTOCOL = Protocol("openai", (
    Operation("POST", "/v1/completions", completions, "OpenAI completions", ("openai-completion",), streams=True),
    Operation("POST", "/v1/chat/completions", chat_completions, "OpenAI chat completions", ("openai-chat",),
              streams=True),
    Operation("GET", "/v1/models", models, "OpenAI model list"),
))
