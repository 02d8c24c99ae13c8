"""OpenAI Responses: POST /v1/responses, and the kept responses' GET, DELETE, cancel and input items.

A response is a chat turn: its ``instructions`` and ``input`` items (or a ``previous_response_id``'s
whole conversation, then the new items) become chat messages and go through the chat completions'
lowering (the chat template, tools, sampling), so a greedy response and the chat completion of the same
conversation are the same answer. What is its own is the item and event vocabulary: ``output`` items
(``message`` with ``output_text`` parts, ``function_call``), the typed stream events with their
``sequence_number``, ``text.format`` as the answer's constraint, and the kept responses (``store``,
``background``) in a bounded store (bridges/responses_store.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bridges import reasoning as thinking
from bridges import tools
from bridges.answer_volume import check_answer_volume
from bridges.common import (
    BridgeError,
    Completion,
    client_identity,
    collect_all,
    endpoint,
    now,
    parse_json_field,
)
from bridges.context import ServingContext, with_context
from bridges.errors import ErrorInfo, error_info
from bridges.openai import TokenNames, chat_logprobs, check_model, lower_chat
from bridges.openai import render_error as openai_error
from bridges.registry import Operation, Protocol
from bridges.responses_store import ResponseStore, StoredResponse
from bridges.serving import Handler, JSONAnswer, Plan, serve
from bridges.tools import ToolPlan
from engine.request import RequestOutput, TokenLogprob
from engine.structured import Constraint

logger = logging.getLogger(__name__)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# chat-lowering names -> this protocol's, for errors raised below the translation
_PARAM_NAMES = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                "messages": "input", "prompt": "input", "response_format": "text.format"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _named(err: ErrorInfo) -> ErrorInfo:
    """``err`` with the parameter it names in this protocol's fields."""
    return replace(err, param=_PARAM_NAMES[err.param]) if err.param in _PARAM_NAMES else err


def render_error(err: ErrorInfo) -> dict[str, Any]:
    return openai_error(_named(err))


def _not_found(rid: str, param: str = "response_id") -> BridgeError:
    return BridgeError(404, f"Response with id '{rid}' not found.", param=param, code="not_found")


# ---- input items -> chat messages ----------------------------------------------------------------


def _text(content: str | list[dict[str, Any]]) -> str:
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def _normalized(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as it is kept and listed: its type and id filled in, text content as parts."""
    kind = item.get("type", "message")
    if kind == "message":
        part = "output_text" if item["role"] == "assistant" else "input_text"
        content = item["content"]
        parts = [{"type": part, "text": content}] if isinstance(content, str) else content
        return {"id": item.get("id") or _new_id("msg"), "type": "message", "role": item["role"],
                "content": parts, "status": item.get("status") or "completed"}
    prefix = {"function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}[kind]
    return {**item, "type": kind, "id": item.get("id") or _new_id(prefix)}


def chat_messages(instructions: str | None, items: list[tuple[str, dict[str, Any]]]
                  ) -> tuple[list[dict[str, Any]], list[str]]:
    """Chat messages for (request path, item) pairs, and the path each message came from. A function call
    joins the assistant message just before it (one answer's text and calls are one chat message); a
    reasoning item is the thinking of the assistant message after it (its ``reasoning_content``, which
    the chat template shows or leaves out, as for chat completions)."""
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    thought: str | None = None  # a reasoning item's text, for the next assistant message
    if instructions:
        messages.append({"role": "system", "content": instructions})
        origins.append("instructions")
    for path, item in items:
        kind = item.get("type", "message")
        if kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thought = (thought or "") + "".join(part["text"] for part in parts)
            continue
        if kind == "message":
            message = {"role": item["role"], "content": _text(item["content"])}
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"],
                                 "arguments": parse_json_field(item["arguments"] or "{}", f"{path}.arguments")}}
            if messages and messages[-1]["role"] == "assistant" and thought is None:
                messages[-1].setdefault("tool_calls", []).append(call)
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        else:  # function_call_output
            message = {"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])}
        if message["role"] == "assistant" and thought is not None:
            message["reasoning_content"], thought = thought, None
        messages.append(message)
        origins.append(path)
    return messages, origins


def _renamed(err: BridgeError, origins: list[str]) -> BridgeError:
    """A chat-lowering error named in this protocol's fields: messages[i]... -> the item it came from."""
    param = err.param or ""
    if param.startswith("messages[") and "]" in param:
        index = param[len("messages["):].split("]", 1)[0]
        if index.isdigit() and int(index) < len(origins):
            err.param = origins[int(index)]
            err.message = err.message.replace(f"messages[{index}]", origins[int(index)])
    elif param in _PARAM_NAMES:
        err.param = _PARAM_NAMES[param]
    return err


def format_constraint(fmt: dict[str, Any] | None) -> Constraint | None:
    """``text.format``: text (free), json_object (any JSON object), json_schema (its schema)."""
    if not fmt:
        return None
    kind = fmt.get("type", "text")
    if kind == "json_object":
        return Constraint("json_object", field="text.format")
    if kind == "json_schema":
        return Constraint("json", json.dumps(fmt["schema"]), field="text.format.schema")
    return None


# ---- lowering ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Context:
    """What rendering a response needs besides its engine request (the kept response's store and the
    stream's event counter are the only things that change)."""

    rid: str
    model: str
    body: dict[str, Any]
    names: TokenNames
    input_items: list[dict[str, Any]]  # this response's own, normalized
    history: list[dict[str, Any]]  # the earlier turns' items (previous_response_id)
    store: ResponseStore | None  # None: store false
    tools: ToolPlan | None = None  # tools offered: the answer is parsed for calls
    logprobs: bool = False
    reasoning: thinking.ReasoningParser | None = None  # --reasoning-parser: the thinking is its own item
    reasoning_state: thinking.State = "undecided"  # where the answer begins (the prompt's end)
    # the sampling the answer runs with, as the response object echoes it (a knob the body leaves out
    # shows the default that applied: OpenAI's, or the model's recommendation under --generation-config)
    temperature: float = 1.0
    top_p: float = 1.0
    created: int = field(default_factory=now)
    sequence: itertools.count = field(default_factory=itertools.count)


def _ignored(body: dict[str, Any]) -> list[str]:
    """Fields accepted and echoed that change nothing here (answered in X-Ignored-Parameters)."""
    ignored = []
    if body.get("prompt_cache_key") is not None:
        ignored.append("prompt_cache_key")  # the prefix cache finds shared prefixes without a key
    if body.get("service_tier") not in (None, "auto", "default"):
        ignored.append("service_tier")
    if (body.get("text") or {}).get("verbosity") is not None:
        ignored.append("text.verbosity")
    reasoning = body.get("reasoning") or {}
    if any(reasoning.get(k) is not None for k in ("effort", "summary", "generate_summary")):
        # nothing steers how much the model thinks, and its thinking (with --reasoning-parser) is returned
        # as it was written, never summarized
        ignored.append("reasoning")
    if (body.get("stream_options") or {}).get("include_obfuscation"):
        ignored.append("stream_options.include_obfuscation")
    if "reasoning.encrypted_content" in (body.get("include") or []):
        ignored.append("include")
    return ignored


def _chat_body(body: dict[str, Any], messages: list[dict[str, Any]], logprobs: bool) -> dict[str, Any]:
    """The chat completions body of the same turn."""
    chat: dict[str, Any] = {"messages": messages, "model": body.get("model")}
    for name, chat_name in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                            ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(name) is not None:
            chat[chat_name] = body[name]
    if body.get("tools"):
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type" and v is not None}}
                         for t in body["tools"]]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice
    if logprobs:
        chat["logprobs"] = True
        chat["top_logprobs"] = body.get("top_logprobs") or 0
    return chat


class Responses(Handler[_Context]):
    schema = "openai-responses"
    logprob_fields = ("input", "top_logprobs", "include")
    legacy = False

    def render_error(self, err: ErrorInfo) -> dict[str, Any]:
        return render_error(err)

    def error_event(self, err: ErrorInfo, plan: Plan[_Context]) -> bytes:
        """A failure mid-stream: an ``error`` event, then ``response.failed`` (also kept when stored)."""
        ctx = plan.context
        err = _named(err)
        failed = _response(ctx, "failed", [], error={"code": err.code or "server_error", "message": err.message})
        _keep(ctx, failed, _owner(plan))
        return (_event(ctx, "error", code=err.code or str(err.status), message=err.message, param=err.param)
                + _event(ctx, "response.failed", response=failed))

    async def read(self, request: Request, serving: ServingContext) -> dict[str, Any]:
        try:
            return await super().read(request, serving)
        except BridgeError as err:
            missing = re.match(r"\$: '(\w+)' is a required property", err.message)
            if err.param is None and missing:  # the body's own required field: name it
                err.param = missing.group(1)
            raise

    async def lower(self, body: dict[str, Any], serving: ServingContext) -> Plan[_Context]:
        model, lora = check_model(serving, body)
        keep = body.get("store") is not False
        if body.get("background") and not keep:
            raise BridgeError(400, "background: a background response must be stored (store: true)",
                              param="background")
        if body.get("background") and body.get("stream"):
            raise BridgeError(400, "background: a background response is not streamed; poll GET "
                                   "/v1/responses/{id} for it", param="background")
        if body.get("truncation") == "auto":
            raise BridgeError(400, "truncation: only 'disabled' (an input over the context is refused)",
                              param="truncation")
        store = serving.responses
        history: list[dict[str, Any]] = []
        if body.get("previous_response_id"):
            previous = store.get(body["previous_response_id"])
            if previous is None:
                raise BridgeError(400, f"Previous response with id '{body['previous_response_id']}' not found.",
                                  param="previous_response_id", code="previous_response_not_found")
            if previous.running:
                raise BridgeError(400, f"previous_response_id: response '{body['previous_response_id']}' is still "
                                       "in progress", param="previous_response_id")
            history = previous.conversation
        given = body["input"]
        raw = [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else given
        items = [_normalized(item) for item in raw]
        paths = ["input" if isinstance(given, str) else f"input[{k}]" for k in range(len(items))]
        messages, origins = chat_messages(body.get("instructions"),
                                          [("previous_response_id", i) for i in history] + list(zip(paths, items)))
        if not messages:
            raise BridgeError(400, "input: no message to answer (only reasoning items)", param="input")
        include = body.get("include") or []
        logprobs = LOGPROBS_INCLUDE in include or body.get("top_logprobs") is not None
        rid = _new_id("resp")
        try:
            req, tool_plan = lower_chat(serving, _chat_body(body, messages, logprobs), rid)
        except BridgeError as err:
            raise _renamed(err, origins) from None
        constraint = format_constraint((body.get("text") or {}).get("format"))
        if constraint is not None:
            if req.params.constraint is not None:
                raise BridgeError(400, f"text.format: tool_choice {body.get('tool_choice')!r} already constrains "
                                       "the answer", param="text.format")
            req.params.constraint = constraint
        req.lora = lora
        ignored = _ignored(body)
        if ignored:
            logger.info("response %s: %s accepted with no effect", rid, ", ".join(ignored))
        parser = thinking.get_parser(serving.options.reasoning_parser)
        state: thinking.State = "undecided"
        if parser is not None:  # after the constraint is set: it then starts after the thinking
            state = await thinking.prepare(serving.engine, parser, req)
        ctx = _Context(rid, model, body, TokenNames(serving.tokenizer, False), items, history,
                       store if keep else None, tool_plan if tool_plan.parse else None, logprobs, parser, state,
                       req.params.temperature, req.params.top_p)
        headers = {"X-Ignored-Parameters": ",".join(ignored)} if ignored else {}
        return Plan([req], bool(body.get("stream")), body, headers=headers, context=ctx)

    async def render_final(self, plan: Plan[_Context], results: list[list[Completion]]) -> Response:
        ctx = plan.context
        response = _final(ctx, results[0][0])
        _keep(ctx, response, _owner(plan))
        return JSONAnswer(response)

    def render_stream(self, plan: Plan[_Context],
                      outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncGenerator[bytes, None]:
        return _stream(plan.context, outputs, _owner(plan))


def _owner(plan: Plan[_Context]) -> str | None:
    """The client a kept response is charged to: its request's (set by the time it renders)."""
    return plan.requests[0].client if plan.requests else None


# ---- the response object -------------------------------------------------------------------------


def _usage(prompt: int, cached: int, output: int, reasoning: int = 0) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": prompt + output}


def _response(ctx: _Context, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
              error: dict[str, Any] | None = None, incomplete: dict[str, Any] | None = None) -> dict[str, Any]:
    b = ctx.body
    reasoning = b.get("reasoning") or {}
    text = {"format": (b.get("text") or {}).get("format") or {"type": "text"}}
    if (b.get("text") or {}).get("verbosity") is not None:
        text["verbosity"] = b["text"]["verbosity"]
    return {
        "id": ctx.rid, "object": "response", "created_at": ctx.created, "status": status,
        "background": bool(b.get("background")), "error": error, "incomplete_details": incomplete,
        "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
        "model": ctx.model, "output": output, "parallel_tool_calls": b.get("parallel_tool_calls") is not False,
        "previous_response_id": b.get("previous_response_id"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "service_tier": b.get("service_tier") or "default", "store": ctx.store is not None,
        "temperature": ctx.temperature, "text": text,
        "tool_choice": b.get("tool_choice") or "auto",
        "tools": [{"type": "function", "description": None, "parameters": None, "strict": None, **t}
                  for t in b.get("tools") or []],
        "top_logprobs": b.get("top_logprobs") or 0, "top_p": ctx.top_p,
        "truncation": b.get("truncation") or "disabled", "usage": usage, "user": b.get("user"),
        "safety_identifier": b.get("safety_identifier"), "prompt_cache_key": b.get("prompt_cache_key"),
        "metadata": b.get("metadata") or {},
    }


def _status(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """The response's status and incomplete_details for the engine's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _message(text: str, status: str, logprobs: list[dict[str, Any]] | None, item_id: str | None = None
             ) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"id": item_id or _new_id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [part]}


def _reasoning(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or _new_id("rs"), "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _function_call(call: tools.ToolCall, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or _new_id("fc"), "type": "function_call", "status": "completed", "call_id": call.id,
            "name": call.name, "arguments": call.arguments}


def _final(ctx: _Context, c: Completion) -> dict[str, Any]:
    status, incomplete = _status(c.finish_reason)
    text = c.text
    thought: str | None = None
    reasoning_tokens = 0
    if ctx.reasoning is not None:  # the thinking apart; the content alone is read for calls
        splitter = ctx.reasoning.splitter(ctx.reasoning_state)
        thought, text = thinking.feed_output(splitter, c.token_texts, final=True)
        thought = thought if splitter.thought else None
        reasoning_tokens = splitter.reasoning_tokens
    content: str | None = text  # None: an answer that is only calls
    calls: list[tools.ToolCall] = []
    if ctx.tools is not None:
        content, calls = ctx.tools.parse_answer(text)
    logprobs = chat_logprobs(ctx.names, c.logprobs)["content"] if ctx.logprobs else None
    output = [] if thought is None else [_reasoning(thought, status)]
    if content or (content is not None and not output):  # an empty answer is a message, after no thinking
        output.append(_message(content, status, logprobs))
    output += [_function_call(call) for call in calls]
    usage = _usage(c.num_prompt_tokens, c.num_cached_tokens, len(c.token_ids), reasoning_tokens)
    return _response(ctx, status, output, usage, incomplete=incomplete)


def _keep(ctx: _Context, response: dict[str, Any], owner: str | None) -> None:
    if ctx.store is not None:
        conversation = ctx.history + ctx.input_items + response["output"]
        ctx.store.put(ctx.rid, StoredResponse(response, ctx.input_items, conversation,
                                              background=bool(ctx.body.get("background")), owner=owner))


# ---- streaming -----------------------------------------------------------------------------------


def _event(ctx: _Context, kind: str, **fields: Any) -> bytes:
    data = {"type": kind, "sequence_number": next(ctx.sequence), **fields}
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


@dataclass
class _OpenItem:
    """The message or reasoning item being streamed."""

    index: int
    item_id: str
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)


class _StreamRenderer:
    """The events of one streamed response, item by item: its thinking (a reasoning item), its text (a
    message item) and its calls (function_call items), in the order the answer gives them."""

    def __init__(self, ctx: _Context) -> None:
        self.ctx = ctx
        self.output: list[dict[str, Any]] = []
        self.message: _OpenItem | None = None
        self.thinking: _OpenItem | None = None
        self.held = ""  # blank text while no message is open (an answer that is only calls has no message)
        self.pending: list[TokenLogprob] = []  # logprobs of text not yet sent

    def event(self, kind: str, **fields: Any) -> bytes:
        return _event(self.ctx, kind, **fields)

    def thought(self, text: str) -> list[bytes]:
        events = []
        if self.thinking is None:
            self.thinking = _OpenItem(len(self.output), _new_id("rs"))
            item = {"id": self.thinking.item_id, "type": "reasoning", "status": "in_progress", "summary": [],
                    "content": []}
            events.append(self.event("response.output_item.added", output_index=self.thinking.index, item=item))
        self.thinking.text += text
        events.append(self.event("response.reasoning_text.delta", item_id=self.thinking.item_id,
                                 output_index=self.thinking.index, content_index=0, delta=text))
        return events

    def close_thinking(self, status: str) -> list[bytes]:
        t, self.thinking = self.thinking, None
        assert t is not None  # called only while a reasoning item is open
        item = _reasoning(t.text, status, t.item_id)
        self.output.append(item)
        return [self.event("response.reasoning_text.done", item_id=t.item_id, output_index=t.index, content_index=0,
                           text=t.text),
                self.event("response.output_item.done", output_index=t.index, item=item)]

    def open_message(self) -> list[bytes]:
        events = self.close_thinking("completed") if self.thinking is not None else []
        m = self.message = _OpenItem(len(self.output), _new_id("msg"))
        item = {"id": m.item_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return events + [
            self.event("response.output_item.added", output_index=m.index, item=item),
            self.event("response.content_part.added", item_id=m.item_id, output_index=m.index, content_index=0,
                       part=part)]

    def text(self, text: str) -> list[bytes]:
        if self.message is None and self.ctx.tools is not None and not (self.held + text).strip():
            self.held += text  # kept only if text follows or no call comes
            return []
        text, self.held = self.held + text, ""
        events = self.open_message() if self.message is None else []
        m = self.message
        assert m is not None  # open, or just opened
        lps = chat_logprobs(self.ctx.names, self.pending)["content"] if self.ctx.logprobs else []
        self.pending = []
        m.text += text
        m.logprobs += lps
        events.append(self.event("response.output_text.delta", item_id=m.item_id, output_index=m.index,
                                 content_index=0, delta=text, logprobs=lps))
        return events

    def close_message(self, status: str) -> list[bytes]:
        m, self.message = self.message, None
        assert m is not None  # called only while a message is open
        item = _message(m.text, status, m.logprobs, m.item_id)
        self.output.append(item)
        return [self.event("response.output_text.done", item_id=m.item_id, output_index=m.index, content_index=0,
                           text=m.text, logprobs=m.logprobs),
                self.event("response.content_part.done", item_id=m.item_id, output_index=m.index, content_index=0,
                           part=item["content"][0]),
                self.event("response.output_item.done", output_index=m.index, item=item)]

    def call(self, call: tools.ToolCall) -> list[bytes]:
        self.held = ""
        events = self.close_thinking("completed") if self.thinking is not None else []
        events += self.close_message("completed") if self.message is not None else []
        index = len(self.output)
        item = _function_call(call)
        self.output.append(item)
        return events + [
            self.event("response.output_item.added", output_index=index,
                       item={**item, "status": "in_progress", "arguments": ""}),
            self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                       delta=call.arguments),
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       name=call.name, arguments=call.arguments),
            self.event("response.output_item.done", output_index=index, item=item)]

    def finish(self, status: str) -> list[bytes]:
        events = []
        if self.message is None and not self.output and self.thinking is None:
            events += self.open_message()  # no thinking, no call: the answer is a message, even an empty one
            if self.held:
                events += self.text("")
        if self.thinking is not None:
            events += self.close_thinking(status)
        if self.message is not None:
            events += self.close_message(status)
        return events


async def _stream(ctx: _Context, outputs: AsyncIterator[tuple[int, RequestOutput]],
                  owner: str | None) -> AsyncGenerator[bytes, None]:
    yield _event(ctx, "response.created", response=_response(ctx, "in_progress", []))
    yield _event(ctx, "response.in_progress", response=_response(ctx, "in_progress", []))
    r = _StreamRenderer(ctx)
    parser = ctx.tools.stream_parser() if ctx.tools is not None else None
    splitter = ctx.reasoning.splitter(ctx.reasoning_state) if ctx.reasoning is not None else None
    prompt = cached = generated = 0
    finish: str | None = None
    async for _, out in outputs:
        prompt, cached = out.num_prompt_tokens, out.num_cached_tokens
        generated += len(out.new_token_ids)
        if ctx.logprobs and out.logprobs:
            r.pending += out.logprobs
        thought, text = "", out.text_delta
        if splitter is not None:  # the thinking apart; the content alone is read for calls
            thought, text = thinking.feed_output(splitter, out.texts_per_token() if out.new_token_ids else [],
                                                 "" if out.new_token_ids else out.text_delta, final=out.finished)
        text, calls = parser.feed(text, final=out.finished) if parser is not None else (text, [])
        events = r.thought(thought) if thought else []
        events += r.text(text) if text else []
        for call in calls:
            events += r.call(call)
        for event in events:
            yield event
        if out.finished:
            finish = out.finish_reason
    status, incomplete = _status(finish)
    for event in r.finish(status):
        yield event
    usage = _usage(prompt, cached, generated, splitter.reasoning_tokens if splitter is not None else 0)
    response = _response(ctx, status, r.output, usage, incomplete=incomplete)
    _keep(ctx, response, owner)
    yield _event(ctx, "response.incomplete" if status == "incomplete" else "response.completed", response=response)


# ---- background responses ------------------------------------------------------------------------


HANDLER = Responses()


async def _run_background(serving: ServingContext, plan: Plan[_Context], entry: StoredResponse) -> None:
    ctx = plan.context
    entry.response = {**entry.response, "status": "in_progress"}
    try:
        results = await collect_all(serving, plan.requests)
        final = _final(ctx, results[0][0])
    except asyncio.CancelledError:
        final = _response(ctx, "cancelled", [])
    except Exception as exc:  # the failure is the response's, read by whoever polls it
        err = _named(error_info(exc))
        final = _response(ctx, "failed", [], error={"code": err.code or "server_error", "message": err.message})
    entry.task = None
    if ctx.store is not None and ctx.store.get(ctx.rid) is entry:  # not deleted or evicted meanwhile
        ctx.store.put(ctx.rid, StoredResponse(final, ctx.input_items, ctx.history + ctx.input_items + final["output"],
                                              background=True, owner=_owner(plan)))


async def _start_background(request: Request, serving: ServingContext, body: dict[str, Any]) -> Response:
    plan = await HANDLER.lower(body, serving)
    await check_answer_volume(serving, plan.requests, HANDLER.logprob_fields)
    for r in plan.requests:
        r.client = r.client or client_identity(request)
    ctx = plan.context
    queued = _response(ctx, "queued", [])
    entry = StoredResponse(queued, ctx.input_items, ctx.history + ctx.input_items, background=True, owner=_owner(plan))
    if ctx.store is None or not ctx.store.put(ctx.rid, entry):
        raise BridgeError(400, "background: the input is larger than the response store holds "
                               "(--responses-store-max-mb)", param="background")
    entry.task = asyncio.create_task(_run_background(serving, plan, entry))
    return JSONResponse(queued, headers=plan.headers)


# ---- the endpoints -------------------------------------------------------------------------------


@endpoint(render_error)
@with_context
async def create(request: Request, serving: ServingContext) -> Response:
    body = await HANDLER.read(request, serving)
    if body.get("background"):
        return await _start_background(request, serving, body)
    return await serve(request, serving, HANDLER, body, validated=True)


def _stored(request: Request, store: ResponseStore) -> tuple[str, StoredResponse]:
    rid = request.path_params["response_id"]
    entry = store.get(rid)
    if entry is None:
        raise _not_found(rid)
    return rid, entry


@endpoint(render_error)
@with_context
async def retrieve(request: Request, serving: ServingContext) -> Response:
    if request.query_params.get("stream", "false").lower() not in ("false", "0"):
        raise BridgeError(400, "stream: a kept response is returned whole, not replayed as events", param="stream")
    _, entry = _stored(request, serving.responses)
    return JSONResponse(entry.response)


@endpoint(render_error)
@with_context
async def delete(request: Request, serving: ServingContext) -> Response:
    rid = request.path_params["response_id"]
    if serving.responses.delete(rid) is None:
        raise _not_found(rid)
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


@endpoint(render_error)
@with_context
async def cancel(request: Request, serving: ServingContext) -> Response:
    """Only a background response can be cancelled (OpenAI's rule); cancelling a cancelled one is a no-op."""
    rid, entry = _stored(request, serving.responses)
    if not entry.background:
        raise BridgeError(400, "Cannot cancel a synchronous response.", param="response_id")
    status = entry.response["status"]
    if entry.running and entry.task is not None:
        task = entry.task
        task.cancel()
        await asyncio.wait([task])
    elif status != "cancelled":
        raise BridgeError(400, f"Cannot cancel a {status} response.", param="response_id")
    current = serving.responses.get(rid)
    return JSONResponse((current or entry).response)


def _int_query(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise BridgeError(400, f"{name}: an integer from {low} to {high}", param=name)
    return int(raw)


@endpoint(render_error)
@with_context
async def input_items(request: Request, serving: ServingContext) -> Response:
    """The items a response was given (its own input, not the earlier turns'), a page at a time."""
    _, entry = _stored(request, serving.responses)
    limit = _int_query(request, "limit", 20, 1, 100)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BridgeError(400, "order: asc or desc", param="order")
    items = entry.input_items if order == "asc" else entry.input_items[::-1]
    after = request.query_params.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise BridgeError(400, f"after: no input item '{after}' in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


PROTOCOL = Protocol("responses", (
    Operation("POST", "/v1/responses", create, "OpenAI Responses: answer input items (stream, tools, text.format, "
              "store, previous_response_id, background)", ("openai-responses",), streams=True),
    Operation("GET", "/v1/responses/{response_id}", retrieve, "OpenAI Responses: a kept response"),
    Operation("DELETE", "/v1/responses/{response_id}", delete, "OpenAI Responses: forget a kept response"),
    Operation("POST", "/v1/responses/{response_id}/cancel", cancel, "OpenAI Responses: cancel a background "
              "response"),
    Operation("GET", "/v1/responses/{response_id}/input_items", input_items,
              "OpenAI Responses: the input items of a kept response"),
))
