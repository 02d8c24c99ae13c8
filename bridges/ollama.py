"""Ollama's native API: POST /api/generate, POST /api/chat (NDJSON streams, on by default), GET /api/tags,
GET /api/version, POST /api/show, GET /api/ps. Desktop tools that speak Ollama reach the same engine.
Options follow Ollama's defaults (temperature 0.8, top_k 40, top_p 0.9, repeat_penalty 1.1, num_predict
-1: in the sampling table); durations are in nanoseconds, as Ollama reports them."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bridges.common import BridgeError, Completion, endpoint, int_list, read_json, request_id, requested_adapter
from bridges.constraints import ollama_format
from bridges.context import ServingContext, Tokenizer, with_context
from bridges.errors import ErrorInfo
from bridges.registry import Operation, Protocol
from bridges.sampling_table import sampling_kwargs
from bridges.serving import Handler, Plan, route
from engine.model_loader import EMBEDDED_MODEL_NAME
from engine.request import ChatMessage, ChatPrompt, GenerationRequest, LoraRef, RequestOutput, TokensPrompt
from engine.sampling_params import SamplingParams

# Options that tune how Ollama runs a model (memory, threads, batching, context size), not what it
# answers: no effect on this server, which loads its model once at start; named back in a header.
RUNTIME_OPTIONS = ("num_ctx", "num_keep", "num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap", "low_vram",
                   "numa")
VERSION = "0.6.0"  # the Ollama API level these routes follow


def render_error(err: ErrorInfo) -> dict[str, Any]:
    return {"error": err.message}


def _created_at() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


# The served model's name in Ollama's library, where it has one: what users of Ollama call it.
LIBRARY_NAMES = {EMBEDDED_MODEL_NAME: "smollm2"}


def _is_served(name: str, served: str) -> bool:
    """Ollama names are ``model[:tag]``, any case: the served name, or its library name, with any tag
    (``smollm2:latest``, ``SmolLM2-135M-Instruct:latest``) is the served model."""
    base = name.rpartition(":")[0] if ":" in name else name
    return base.lower() in {served.lower(), LIBRARY_NAMES.get(served, served).lower()}


def _model(ctx: ServingContext, name: str) -> LoraRef | None:
    """The served model (by any of its Ollama names), else an adapter, else 404 in Ollama's words."""
    served = ctx.model.name
    if name == served or _is_served(name, served):
        return None
    try:
        return requested_adapter(ctx, name)
    except BridgeError:
        raise BridgeError(404, f'model "{name}" not found, try pulling it first', param="model") from None


def ignored_options(body: dict[str, Any]) -> list[str]:
    """Options set that tune how Ollama runs a model, not what it answers: accepted, reported back."""
    options = body.get("options") or {}
    names = [k for k in RUNTIME_OPTIONS if options.get(k) is not None]
    if options.get("repeat_last_n") not in (None, -1):
        names.append("repeat_last_n")  # the repetition penalty here looks at the whole context
    return names


def _refuse_unsupported(body: dict[str, Any]) -> None:
    if body.get("think") not in (None, False):
        raise BridgeError(400, "think: the served model has no thinking mode", param="think")
    for field in ("suffix", "template"):
        if body.get(field):
            raise BridgeError(400, f"{field} is not supported: the model's own chat template is used", param=field)
    if body.get("images") or any(m.get("images") for m in body.get("messages") or []):
        raise BridgeError(400, "images: the served model is text-only", param="images")
    if body.get("tools"):
        raise BridgeError(400, "tools are not supported on /api/chat yet", param="tools")


def sampling_params(ctx: ServingContext, body: dict[str, Any]) -> SamplingParams:
    options = body.get("options") or {}
    typical = options.get("typical_p")
    if typical is not None and typical != 1.0:
        raise BridgeError(400, "options.typical_p: only 1.0 (off) is supported", param="options.typical_p")
    kw = sampling_kwargs("ollama", options)
    if kw["max_tokens"] < 0:  # -1: until the context is full, -2: fill the context
        kw["max_tokens"] = ctx.model.max_model_len
    if kw.get("seed", 0) < 0:  # Ollama: a negative seed means "random"
        del kw["seed"]
    kw["top_p"] = kw["top_p"] or 1.0  # 0 turns the cut off
    return SamplingParams(**kw, constraint=ollama_format(body.get("format")))


async def lower_generate(ctx: ServingContext, body: dict[str, Any], rid: str) -> GenerationRequest:
    _refuse_unsupported(body)
    prompt_text = body.get("prompt") or ""
    context = int_list(body.get("context"))
    prompt: Any
    if body.get("raw"):
        prompt = TokensPrompt(context + ctx.tokenizer.encode(prompt_text, add_special_tokens=False))
    else:
        messages = [ChatMessage("system", body["system"])] if body.get("system") else []
        messages.append(ChatMessage("user", prompt_text))
        prompt = ChatPrompt(messages)
        if context:  # the conversation so far, then this turn in the chat template
            prompt = TokensPrompt(context + await ctx.tokenizer.prompt_ids(prompt))
    return GenerationRequest(rid, prompt, sampling_params(ctx, body), lora=_model(ctx, body["model"]))


async def lower_chat(ctx: ServingContext, body: dict[str, Any], rid: str) -> GenerationRequest:
    _refuse_unsupported(body)
    messages = [ChatMessage(m["role"], m.get("content") or "") for m in body.get("messages") or []]
    if not messages:
        raise BridgeError(400, "messages: at least one message is needed to answer", param="messages")
    return GenerationRequest(rid, ChatPrompt(messages), sampling_params(ctx, body), lora=_model(ctx, body["model"]))


def _done_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _final_fields(model: str, started: float, prompt_tokens: int, output_tokens: int, prefill_s: float,
                  decode_s: float, reason: str | None) -> dict[str, Any]:
    return {"model": model, "created_at": _created_at(), "done": True, "done_reason": _done_reason(reason),
            "total_duration": int((time.monotonic() - started) * 1e9), "load_duration": 0,
            "prompt_eval_count": prompt_tokens, "prompt_eval_duration": int(prefill_s * 1e9),
            "eval_count": output_tokens, "eval_duration": int(decode_s * 1e9)}


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


def _ordered(final: dict[str, Any], chat: bool) -> dict[str, Any]:
    """Ollama's key order: model, created_at, message/response, done, ..."""
    head = ["model", "created_at", "message" if chat else "response", "done", "done_reason"]
    return {**{k: final[k] for k in head if k in final}, **{k: v for k, v in final.items() if k not in head}}


@dataclass(frozen=True)
class OllamaContext:
    started: float  # monotonic time of arrival (total_duration)
    tokenizer: Tokenizer  # /api/generate's answer carries the prompt's ids in ``context``


class _Call(Handler[OllamaContext]):
    """/api/generate and /api/chat: NDJSON lines unless ``stream`` is false; the last line (or the
    whole answer) carries the counts and durations; /api/generate also its ``context``."""

    media_type = "application/x-ndjson"
    legacy = False

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.schema = "ollama-chat" if chat else "ollama-generate"

    def render_error(self, err: ErrorInfo) -> dict[str, Any]:
        return render_error(err)

    def error_event(self, err: ErrorInfo, plan: Plan[OllamaContext]) -> bytes:
        return _line(render_error(err))  # Ollama's own form mid-stream: an {"error": ...} line

    async def lower(self, body: dict[str, Any], ctx: ServingContext) -> Plan[OllamaContext]:
        lower = lower_chat if self.chat else lower_generate
        req = await lower(ctx, body, request_id("ollama"))
        ignored = ignored_options(body)
        headers = {"X-Ignored-Parameters": ",".join(ignored)} if ignored else {}
        return Plan([req], body.get("stream") is not False, body, headers=headers,
                    context=OllamaContext(time.monotonic(), ctx.tokenizer))

    def _content(self, text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}} if self.chat else {"response": text}

    async def render_final(self, plan: Plan[OllamaContext], results: list[list[Completion]]) -> Response:
        ((c,),) = results
        result = _final_fields(plan.body["model"], plan.context.started, c.num_prompt_tokens, len(c.token_ids),
                               c.prefill_s, c.decode_s, c.finish_reason) | self._content(c.text)
        if not self.chat:
            result["context"] = await plan.context.tokenizer.prompt_ids(plan.requests[0].prompt) + c.token_ids
        return JSONResponse(_ordered(result, self.chat))

    async def render_stream(self, plan: Plan[OllamaContext],
                            outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncGenerator[bytes, None]:
        model = plan.body["model"]
        output_ids: list[int] = []
        last: RequestOutput | None = None
        async for _, out in outputs:
            last = out
            output_ids += out.new_token_ids
            if out.text_delta:
                yield _line({"model": model, "created_at": _created_at(), **self._content(out.text_delta),
                             "done": False})
        assert last is not None
        t = last.timings
        final = _final_fields(model, plan.context.started, last.num_prompt_tokens, last.num_output_tokens, t.prefill_s,
                              t.decode_s, last.finish_reason) | self._content("")
        if not self.chat:
            final["context"] = await plan.context.tokenizer.prompt_ids(plan.requests[0].prompt) + output_ids
        yield _line(_ordered(final, self.chat))


generate = route(_Call(chat=False))
chat = route(_Call(chat=True))


def _tag(name: str, family: str, parent: str | None = None) -> dict[str, Any]:
    return {"name": name, "model": name, "modified_at": _created_at(), "size": 0, "digest": "",
            "details": {"parent_model": parent or "", "format": "safetensors", "family": family,
                        "families": [family], "parameter_size": "", "quantization_level": ""}}


@with_context
async def tags(request: Request, ctx: ServingContext) -> Response:
    info = ctx.model
    models = [_tag(info.name, info.model_type)]
    for name in ctx.adapters.registered:
        models.append(_tag(name, info.model_type, parent=info.name))
    return JSONResponse({"models": models})


async def version(request: Request) -> Response:
    return JSONResponse({"version": VERSION})


def _capabilities(ctx: ServingContext) -> list[str]:
    return ["embedding"] if ctx.model.task == "embed" else ["completion"]


@endpoint(render_error)
@with_context
async def show(request: Request, ctx: ServingContext) -> Response:
    """What Ollama's ``show`` tells of a model: its family, context and capabilities (no Modelfile: the
    model is this server's, loaded at start, and its chat template is Jinja, not Ollama's Go template)."""
    body = await read_json(request, "ollama-show", ctx.options.max_request_items)
    name = body.get("model") or body.get("name")
    if not name:
        raise BridgeError(400, "model is required: the name of the model to show", param="model")
    lora = _model(ctx, name)
    info = ctx.model
    tag = _tag(name, info.model_type, parent=info.name if lora is not None else None)
    return JSONResponse({"modelfile": "", "parameters": "", "template": "", "details": tag["details"],
                         "model_info": {"general.architecture": info.model_type,
                                        f"{info.model_type}.context_length": info.max_model_len},
                         "capabilities": _capabilities(ctx), "modified_at": tag["modified_at"]})


@with_context
async def running(request: Request, ctx: ServingContext) -> Response:
    """Ollama's ``ps``: the served model, loaded for as long as the server runs."""
    info = ctx.model
    tag = _tag(info.name, info.model_type)
    return JSONResponse({"models": [{key: tag[key] for key in ("name", "model", "size", "digest", "details")} | {
        "expires_at": "2318-01-01T00:00:00Z", "size_vram": 0, "context_length": info.max_model_len}]})


PROTOCOL = Protocol("ollama", (
    Operation("POST", "/api/generate", generate, "Ollama generate (NDJSON stream by default)", ("ollama-generate",),
              streams=True),
    Operation("POST", "/api/chat", chat, "Ollama chat (NDJSON stream by default)", ("ollama-chat",), streams=True),
    Operation("GET", "/api/tags", tags, "Ollama model list"),
    Operation("GET", "/api/version", version, "Ollama API version"),
    Operation("POST", "/api/show", show, "Ollama model details", ("ollama-show",)),
    Operation("GET", "/api/ps", running, "Ollama running models"),
))
