"""vLLM's pooling family on the engine's ``pool``: OpenAI POST /v1/embeddings, and vLLM's POST /pooling,
/classify, /score and /rerank (also /v1/rerank and /v2/rerank, in Jina's and Cohere's v1 / v2 shapes).

Each body is validated against its schema (schemas/pooling-*.schema.json); every prompt of a request is one
engine request, at most --max-seqs-per-request of them in flight at once; failures are OpenAI's error body.
Scores come from the model's one-label classification head where it has one (a cross-encoder: the pair is
one prompt), else from the cosine of the two texts' embeddings."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import Response

from bridges.common import (
    BridgeError,
    client_identity,
    endpoint,
    int_list,
    now,
    read_json,
    requested_adapter,
)
from bridges.context import ServingContext, Tokenizer, with_context
from bridges.openai import engine_priority, render_error, response_id
from bridges.registry import Operation, Protocol
from bridges.serving import JSONAnswer
from engine.errors import InvalidRequestError
from engine.pooling import PoolingOutput, PoolingParams, PoolingRequest
from engine.request import ChatMessage, ChatPrompt, Prompt, TextPrompt, TokensPrompt

# what vLLM calls each API in its "The model does not support ..." refusals
_API = {"embed": "Embeddings API", "classify": "Classification API", "score": "Score API", "encode": "Pooling API"}


# ---- lowering ----------------------------------------------------------------------------------


def _model(ctx: ServingContext, body: dict[str, Any]) -> str:
    """The served model's name; 404 for an unknown one; adapters are not applied to pooling."""
    lora = requested_adapter(ctx, body.get("model"))
    if lora is not None:
        raise BridgeError(400, f"model: {lora.name!r} is a LoRA adapter; pooling runs the base model only",
                          param="model")
    return ctx.model.name


def _serves(ctx: ServingContext, task: str) -> None:
    info = ctx.model
    if not info.pooling_tasks:
        raise BridgeError(400, f"The model does not support {_API[task]}: this server pools nothing (a front end "
                               "over --engine-url, or a model without pooling)", param="model")
    if task not in info.pooling_tasks:
        raise BridgeError(400, f"The model does not support {_API[task]}: the server runs --task {info.task}, "
                               f"whose pooling serves {', '.join(_API[t] for t in info.pooling_tasks)} "
                               "(docs/pooling.md)", param="model")


def _truncation(ctx: ServingContext, body: dict[str, Any]) -> int | None:
    """truncate_prompt_tokens: -1 is the model's context (less the one position the engine keeps free)."""
    value = body.get("truncate_prompt_tokens")
    limit = ctx.model.max_model_len
    if value is None:
        return None
    value = int(value)  # JSON Schema's "integer" admits 7.0; the engine slices with it
    if value == -1:
        return limit - 1
    if value > limit:
        raise BridgeError(400, f"truncate_prompt_tokens ({value}) is more than the model's context ({limit} tokens)",
                          param="truncate_prompt_tokens")
    return value


def _activation(body: dict[str, Any]) -> bool | None:
    """use_activation, or vLLM's older names for it (activation, softmax); they must agree."""
    given = {k: body[k] for k in ("use_activation", "activation", "softmax") if body.get(k) is not None}
    if len(set(given.values())) > 1:
        raise BridgeError(400, f"{' and '.join(given)} disagree; give one of them", param=next(iter(given)))
    return next(iter(given.values()), None)


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(part["text"] for part in content)
    return content or ""


def _prompts(ctx: ServingContext, body: dict[str, Any]) -> list[Prompt]:
    """``input`` (a string, strings, token ids, token-id lists) or ``messages`` (one prompt, through the chat
    template, as vLLM's chat form of these bodies)."""
    has_input, has_messages = body.get("input") is not None, body.get("messages") is not None
    if has_input == has_messages:
        raise BridgeError(400, "give either input or messages" + (", not both" if has_input else ""),
                          param="messages" if has_input else "input")
    if has_messages:
        if body.get("chat_template") and not ctx.options.trust_request_chat_template:
            raise BridgeError(400, "chat_template: a request's own chat template is refused unless the server runs "
                                   "with --trust-request-chat-template", param="chat_template")
        continue_final = bool(body.get("continue_final_message"))
        return [ChatPrompt([ChatMessage(m["role"], _content(m)) for m in body["messages"]],
                           chat_template_kwargs=dict(body.get("chat_template_kwargs") or {}),
                           add_generation_prompt=bool(body.get("add_generation_prompt")),
                           continue_final_message=continue_final, chat_template=body.get("chat_template"),
                           add_special_tokens=bool(body.get("add_special_tokens")))]
    for name in ("chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"):
        if body.get(name) is not None:
            raise BridgeError(400, f"{name} applies to the messages form only", param=name)
    value = body["input"]
    special = body.get("add_special_tokens") is not False
    if isinstance(value, str):
        return [TextPrompt(value, add_special_tokens=special)]
    if all(isinstance(v, str) for v in value):
        return [TextPrompt(v, add_special_tokens=special) for v in value]
    if all(isinstance(v, list) for v in value):
        return [TokensPrompt(int_list(v)) for v in value]
    return [TokensPrompt(int_list(value))]


async def _pool_all(ctx: ServingContext, client: str | None, body: dict[str, Any], prompts: list[Prompt],
                    params: PoolingParams,
                    field: str) -> list[PoolingOutput]:
    """Every prompt through the engine, in order; at most --max-seqs-per-request at once (a batch of a thousand
    inputs waits its turn instead of holding every running slot); all or nothing. Engine refusals name
    ``field`` where they named the prompt."""
    engine = ctx.engine
    gate = asyncio.Semaphore(ctx.options.max_seqs_per_request)
    rid = response_id("pool", body)
    priority = engine_priority(body.get("priority"))

    async def one(i: int, prompt: Prompt) -> PoolingOutput:
        async with gate:
            try:
                return await engine.pool(PoolingRequest(f"{rid}-{i}", prompt, params, priority=priority,
                                                        client=client))
            except InvalidRequestError as exc:
                if exc.parameter in ("prompt", "prompt_token_ids", "messages") and field != exc.parameter:
                    where = field if len(prompts) == 1 else f"{field}[{i}]"
                    raise BridgeError(400, f"{where}: {exc}", param=field) from None
                raise

    tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _usage(outs: list[PoolingOutput]) -> dict[str, Any]:
    n = sum(o.num_prompt_tokens for o in outs)
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}


def _flat(data: Any) -> list[float]:
    return [v for row in data for v in row] if data and isinstance(data[0], list) else list(data)


def _encoded(data: Any, encoding_format: str | None) -> Any:
    """float: the values as JSON numbers; base64: their little-endian float32 bytes (what the openai client
    decodes), rows one after another for per-token data."""
    if encoding_format != "base64":
        return data
    flat = _flat(data)
    return base64.b64encode(struct.pack(f"<{len(flat)}f", *flat)).decode("ascii")


def _listing(prefix: str, body: dict[str, Any], model: str, data: list[dict[str, Any]],
             outs: list[PoolingOutput]) -> JSONAnswer:
    return JSONAnswer({"id": response_id(prefix, body), "object": "list", "created": now(), "model": model,
                       "data": data, "usage": _usage(outs)})


# ---- /v1/embeddings, /pooling, /classify ---------------------------------------------------------


@endpoint(render_error)
@with_context
async def embeddings(request: Request, ctx: ServingContext) -> Response:
    body = await read_json(request, "pooling-embeddings", ctx.options.max_request_items)
    model = _model(ctx, body)
    _serves(ctx, "embed")
    params = PoolingParams("embed", dimensions=body.get("dimensions"), normalize=body.get("normalize"),
                           truncate_prompt_tokens=_truncation(ctx, body))
    outs = await _pool_all(ctx, client_identity(request), body, _prompts(ctx, body), params, "input")
    fmt = body.get("encoding_format")
    return _listing("embd", body, model, [{"index": i, "object": "embedding", "embedding": _encoded(o.data, fmt)}
                                          for i, o in enumerate(outs)], outs)


@endpoint(render_error)
@with_context
async def pooling(request: Request, ctx: ServingContext) -> Response:
    body = await read_json(request, "pooling-pooling", ctx.options.max_request_items)
    model = _model(ctx, body)
    _serves(ctx, "encode")
    params = PoolingParams("encode", dimensions=body.get("dimensions"), normalize=body.get("normalize"),
                           activation=_activation(body), truncate_prompt_tokens=_truncation(ctx, body))
    outs = await _pool_all(ctx, client_identity(request), body, _prompts(ctx, body), params, "input")
    fmt = body.get("encoding_format")
    return _listing("pool", body, model, [{"index": i, "object": "pooling", "data": _encoded(o.data, fmt)}
                                          for i, o in enumerate(outs)], outs)


@endpoint(render_error)
@with_context
async def classify(request: Request, ctx: ServingContext) -> Response:
    body = await read_json(request, "pooling-classify", ctx.options.max_request_items)
    model = _model(ctx, body)
    _serves(ctx, "classify")
    labels = ctx.model.labels
    params = PoolingParams("classify", activation=_activation(body), truncate_prompt_tokens=_truncation(ctx, body))
    outs = await _pool_all(ctx, client_identity(request), body, _prompts(ctx, body), params, "input")
    data = []
    for i, o in enumerate(outs):
        probs = list(_vector(o))
        best = max(range(len(probs)), key=lambda j: probs[j])
        data.append({"index": i, "label": labels[best] if best < len(labels) else f"LABEL_{best}", "probs": probs,
                     "num_classes": len(probs)})
    return _listing("classify", body, model, data, outs)


# ---- /score and /rerank --------------------------------------------------------------------------


def _vector(out: PoolingOutput) -> list[float]:
    """The one vector of a prompt pooled whole (classify, score, embed): only token-level pooling answers
    with a vector per token."""
    if out.data and isinstance(out.data[0], list):
        raise TypeError("expected one vector for the prompt, got one per token")
    return cast("list[float]", out.data)


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def _cut(tokenizer: Tokenizer, text: str, max_tokens: int | None) -> str:
    """A document cut to its first ``max_tokens`` tokens (Cohere's max_tokens_per_doc)."""
    if max_tokens is None:
        return text
    ids = tokenizer.encode(text, add_special_tokens=False)
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])


async def _scores(ctx: ServingContext, client: str | None, body: dict[str, Any], pairs: list[tuple[str, str]],
                  fields: tuple[str, str], max_doc_tokens: int | None = None
                  ) -> tuple[list[float], list[PoolingOutput]]:
    """One score per (first, second) pair, and the engine answers behind them (for usage)."""
    _serves(ctx, "score")
    truncate = _truncation(ctx, body)
    activation = _activation(body)
    tokenizer = ctx.tokenizer
    if max_doc_tokens is not None:
        cut = await asyncio.to_thread(lambda: {b: _cut(tokenizer, b, max_doc_tokens) for _, b in pairs})
        pairs = [(a, cut[b]) for a, b in pairs]
    if ctx.model.labels:  # a cross-encoder: each pair is one prompt, as its tokenizer joins a pair
        ids = await asyncio.to_thread(lambda: [tokenizer.pair(a, b) for a, b in pairs])
        params = PoolingParams("score", activation=activation, truncate_prompt_tokens=truncate)
        outs = await _pool_all(ctx, client, body, [TokensPrompt(i) for i in ids], params, fields[1])
        return [float(_vector(o)[0]) for o in outs], outs
    if activation is not None:
        raise BridgeError(400, "use_activation applies to a classification head; this model scores by the cosine "
                               "of embeddings", param="use_activation")
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each distinct text embedded once
    params = PoolingParams("embed", truncate_prompt_tokens=truncate)
    outs = await _pool_all(ctx, client, body, [TextPrompt(t) for t in texts], params, fields[1])
    vectors = {t: _vector(o) for t, o in zip(texts, outs)}
    return [_cosine(vectors[a], vectors[b]) for a, b in pairs], outs


@endpoint(render_error)
@with_context
async def score(request: Request, ctx: ServingContext) -> Response:
    body = await read_json(request, "pooling-score", ctx.options.max_request_items)
    model = _model(ctx, body)
    first = [body["text_1"]] if isinstance(body["text_1"], str) else body["text_1"]
    second = [body["text_2"]] if isinstance(body["text_2"], str) else body["text_2"]
    if len(first) > 1 and len(first) != len(second):
        raise BridgeError(400, f"text_1 has {len(first)} texts and text_2 {len(second)}: pairs are 1:1, 1:N or N:N",
                          param="text_2")
    pairs = [(first[0] if len(first) == 1 else first[i], b) for i, b in enumerate(second)]
    scores, outs = await _scores(ctx, client_identity(request), body, pairs, ("text_1", "text_2"))
    return _listing("score", body, model, [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                    outs)


@endpoint(render_error)
@with_context
async def rerank(request: Request, ctx: ServingContext) -> Response:
    body = await read_json(request, "pooling-rerank", ctx.options.max_request_items)
    model = _model(ctx, body)
    documents = [d if isinstance(d, str) else d["text"] for d in body["documents"]]
    scores, outs = await _scores(ctx, client_identity(request), body, [(body["query"], d) for d in documents],
                                 ("query", "documents"), body.get("max_tokens_per_doc"))
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    top_n = body.get("top_n") or len(documents)
    results = []
    for i in order[:top_n]:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.get("return_documents") is not False:
            result["document"] = {"text": documents[i]}
        results.append(result)
    n = sum(o.num_prompt_tokens for o in outs)
    return JSONAnswer({"id": response_id("rerank", body), "model": model,
                       "usage": {"prompt_tokens": n, "total_tokens": n}, "results": results})


PROTOCOL = Protocol("pooling", (
    Operation("POST", "/v1/embeddings", embeddings, "OpenAI embeddings (vLLM's chat form too)",
              ("pooling-embeddings",)),
    Operation("POST", "/pooling", pooling, "vLLM pooling: the model's pooled output", ("pooling-pooling",)),
    Operation("POST", "/classify", classify, "vLLM classification (a sequence-classification head)",
              ("pooling-classify",)),
    Operation("POST", "/score", score, "vLLM score: text_1 against text_2", ("pooling-score",)),
    Operation("POST", "/v1/score", score, "vLLM score: text_1 against text_2", ("pooling-score",)),
    Operation("POST", "/rerank", rerank, "rerank (Jina, Cohere)", ("pooling-rerank",)),
    Operation("POST", "/v1/rerank", rerank, "rerank (Jina, Cohere v1)", ("pooling-rerank",)),
    Operation("POST", "/v2/rerank", rerank, "rerank (Cohere v2)", ("pooling-rerank",)),
))
