"""Tokenizer calls: MindIE POST /v1/tokenizer; vLLM POST /tokenize and POST /detokenize."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bridges.common import BridgeError, endpoint, int_list, read_json, requested_adapter
from bridges.context import ServingContext, with_context
from bridges.errors import ErrorInfo
from bridges.registry import Operation, Protocol
from engine.request import ChatMessage, ChatPrompt


def render_error(err: ErrorInfo) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.openai_type, "param": err.param, "code": err.status}}


def _check_model(ctx: ServingContext, body: dict[str, Any]) -> None:
    requested_adapter(ctx, body.get("model"))  # 404 for a name that is neither


@endpoint(render_error)
@with_context
async def mindie_tokenizer(request: Request, ctx: ServingContext) -> Response:
    body = await read_json(request, "tokenizer", ctx.options.max_request_items)
    tok = ctx.tokenizer

    def count() -> dict[str, Any]:  # a 4 MB input takes seconds: off the event loop
        ids = tok.encode(body["inputs"])  # as inference sees the text: special tokens (BOS) included
        return {"token_number": len(ids), "tokens": [tok.decode([i]) for i in ids]}

    return JSONResponse(await asyncio.to_thread(count))


@endpoint(render_error)
@with_context
async def tokenize(request: Request, ctx: ServingContext) -> Response:
    body = await read_json(request, "vllm-tokenize", ctx.options.max_request_items)
    _check_model(ctx, body)
    if "messages" in body:
        messages = [ChatMessage(m["role"], m["content"]) for m in body["messages"]]
        ids = await ctx.tokenizer.prompt_ids(ChatPrompt(messages))
    else:
        ids = await asyncio.to_thread(ctx.tokenizer.encode, body["prompt"],
                                      add_special_tokens=body.get("add_special_tokens") is not False)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.model.max_model_len, "tokens": ids,
                           "token_strs": None}
    if body.get("return_token_strs"):
        out["token_strs"] = ctx.tokenizer.token_strs(ids)
    return JSONResponse(out)


@endpoint(render_error)
@with_context
async def detokenize(request: Request, ctx: ServingContext) -> Response:
    body = await read_json(request, "vllm-detokenize", ctx.options.max_request_items)
    _check_model(ctx, body)
    vocab = ctx.model.vocab_size
    tokens = int_list(body["tokens"])
    bad = [t for t in tokens if t >= vocab]
    if bad:
        raise BridgeError(400, f"tokens: id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
    return JSONResponse({"prompt": await asyncio.to_thread(ctx.tokenizer.decode, tokens)})


PROTOCOL = Protocol("tokenizer", (
    Operation("POST", "/v1/tokenizer", mindie_tokenizer, "MindIE token count", ("tokenizer",)),
    Operation("POST", "/tokenize", tokenize, "vLLM tokenize", ("vllm-tokenize",)),
    Operation("POST", "/detokenize", detokenize, "vLLM detokenize", ("vllm-detokenize",)),
))
