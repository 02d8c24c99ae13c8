"""Tokenizer calls: MindIE POST /v1/tokenizer; vLLM POST /tokenize and POST /detokenize."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bridges.common import BridgeError, endpoint, engine_of, int_list, read_json, served_model_or_adapter
from bridges.registry import Operation, Protocol
from engine.request import ChatMessage, ChatPrompt


def render_error(err: BridgeError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.status}}


def _check_model(request: Request, body: dict[str, Any]) -> None:
    served_model_or_adapter(request, body.get("model"))  # 404 for a name that is neither


@endpoint(render_error)
async def mindie_tokenizer(request: Request) -> Response:
    body = await read_json(request, "tokenizer")
    tok = engine_of(request).tokenizer

    def count() -> dict[str, Any]:  # a 4 MB input takes seconds: off the event loop
        ids = tok.encode(body["inputs"])  # as inference sees the text: special tokens (BOS) included
        return {"token_number": len(ids), "tokens": [tok.decode([i]) for i in ids]}

    return JSONResponse(await asyncio.to_thread(count))


@endpoint(render_error)
async def tokenize(request: Request) -> Response:
    body = await read_json(request, "vllm-tokenize")
    _check_model(request, body)
    engine = engine_of(request)
    if "messages" in body:
        ids = await engine.encode_prompt(ChatPrompt([ChatMessage(m["role"], m["content"]) for m in body["messages"]]))
    else:
        ids = await asyncio.to_thread(engine.tokenizer.encode, body["prompt"],
                                      add_special_tokens=body.get("add_special_tokens") is not False)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.model_info.max_model_len, "tokens": ids,
                           "token_strs": None}
    if body.get("return_token_strs"):
        out["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(out)


@endpoint(render_error)
async def detokenize(request: Request) -> Response:
    body = await read_json(request, "vllm-detokenize")
    _check_model(request, body)
    engine = engine_of(request)
    vocab = engine.model_info.vocab_size
    tokens = int_list(body["tokens"])
    bad = [t for t in tokens if t >= vocab]
    if bad:
        raise BridgeError(400, f"tokens: id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
    return JSONResponse({"prompt": await asyncio.to_thread(engine.tokenizer.decode, tokens)})


PROTOCOL = Protocol("tokenizer", (
    Operation("POST", "/v1/tokenizer", mindie_tokenizer, "MindIE token count", ("tokenizer",)),
    Operation("POST", "/tokenize", tokenize, "vLLM tokenize", ("vllm-tokenize",)),
    Operation("POST", "/detokenize", detokenize, "vLLM detokenize", ("vllm-detokenize",)),
))
