"""OpenAI: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (with vLLM's extras)."""

from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bridges.common import (BridgeError, check_fan_out, collect, collect_all, endpoint, ending_with_error_event,
                            engine_of, int_list, merged, now, read_json, request_id, served_model_or_adapter, sse,
                            sse_response, start_streams, stop_list)
from engine.protocol import EngineClient
from engine.request import (ChatMessage, ChatPrompt, GenerationRequest, LoraRef, Prompt, TextPrompt,
                            TokenLogprob, TokensPrompt)
from engine.sampling_params import SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default


def render_error(err: BridgeError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code or err.status}}


def engine_priority(priority: int | None) -> int:
    """vLLM's priority (default 0, lower is more urgent, any integer) on the engine's 1 (most urgent)
    .. 5 (default) scale: 0 -> 5, -1 -> 4, ..., -4 and below -> 1; above 0 stays at the default."""
    return max(1, min(5, 5 + (priority or 0)))


def _error_event(err: BridgeError) -> bytes:
    """A failure mid-stream, as vLLM's OpenAI server sends it: an error event, then [DONE]."""
    return sse(render_error(err)) + sse("[DONE]")


def check_model(request: Request, body: dict[str, Any]) -> tuple[str, LoraRef | None]:
    """(the model name to answer with, the adapter it selects or None for the served model)."""
    lora = served_model_or_adapter(request, body.get("model"))
    return (lora.name if lora else engine_of(request).model_info.name), lora


def banned_ids(engine: EngineClient, words: list[str] | None) -> list[int]:
    ids: list[int] = []
    for word in words or []:
        forms = [engine.tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word)]
        singles = [f[0] for f in forms if len(f) == 1]
        if not singles:
            raise BridgeError(400, f"bad_words: {word!r} is more than one token; only single-token words "
                                   "can be banned", param="bad_words")
        ids += singles
    return ids


def sampling_params(engine: EngineClient, body: dict[str, Any], default_max_tokens: int,
                    logprobs: bool, top_logprobs: int) -> SamplingParams:
    n = body.get("n") or 1
    best_of = body.get("best_of")
    if best_of not in (None, n):
        raise BridgeError(400, "best_of different from n is not supported", param="best_of")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens
    return SamplingParams(
        max_tokens=max_tokens, n=n,
        temperature=1.0 if body.get("temperature") is None else float(body["temperature"]),
        top_p=1.0 if body.get("top_p") is None else float(body["top_p"]),
        top_k=body.get("top_k") or 0, min_p=body.get("min_p") or 0.0,
        min_tokens=body.get("min_tokens") or 0,
        presence_penalty=body.get("presence_penalty") or 0.0,
        frequency_penalty=body.get("frequency_penalty") or 0.0,
        repetition_penalty=body.get("repetition_penalty") or 1.0,
        seed=body.get("seed"), stop=stop_list(body.get("stop")),
        stop_token_ids=int_list(body.get("stop_token_ids")),
        include_stop_str_in_output=bool(body.get("include_stop_str_in_output")),
        ignore_eos=bool(body.get("ignore_eos")),
        skip_special_tokens=body.get("skip_special_tokens") is not False,
        banned_token_ids=banned_ids(engine, body.get("bad_words")),
        logprobs=logprobs, top_logprobs=top_logprobs,
    )


def finish_fields(finish_reason: str | None, stop_reason: str | int | None) -> dict[str, Any]:
    return {"finish_reason": finish_reason, "stop_reason": stop_reason}


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict[str, Any]:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def _token_text(engine: EngineClient, token_id: int) -> str:
    return engine.tokenizer.decode([token_id])


def chat_logprobs(engine: EngineClient, entries: list[TokenLogprob]) -> dict[str, Any]:
    def item(tid: int, lp: float) -> dict[str, Any]:
        text = _token_text(engine, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [item(e.token_id, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(engine: EngineClient, entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    tokens, offsets, pos = [], [], offset
    for e in entries:
        text = _token_text(engine, e.token_id)
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "text_offset": offsets,
            "top_logprobs": [{_token_text(engine, t): lp for t, lp in e.top} for e in entries]}


# ---- /v1/completions ---------------------------------------------------------------------------


def completion_prompts(body: dict[str, Any]) -> list[Prompt]:
    p = body["prompt"]
    if isinstance(p, str):
        return [TextPrompt(p)]
    if all(isinstance(x, str) for x in p):
        return [TextPrompt(x) for x in p]
    if all(isinstance(x, (int, float)) for x in p):
        return [TokensPrompt(int_list(p))]
    return [TokensPrompt(int_list(x)) for x in p]


def lower_completion(engine: EngineClient, body: dict[str, Any], rid: str) -> list[GenerationRequest]:
    if body.get("echo") and body.get("logprobs") is not None:
        raise BridgeError(400, "echo together with logprobs (prompt logprobs) is not supported", param="echo")
    lp = body.get("logprobs")
    params = sampling_params(engine, body, COMPLETION_DEFAULT_MAX_TOKENS, lp is not None, lp or 0)
    prompts = completion_prompts(body)
    return [GenerationRequest(f"{rid}-{i}", p, params, priority=engine_priority(body.get("priority")))
            for i, p in enumerate(prompts)]


def _echo_text(engine: EngineClient, prompt: Prompt) -> str:
    if isinstance(prompt, TextPrompt):
        return prompt.text
    return engine.tokenizer.decode(prompt.token_ids)


@endpoint(render_error)
async def completions(request: Request) -> Response:
    engine = engine_of(request)
    body = await read_json(request, "openai-completion")
    model, lora = check_model(request, body)
    rid = request_id("cmpl")
    reqs = lower_completion(engine, body, rid)
    check_fan_out(request, len(reqs), reqs[0].params.n)
    for r in reqs:
        r.lora = lora
    n = reqs[0].params.n
    echo = bool(body.get("echo"))
    if body.get("stream"):
        events = _stream_completions(engine, body, reqs, await start_streams(engine, reqs), rid, model)
        return sse_response(ending_with_error_event(events, _error_event))
    results = await collect_all(engine, reqs)
    choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
    for i, (req, comps) in enumerate(zip(reqs, results)):
        prompt_tokens += comps[0].num_prompt_tokens
        cached += comps[0].num_cached_tokens
        prefix = _echo_text(engine, req.prompt) if echo else ""
        for c in comps:
            completion_tokens += len(c.token_ids)
            choice = {"index": i * n + c.index, "text": prefix + c.text,
                      "logprobs": completion_logprobs(engine, c.logprobs) if req.params.logprobs else None,
                      **finish_fields(c.finish_reason, c.stop_reason)}
            if body.get("return_token_ids"):
                choice["prompt_token_ids"] = await engine.encode_prompt(req.prompt)
                choice["token_ids"] = c.token_ids
            choices.append(choice)
    return JSONResponse({"id": rid, "object": "text_completion", "created": now(), "model": model,
                         "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached)})


async def _stream_completions(engine, body, reqs, streams, rid, model) -> AsyncIterator[bytes]:
    n = reqs[0].params.n
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    created = now()
    echoed: set[int] = set()
    offsets: dict[int, int] = {}
    prompt_tokens: dict[int, int] = {}
    completion_tokens = 0
    async for i, out in merged(streams):
        index = i * n + out.index
        text = out.text_delta
        if body.get("echo") and index not in echoed:
            echoed.add(index)
            text = _echo_text(engine, reqs[i].prompt) + text
        prompt_tokens[i] = out.num_prompt_tokens
        completion_tokens += len(out.new_token_ids)
        if not text and not out.finished and not out.new_token_ids:
            continue
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}
        if reqs[i].params.logprobs and out.logprobs:
            choice["logprobs"] = completion_logprobs(engine, out.logprobs, offsets.get(index, 0))
        offsets[index] = offsets.get(index, 0) + len(text)
        if out.finished:
            choice.update(finish_fields(out.finish_reason, out.stop_reason))
        if body.get("return_token_ids"):
            choice["token_ids"] = out.new_token_ids
        chunk = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        yield sse(chunk)
    if include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                   "usage": usage(sum(prompt_tokens.values()), completion_tokens)})
    yield sse("[DONE]")


# ---- /v1/chat/completions ----------------------------------------------------------------------


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


def lower_chat(engine: EngineClient, body: dict[str, Any], rid: str) -> GenerationRequest:
    fmt = (body.get("response_format") or {}).get("type", "text")
    if fmt != "text":
        raise BridgeError(400, f"response_format {fmt!r} is not supported yet", param="response_format")
    messages = [ChatMessage("system" if m["role"] == "developer" else m["role"], _content(m))
                for m in body["messages"]]
    want_logprobs = bool(body.get("logprobs"))
    if body.get("top_logprobs") and not want_logprobs:
        raise BridgeError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    params = sampling_params(engine, body, engine.model_info.max_model_len, want_logprobs,
                             body.get("top_logprobs") or 0)
    prompt = ChatPrompt(messages, chat_template_kwargs=dict(body.get("chat_template_kwargs") or {}))
    return GenerationRequest(rid, prompt, params, priority=engine_priority(body.get("priority")))


@endpoint(render_error)
async def chat_completions(request: Request) -> Response:
    engine = engine_of(request)
    body = await read_json(request, "openai-chat")
    model, lora = check_model(request, body)
    rid = request_id("chatcmpl")
    req = lower_chat(engine, body, rid)
    req.lora = lora
    if body.get("stream"):
        streams = await start_streams(engine, [req])
        return sse_response(ending_with_error_event(_stream_chat(engine, body, req, streams[0], rid, model),
                                                    _error_event))
    comps = await collect(engine, req)
    choices = []
    for c in comps:
        choice = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                  "logprobs": chat_logprobs(engine, c.logprobs) if req.params.logprobs else None,
                  **finish_fields(c.finish_reason, c.stop_reason)}
        if body.get("return_token_ids"):
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    result = {"id": rid, "object": "chat.completion", "created": now(), "model": model, "choices": choices,
              "usage": usage(comps[0].num_prompt_tokens, sum(len(c.token_ids) for c in comps),
                             comps[0].num_cached_tokens)}
    if body.get("return_token_ids"):
        result["prompt_token_ids"] = await engine.encode_prompt(req.prompt)
    return JSONResponse(result)


async def _stream_chat(engine, body, req, stream, rid, model) -> AsyncIterator[bytes]:
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    created = now()
    started: set[int] = set()
    prompt_tokens = completion_tokens = 0

    def chunk(choices: list[dict[str, Any]]) -> bytes:
        data = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
        if include_usage:
            data["usage"] = None
        return sse(data)

    async for _, out in merged([stream]):
        prompt_tokens = out.num_prompt_tokens
        completion_tokens += len(out.new_token_ids)
        if out.index not in started:
            started.add(out.index)
            yield chunk([{"index": out.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        if not out.text_delta and not out.finished:
            continue
        choice = {"index": out.index, "delta": {"content": out.text_delta} if out.text_delta else {},
                  "logprobs": chat_logprobs(engine, out.logprobs) if req.params.logprobs and out.logprobs else None,
                  "finish_reason": None}
        if out.finished:
            choice.update(finish_fields(out.finish_reason, out.stop_reason))
        yield chunk([choice])
    if include_usage:
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
                   "usage": usage(prompt_tokens, completion_tokens)})
    yield sse("[DONE]")


# ---- /v1/models --------------------------------------------------------------------------------


async def models(request: Request) -> Response:
    info = engine_of(request).model_info
    created = now()
    data = [{"id": info.name, "object": "model", "created": created, "owned_by": "spark-server", "root": info.path,
             "parent": None, "max_model_len": info.max_model_len}]
    resolver = getattr(request.app.state, "lora_resolver", None)
    for name, path in sorted((resolver.registered if resolver else {}).items()):
        data.append({"id": name, "object": "model", "created": created, "owned_by": "spark-server", "root": path,
                     "parent": info.name, "max_model_len": info.max_model_len})
    return JSONResponse({"object": "list", "data": data})


ROUTES = [
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
]
