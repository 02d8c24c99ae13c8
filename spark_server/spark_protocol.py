"""Spark request parsing, lowering onto a GenerationRequest, and frame rendering.

Sans-I/O: the WebSocket and HTTP endpoints do the transport; everything Spark-specific about
the body and the frames is here.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from typing import Any

import schemas
from bridges.constraints import response_format
from bridges.sampling_table import sampling_kwargs
from engine.errors import PromptTooLongError
from engine.protocol import EngineClient
from engine.request import ChatMessage, ChatPrompt, GenerationRequest, LoraRef, RequestOutput
from engine.sampling_params import SamplingParams
from schemas.json_body import MAX_ITEMS, JsonContentError, JsonSyntaxError, parse_json
from spark_server.errors import SparkCode, SparkError

SCHEMA = "spark-request"
END_MARKER = "<end>"  # clients append it to assistant turns when resending history

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


def _chat_params(body: dict[str, Any]) -> dict[str, Any]:
    # The spec's own Java client sends "chat" at the top level; treat it as parameter.chat.
    chat = dict(body.get("chat") or {})
    chat.update((body.get("parameter") or {}).get("chat") or {})
    return chat


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
    hint = "" if adjust else " (set parameter.chat.adjustTokens=true to drop the oldest turns)"

    def too_long(reason: str) -> SparkError:
        return SparkError(SparkCode.TOKEN_LIMIT_EXCEEDED, f"payload.message.text: {reason}{hint}")

    def drop_to_history_limit(sizes: list[int], what: str) -> int:
        """Drop the fewest oldest turns that bring ``sizes`` (one per message) within the limit."""
        total = sum(sizes)
        k = 0
        for i in _droppable(messages) if adjust else []:
            if total <= history_limit:
                break
            total -= sizes[i]
            k += 1
        if total > history_limit:
            raise too_long(f"the dialogue's contents have {what}{sum(sizes)} tokens; the limit is {history_limit}")
        messages[:] = _without_oldest(messages, k)
        return k

    dropped = drop_to_history_limit([engine.min_num_tokens([m.content]) for m in messages], "at least ")
    counts = [len(ids) for ids in engine.tokenizer([m.content for m in messages],
                                                   add_special_tokens=False)["input_ids"]]
    dropped += drop_to_history_limit(counts, "")
    question_tokens = counts[-1]

    # With adjustTokens, trimming also leaves room for the answer: max_tokens free in the context.
    context = engine.model_info.max_model_len
    room = min(request.params.max_tokens, context // 2) if adjust else 1

    encoded: list[list[int]] = []  # the templated prompt of the latest try: the engine gets it as is

    def fits() -> str | None:
        try:
            ids = engine.encode_prompt_sync(prompt)
        except PromptTooLongError as exc:
            return str(exc)
        encoded[:] = [ids]
        num_tokens = len(ids)
        if num_tokens + room > context:
            return (f"the prompt has {num_tokens} tokens; with max_tokens={request.params.max_tokens} free for the "
                    f"answer it must fit the model's {context}-token context")
        return None

    def templated_once(result: tuple[int, int]) -> tuple[int, int]:
        prompt.token_ids = encoded[0]  # templated and tokenized here once, not again in the engine
        return result

    reason = fits()
    if reason is None:
        return templated_once((question_tokens, dropped))
    kept = list(messages)
    if not adjust or not _droppable(kept):
        raise too_long(reason)
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
        raise too_long(reason)
    return templated_once((question_tokens, dropped + lo))


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


def error_frame(sid: str, error: SparkError) -> dict[str, Any]:
    return {"header": {"code": int(error.code), "message": error.message, "sid": sid, "status": 2}}


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
