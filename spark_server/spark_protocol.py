"""The Spark protocol: its request forms lowered onto a GenerationRequest, its session pipeline, and its
answers rendered, for both transports: the WebSocket's frames and the HTTP form's one JSON answer, each
from the engine's outputs. Errors are the table's (bridges/errors.py), rendered as Spark headers.

    request bytes -> Spark.open: parse, check, lower (Form: the seed document's, or iFlytek's public form
    in spark_public.py), fit the history, resolve the LoRA pack (the serving context's adapters)
    -> Spark.outputs: the engine's outputs, the session counted and logged once it ends
    -> FrameBuilder (WebSocket frames) | http_answer (one JSON answer)

Sans-I/O apart from the engine: spark_server/spark_endpoints.py does the transports."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import schemas
from bridges.constraints import response_format
from bridges.context import ServingContext
from bridges.errors import BridgeError, ErrorInfo, SparkCode, SparkError, error_info
from bridges.log_safety import protect
from bridges.sampling_table import sampling_kwargs
from engine.errors import PromptTooLongError
from engine.protocol import EngineClient
from engine.request import ChatMessage, ChatPrompt, GenerationRequest, LoraRef, RequestOutput
from engine.sampling_params import SamplingParams
from schemas.json_body import MAX_ITEMS, JsonContentError, JsonSyntaxError, parse_json

SCHEMA = "spark-request"
END_MARKER = "<end>"  # clients append it to assistant turns when resending history
RET_MARKER = "<ret>"  # the HTTP form's newline (--spark-http-markers)
ABORTED = "aborted"  # the result label of a session whose client left mid-answer
logger = protect(logging.getLogger("spark_server.sessions"))

# Spark's defaults (spec §1.3: temperature 0.5, max_tokens 2048, top_k 4) are in bridges/sampling_table.py.

_sid_counter = itertools.count(int.from_bytes(os.urandom(3), "big"))


def new_sid() -> str:
    """A session id shaped like the spec's ``cht000cb087@dx18793cd421fb894542``."""
    stamp = f"{int(time.time() * 1000):011x}"[-11:]
    return f"cht{next(_sid_counter) & 0xFFFFFFFF:08x}@dx{stamp}{os.urandom(4).hex()[:7]}"


def decode_body(raw: str | bytes, max_items: int = MAX_ITEMS) -> Any:
    """The frame as a JSON value (any shape), or 4 / 10000."""
    try:
        return parse_json(raw, max_items=max_items)
    except JsonSyntaxError as exc:
        raise SparkError(SparkCode.JSON_PARSE_ERROR, exc.message) from None
    except JsonContentError as exc:
        raise SparkError(SparkCode.SCHEMA_ERROR, exc.message) from None


def trace_id_of(body: Any) -> str | None:
    """The request's traceId when it is one (for echoing, even when the rest is invalid)."""
    header = body.get("header") if isinstance(body, dict) else None
    trace = header.get("traceId") if isinstance(header, dict) else None
    return trace if isinstance(trace, str) else None


def validate_body(body: Any, schema: str = SCHEMA) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise SparkError(SparkCode.SCHEMA_ERROR, f"$: the request must be a JSON object, not {type(body).__name__}")
    error = schemas.first_error(schema, body)
    if error is not None:
        raise SparkError(SparkCode.SCHEMA_ERROR, schemas.describe(error))
    return body


def parse_body(raw: str | bytes, max_items: int = MAX_ITEMS) -> dict[str, Any]:
    """A frame as a valid Spark request, or the SparkError its protocol documents."""
    return validate_body(decode_body(raw, max_items))


@dataclass(slots=True)
class SparkSession:
    sid: str
    trace_id: str
    request: GenerationRequest
    question_tokens: int
    num_dropped_messages: int = 0
    function_names: set[str] | None = None  # the public form's functions: the answer is parsed for calls
    form: Form | None = None  # the request's form (None: the seed document's)


class SessionError(BridgeError):
    """A session refused before it generates: the table's error, and the request's trace id once read."""

    def __init__(self, info: ErrorInfo, trace_id: str | None) -> None:
        super().__init__(info.status, info.message, info.param, info.kind)
        self.info = info
        self.trace_id = trace_id


def _chat_params(body: dict[str, Any]) -> dict[str, Any]:
    # The spec's own Java client sends "chat" at the top level; treat it as parameter.chat. A knob both give
    # with different values is refused: neither may be silently dropped.
    top, nested = body.get("chat") or {}, (body.get("parameter") or {}).get("chat") or {}
    for key in sorted(top.keys() & nested.keys()):
        if top[key] != nested[key]:
            raise SparkError(SparkCode.SCHEMA_ERROR, f"chat.{key} and parameter.chat.{key} differ "
                                                     f"({top[key]!r} and {nested[key]!r}): send it once")
    return {**top, **nested}


def _lora(body: dict[str, Any]) -> LoraRef | None:
    in_payload, in_parameter = (body.get("payload") or {}).get("lora"), (body.get("parameter") or {}).get("lora")
    if in_payload and in_parameter and in_payload != in_parameter:  # one session applies one pack
        raise SparkError(SparkCode.SCHEMA_ERROR, "parameter.lora and payload.lora name two different LoRA packs; "
                                                 "a session applies one: send it in one of them")
    lora = in_payload or in_parameter
    if not lora:
        return None
    return LoraRef(url=lora["url"], md5=lora["md5"].lower())


def _messages(body: dict[str, Any]) -> list[ChatMessage]:
    text = body["payload"]["message"]["text"]
    if not text:
        raise SparkError(SparkCode.NO_DIALOGUE_CONTENT, "payload.message.text is empty: no dialogue content")
    messages = []
    for item in text:
        content = item["content"]
        if item["role"] == "assistant" and content.rstrip().endswith(END_MARKER):
            content = content.rstrip()[: -len(END_MARKER)]
        messages.append(ChatMessage(item["role"], content))
    last = messages[-1]
    if last.role != "user" or not last.content.strip():
        raise SparkError(SparkCode.NO_DIALOGUE_CONTENT, f"payload.message.text[{len(messages) - 1}]: "
                         "the latest turn must be a non-empty user question")
    return messages


def lower(body: dict[str, Any], sid: str) -> tuple[GenerationRequest, bool]:
    """The Spark body as a GenerationRequest (before the token-limit check); also adjustTokens."""
    chat = _chat_params(body)
    params = SamplingParams(**sampling_kwargs("spark", chat),
                            constraint=response_format(chat.get("response_format"), "parameter.chat.response_format"))
    request = GenerationRequest(request_id=sid, prompt=ChatPrompt(_messages(body)), params=params,
                                lora=_lora(body))
    return request, bool(chat.get("adjustTokens", False))


def _droppable(messages: list[ChatMessage]) -> list[int]:
    """Turns adjustTokens may drop, oldest first: all but system prompts and the latest turn."""
    return [i for i, m in enumerate(messages[:-1]) if m.role != "system"]


def _without_oldest(messages: list[ChatMessage], k: int) -> list[ChatMessage]:
    gone = set(_droppable(messages)[:k])
    return [m for i, m in enumerate(messages) if i not in gone]


def fit_history(request: GenerationRequest, adjust: bool, engine: EngineClient,
                history_limit: int) -> tuple[int, int]:
    """Enforce the token limit: all contents within ``history_limit`` tokens and the templated
    prompt within the model's context. With ``adjust`` the oldest turns are dropped (system prompts
    and the latest user turn are kept) until it fits. Returns (question_tokens, dropped).

    Sizes first: a floor on each content's tokens, known without tokenizing, refuses or drops what
    cannot fit (a 4 MB content costs nothing); then exact counts; then the templated prompt, with the
    number of dropped turns found by bisection (each try templates the whole dialogue). Trimming
    leaves ``max_tokens`` (at most half the context) free for the answer."""
    prompt = request.prompt
    assert isinstance(prompt, ChatPrompt)
    messages = prompt.messages
    floors = [engine.min_num_tokens([m.content]) for m in messages]
    dropped = _drop_to_history_limit(messages, floors, adjust, history_limit, "at least ")
    counts = [len(ids) for ids in engine.tokenizer([m.content for m in messages],
                                                   add_special_tokens=False)["input_ids"]]
    dropped += _drop_to_history_limit(messages, counts, adjust, history_limit, "")
    return counts[-1], dropped + _fit_context(request, prompt, adjust, engine)


def _too_long(reason: str, adjust: bool) -> SparkError:
    hint = "" if adjust else " (set parameter.chat.adjustTokens=true to drop the oldest turns)"
    return SparkError(SparkCode.TOKEN_LIMIT_EXCEEDED, f"payload.message.text: {reason}{hint}")


def _drop_to_history_limit(messages: list[ChatMessage], sizes: list[int], adjust: bool, limit: int,
                           what: str) -> int:
    """Drop the fewest oldest turns (with ``adjust``) that bring ``sizes`` (one per message) within
    ``limit``; how many were dropped."""
    total = sum(sizes)
    k = 0
    for i in _droppable(messages) if adjust else []:
        if total <= limit:
            break
        total -= sizes[i]
        k += 1
    if total > limit:
        raise _too_long(f"the dialogue's contents have {what}{sum(sizes)} tokens; the limit is {limit}", adjust)
    messages[:] = _without_oldest(messages, k)
    return k


def _fit_context(request: GenerationRequest, prompt: ChatPrompt, adjust: bool, engine: EngineClient) -> int:
    """Drop the fewest oldest turns (with ``adjust``, found by bisection) that make the templated prompt
    fit the model's context; how many were dropped. The prompt keeps its ids: templated here once, not
    again in the engine."""
    messages = prompt.messages
    # With adjustTokens, trimming also leaves room for the answer: max_tokens free in the context.
    context = engine.model_info.max_model_len
    room = min(request.params.max_tokens, context // 2) if adjust else 1
    encoded: list[list[int]] = []  # the templated prompt of the latest try that fit

    def fits() -> str | None:
        """Why the dialogue as it is now does not fit (None: it does)."""
        try:
            ids = engine.encode_prompt_sync(prompt)
        except PromptTooLongError as exc:
            return str(exc)
        if len(ids) + room > context:
            return (f"the prompt has {len(ids)} tokens; with max_tokens={request.params.max_tokens} free for the "
                    f"answer it must fit the model's {context}-token context")
        encoded[:] = [ids]
        return None

    reason = fits()
    dropped = 0
    if reason is not None:
        kept = list(messages)
        if not adjust or not _droppable(kept):
            raise _too_long(reason, adjust)
        lo, hi = 1, len(_droppable(kept))  # the fewest drops that fit lies in [lo, hi] if any does
        while lo < hi:
            mid = (lo + hi) // 2
            messages[:] = _without_oldest(kept, mid)
            if fits() is None:
                hi = mid
            else:
                lo = mid + 1
        messages[:] = _without_oldest(kept, lo)
        reason = fits()
        if reason is not None:
            raise _too_long(reason, adjust)
        dropped = lo
    prompt.token_ids = encoded[0]
    return dropped


# ---- frames --------------------------------------------------------------------------------------


def usage_block(question_tokens: int, out: RequestOutput) -> dict[str, Any]:
    return {"text": {
        "question_tokens": question_tokens,
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
    }}


def content_frame(sid: str, status: int, seq: int, text: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "choices": {"status": status, "seq": seq,
                    "text": [{"content": text, "role": "assistant", "index": 0}]},
    }
    if usage is not None:
        payload["usage"] = usage
    return {"header": {"code": 0, "message": "Success", "sid": sid, "status": status}, "payload": payload}


class FrameBuilder:
    """Turns the engine's outputs into Spark frames: status 0 first, 1 middle, 2 last; seq from 0."""

    def __init__(self, sid: str, question_tokens: int) -> None:
        self.sid = sid
        self.question_tokens = question_tokens
        self.seq = 0

    def frames_for(self, out: RequestOutput) -> list[dict[str, Any]]:
        if out.finished:
            frame = content_frame(self.sid, 2, self.seq, out.text_delta, usage_block(self.question_tokens, out))
            self.seq += 1
            return [frame]
        if not out.text_delta:
            return []  # text held back (partial character or possible stop string): nothing to show yet
        frame = content_frame(self.sid, 0 if self.seq == 0 else 1, self.seq, out.text_delta)
        self.seq += 1
        return [frame]


# ---- the forms ----------------------------------------------------------------------------------


def message_of(info: ErrorInfo) -> str:
    """An error's message as Spark says it: its header has no field for the parameter, so an invalid
    one is named in the message."""
    if info.kind == "invalid_request" and info.param and info.param not in info.message:
        return f"{info.param}: {info.message}"
    return info.message


class Form:
    """The seed document's request form (``/turing/v3/gpt`` and the HTTP form); iFlytek's public form is
    spark_public.PublicForm. A form reads its body and names its errors; the pipeline is the same."""

    schema = SCHEMA

    def trace_of(self, body: Any) -> str | None:
        """The request's id for logs and answers, when the body has one (also when the rest is invalid)."""
        return trace_id_of(body)

    def check(self, body: Any) -> None:
        """The form's own check before the schema's."""

    def lower(self, body: dict[str, Any], sid: str, ctx: ServingContext,
              key: str | None) -> tuple[GenerationRequest, bool, set[str] | None]:
        """The body as a GenerationRequest (before the token-limit check), adjustTokens, and the function
        names whose calls the answer is parsed for (None: none). ``key``: the signing key, if any."""
        request, adjust = lower(body, sid)
        return request, adjust, None

    def code(self, info: ErrorInfo) -> int:
        return info.spark_code

    def frames(self, session: SparkSession) -> FrameBuilder:
        return FrameBuilder(session.sid, session.question_tokens)

    def error_frame(self, sid: str, info: ErrorInfo) -> dict[str, Any]:
        return {"header": {"code": self.code(info), "message": message_of(info), "sid": sid, "status": 2}}


SEED = Form()


# ---- the HTTP form's answer ------------------------------------------------------------------------


def http_answer(session: SparkSession, text: str, last: RequestOutput | None, markers: bool) -> dict[str, Any]:
    """The HTTP form's one answer: the whole text (with ``markers``, as the document's example writes it:
    newlines as <ret>, then <end>) and the last output's usage."""
    if markers:
        text = text.replace("\n", RET_MARKER) + END_MARKER
    usage = usage_block(session.question_tokens, last) if last is not None and last.finished else None
    return {
        "header": {"code": int(SparkCode.SUCCESS), "message": "success", "traceId": session.trace_id,
                   "sid": session.sid},
        "payload": {"choices": {"seq": 0, "status": 2, "text": [{"content": text, "role": "assistant", "index": 0}]},
                    "usage": usage},
    }


def http_error(info: ErrorInfo, trace_id: str | None = None, sid: str | None = None) -> dict[str, Any]:
    """The HTTP form's error body (its status is the table's)."""
    return {"header": {"code": info.spark_code, "message": message_of(info), "traceId": trace_id, "sid": sid}}


# ---- the pipeline --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SparkOptions:
    """The server's options the Spark protocol reads, each named as its setting."""

    max_history_tokens: int = 8192  # the dialogue's contents, in tokens (10003 over it)
    spark_http_markers: bool = True  # the HTTP form's <ret> and <end>


class Spark:
    """One Spark session from request bytes to the engine's outputs, for either transport and either form.
    ``on_result``: told (protocol, code or "aborted") of every session once it ends, for metrics."""

    def __init__(self, ctx: ServingContext, options: SparkOptions,
                 on_result: Callable[[str, int | str], None] | None = None) -> None:
        self.ctx = ctx
        self.options = options
        self.on_result = on_result

    def _count(self, code: int | str) -> None:
        if self.on_result is not None:
            self.on_result("spark", code)

    async def open(self, raw: str | bytes, sid: str, form: Form = SEED, client: str | None = None,
                   key: str | None = None) -> SparkSession:
        """Parse, check and lower one request, fit its history and resolve its LoRA pack; a refusal raises
        SessionError. ``client``: who sent it (``bridges.common.client_identity``), for the engine's fair
        share between clients; ``key``: the key that signed it, if any."""
        trace_id = None
        try:
            max_items = self.ctx.options.max_request_items
            off_loop = len(raw) > schemas.OFF_LOOP_BYTES  # see schemas.OFF_LOOP_BYTES
            body = await schemas.off_loop(decode_body, raw, max_items) if off_loop else decode_body(raw, max_items)
            trace_id = form.trace_of(body)
            form.check(body)
            if off_loop:
                await schemas.off_loop(validate_body, body, form.schema)
            else:
                validate_body(body, form.schema)
            request, adjust, names = form.lower(body, sid, self.ctx, key)
            request.client = client
            question_tokens, dropped = await asyncio.to_thread(
                fit_history, request, adjust, self.ctx.engine, self.options.max_history_tokens)
            await self.ctx.adapters.resolve(request)  # before admission, as for every protocol
        except Exception as exc:
            info = error_info(exc)
            if info.kind == "internal":
                logger.error("session sid=%s: unexpected failure before generating", sid, exc_info=exc)
            self._count(form.code(info))  # counted under the code the client gets (the public form has its own)
            raise SessionError(info, trace_id) from None
        return SparkSession(sid=sid, trace_id=trace_id or "", request=request, question_tokens=question_tokens,
                            num_dropped_messages=dropped, function_names=names, form=form)

    async def outputs(self, session: SparkSession) -> AsyncGenerator[RequestOutput, None]:
        """The session's outputs from the engine (closing early aborts it); the session is counted and
        logged once it ends."""
        started = time.monotonic()
        last = None
        code: int | str = int(SparkCode.SUCCESS)
        try:
            async with aclosing(self.ctx.engine.generate(session.request)) as outputs:
                async for out in outputs:
                    last = out
                    yield out
        except Exception as exc:
            code = (session.form or SEED).code(error_info(exc))
            raise
        except (GeneratorExit, asyncio.CancelledError):
            if last is None or not last.finished:
                code = ABORTED  # the client left before the answer was complete: not a success
            raise
        finally:
            self._count(code)
            ttft = last.timings.first_token_s if last is not None else None
            logger.info("session sid=%s traceId=%s protocol=spark prompt_tokens=%s completion_tokens=%s "
                        "ttft=%s duration=%.3f code=%s", session.sid, session.trace_id,
                        last.num_prompt_tokens if last else 0, last.num_output_tokens if last else 0,
                        f"{ttft:.3f}" if ttft is not None else "-", time.monotonic() - started, code)
