"""Anthropic Messages: POST /v1/messages and POST /v1/messages/count_tokens.

A conversation in Anthropic's shape (a ``system`` beside the turns; content as blocks: text, tool_use,
tool_result) is lowered onto the same chat prompt, tool plan and sampling knobs as an OpenAI chat
completion (bridges/tools.py, bridges/sampling_table.py), so one conversation gives one answer through
either door. Answers, stream events and errors are Anthropic's own: ``message`` objects with content
blocks and ``stop_reason``, the typed SSE events (``message_start`` .. ``message_stop``), and
``{"type": "error", "error": {"type", "message"}}`` with Anthropic's statuses (529 for a busy server)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bridges import reasoning as thinking
from bridges import tool_formats, tools
from bridges.common import BridgeError, Completion, endpoint, read_json
from bridges.context import ServingContext, with_context
from bridges.errors import ErrorInfo
from bridges.openai import check_model
from bridges.registry import Operation, Protocol
from bridges.sampling_table import sampling_kwargs
from bridges.serving import Handler, JSONAnswer, Plan, route
from engine.request import ChatPrompt, GenerationRequest, RequestOutput
from engine.sampling_params import SamplingParams

# a full queue and an engine that is unavailable or shutting down are "overloaded" to Anthropic's
# clients (529, which they retry); TGI-style 422 is its 400
STATUSES = {422: 400, 429: 529, 503: 529}
# block types a conversation may carry; any other (image, document, server tools' results) is refused
TEXT_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def render_error(err: ErrorInfo) -> dict[str, Any]:
    """Anthropic's error body (also a refusal made before a handler runs, such as a missing API key)."""
    return {"type": "error", "error": {"type": err.anthropic_type, "message": err.message}}


def event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event in Anthropic's framing: its type as the event name, the object as data."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


# ---- the conversation ---------------------------------------------------------------------------


def _text(blocks: list[dict[str, Any]], where: str) -> str:
    """The text of a list of text blocks (a system prompt, a tool result's content)."""
    parts = []
    for j, block in enumerate(blocks):
        if block.get("type") != "text":
            raise BridgeError(400, f"{where}[{j}].type: {block.get('type')!r} blocks are not supported here; "
                                   "only text", param=f"{where}[{j}].type")
        parts.append(block.get("text", ""))
    return "".join(parts)


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    content = block.get("content")
    text = content if isinstance(content, str) else _text(content or [], f"{where}.content")
    if block.get("is_error"):  # the model reads that the call failed, not a result
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages (what bridges/tools.py lowers): the system prompt first,
    an assistant's tool_use blocks as its tool_calls, each tool_result block as a tool message.
    Thinking blocks of earlier turns are dropped, as chat templates drop earlier reasoning."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": system if isinstance(system, str) else _text(system, "system")})
    for i, message in enumerate(body["messages"]):
        role, content = message["role"], message["content"]
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            where, kind = f"messages[{i}].content[{j}]", block["type"]
            if kind not in TEXT_BLOCKS:
                raise BridgeError(400, f"{where}.type: {kind!r} content blocks are not supported: this server "
                                       f"serves a text model (blocks: {', '.join(TEXT_BLOCKS)})",
                                  param=f"{where}.type")
            if (kind in ("tool_use", "thinking", "redacted_thinking") and role != "assistant") or \
                    (kind == "tool_result" and role != "user"):
                owner = "user" if kind == "tool_result" else "assistant"
                raise BridgeError(400, f"{where}.type: {kind} blocks belong to {owner} turns", param=f"{where}.type")
            if kind == "text":
                texts.append(block["text"])
            elif kind == "tool_use":
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": block["input"]}})
            elif kind == "tool_result":
                if texts:  # text before a result is its own user turn, in order
                    out.append({"role": "user", "content": "".join(texts)})
                    texts = []
                out.append(_tool_result(block, where))
        if role == "assistant":
            out.append({"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
        elif texts or not any(b["type"] == "tool_result" for b in content):
            out.append({"role": "user", "content": "".join(texts)})
    return out


def chat_tools(body: dict[str, Any]) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` in OpenAI's words (what tools.plan reads). ``any`` is ``required``,
    ``tool`` names one function; ``disable_parallel_tool_use`` allows one call."""
    out: dict[str, Any] = {}
    if body.get("tools"):
        out["tools"] = [{"type": "function", "function": {
            "name": t["name"], **({"description": t["description"]} if "description" in t else {}),
            "parameters": t["input_schema"]}} for t in body["tools"]]
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice["type"]
        if kind == "tool":
            if not choice.get("name"):
                raise BridgeError(400, "tool_choice.name is required when tool_choice.type is 'tool'",
                                  param="tool_choice.name")
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif "name" in choice:
            raise BridgeError(400, f"tool_choice.name goes with type 'tool', not {kind!r}", param="tool_choice.name")
        else:
            out["tool_choice"] = {"any": "required"}.get(kind, kind)
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    elif out.get("tools"):
        out["tool_choice"] = "auto"
    return out


def conversation(ctx: ServingContext, body: dict[str, Any]) -> tuple[ChatPrompt, tools.ToolPlan, dict[str, Any]]:
    """(the chat prompt, its tool plan, the tool fields in OpenAI's words) of a Messages body."""
    options = ctx.options
    if (body.get("thinking") or {}).get("type") == "enabled" and not options.reasoning_parser:
        raise BridgeError(400, "thinking: extended thinking needs a reasoning parser (--reasoning-parser), and this "
                               "server runs without one; send thinking {\"type\": \"disabled\"} or leave it out",
                          param="thinking")
    tool_body = chat_tools(body)
    tool_plan = tools.plan(tool_body, chat_messages(body), native=ctx.model.chat_template_tools,
                           fmt=tool_formats.get_format(options.tool_call_parser))
    messages = tool_plan.messages
    # Anthropic's prefill: a last assistant turn is the start of the answer, continued as written
    prefill = bool(messages) and messages[-1].role == "assistant" and not messages[-1].tool_calls \
        and body["messages"][-1]["role"] == "assistant"
    prompt = ChatPrompt(messages, add_generation_prompt=not prefill, continue_final_message=prefill,
                        tools=tool_plan.template_tools)
    return prompt, tool_plan, tool_body


# ---- /v1/messages -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AnthropicContext:
    """What rendering a message needs besides its engine request."""

    model: str
    rid: str
    stops: list[str]  # the client's stop_sequences (stop_reason "stop_sequence" names one)
    tools: tools.ToolPlan | None = None  # tools offered: the answer is parsed for calls
    one_call: bool = False  # auto with disable_parallel_tool_use: one call at most
    stop_at_call_end: bool = False  # ... enforced by stopping at the first call's end (Hermes' closing tag)
    reasoning: thinking.ReasoningParser | None = None  # --reasoning-parser: the thinking split out
    reasoning_state: thinking.State = "undecided"


def _usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict[str, int]:
    """Anthropic counts input tokens read from the cache apart from the others (their sum is the prompt)."""
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _stop_reason(answer: AnthropicContext, finish: str | None, stop: str | int | None,
                 calls: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's words."""
    if calls:
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "stop" and isinstance(stop, str) and stop in answer.stops:
        return "stop_sequence", stop
    return "end_turn", None


def _closing(answer: AnthropicContext, stop: str | int | None) -> str:
    """The call's end the engine stopped at (one_call): given back, so the call parses."""
    return tools.CALL_CLOSE if answer.stop_at_call_end and stop == tools.CALL_CLOSE else ""


def _thinking_block(text: str) -> dict[str, Any]:
    # the signature proves to Anthropic's API that it wrote the thinking; this server checks none
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_use(call: tools.ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name,
            "input": json.loads(call.arguments)}


class Messages(Handler[AnthropicContext]):
    schema = "anthropic-messages"
    statuses = STATUSES
    legacy = False

    def render_error(self, err: ErrorInfo) -> dict[str, Any]:
        return render_error(err)

    def error_event(self, err: ErrorInfo, plan: Plan[AnthropicContext]) -> bytes:
        """A failure after the first byte: Anthropic's ``error`` event."""
        return event("error", render_error(err))

    async def lower(self, body: dict[str, Any], ctx: ServingContext) -> Plan[AnthropicContext]:
        model, lora = check_model(ctx, body)
        prompt, tool_plan, tool_body = conversation(ctx, body)
        if tool_plan.parse and tool_body.get("tool_choice") == "auto" and not ctx.options.enable_auto_tool_choice:
            raise BridgeError(400, 'tool_choice "auto" needs the server to run with --enable-auto-tool-choice',
                              param="tool_choice")
        # vLLM's /v1/messages is its chat endpoint underneath: the model's recommended sampling applies alike
        kw = sampling_kwargs("anthropic", body, server_defaults=dict(ctx.options.openai_sampling_defaults),
                             max_tokens_cap=ctx.options.openai_max_tokens_cap)
        stops = list(kw.get("stop", []))
        one_call = tool_plan.parse and tool_plan.constraint is None and tool_body.get("parallel_tool_calls") is False
        hermes = isinstance(tool_plan.format, tool_formats.ToolFormat) and tool_plan.format.name == "hermes"
        if one_call and hermes:  # at most one call: the answer ends where the first call does
            kw["stop"] = stops + [tools.CALL_CLOSE]
        params = SamplingParams(**kw, constraint=tool_plan.constraint)
        rid = f"msg_{uuid.uuid4().hex}"
        req = GenerationRequest(rid, prompt, params, lora=lora)
        parser = thinking.get_parser(ctx.options.reasoning_parser)
        state: thinking.State = "undecided"
        if parser is not None:  # the thinking apart, as thinking blocks; budget_tokens caps it
            config = body.get("thinking") or {}
            budget = config.get("budget_tokens") if config.get("type") == "enabled" else None
            if budget is not None and budget >= params.max_tokens:
                raise BridgeError(400, f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                                       f"({params.max_tokens})", param="thinking.budget_tokens")
            state = await thinking.prepare(ctx.engine, parser, req, budget, budget_field="thinking.budget_tokens")
        answer = AnthropicContext(model, rid, stops, tool_plan if tool_plan.parse else None, one_call,
                                  one_call and hermes, parser, state)
        return Plan([req], bool(body.get("stream")), body, context=answer)

    async def render_final(self, plan: Plan[AnthropicContext], results: list[list[Completion]]) -> Response:
        answer = plan.context
        (c,) = results[0]
        text, thought = c.text, ""
        calls: list[tools.ToolCall] = []
        if answer.reasoning is not None:
            splitter = answer.reasoning.splitter(answer.reasoning_state)
            thought, text = thinking.feed_output(splitter, c.token_texts, final=True)
        text += _closing(answer, c.stop_reason)
        if answer.tools is not None:
            content, calls = answer.tools.parse_answer(text)
            text = text if not calls else (content or "")
            calls = calls[:1] if answer.one_call else calls
        blocks: list[dict[str, Any]] = [_thinking_block(thought)] if thought else []
        blocks += [{"type": "text", "text": text}] if text or not (calls or thought) else []
        blocks += [_tool_use(call) for call in calls]
        reason, sequence = _stop_reason(answer, c.finish_reason, c.stop_reason, len(calls))
        return JSONAnswer({"id": answer.rid, "type": "message", "role": "assistant", "content": blocks,
                           "model": answer.model, "stop_reason": reason, "stop_sequence": sequence,
                           "usage": _usage(c.num_prompt_tokens, c.num_cached_tokens, len(c.token_ids))})

    def render_stream(self, plan: Plan[AnthropicContext],
                      outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncGenerator[bytes, None]:
        return _stream(plan.context, outputs)


class _Blocks:
    """The content blocks of one streamed message, numbered in order, at most one open at a time: starting
    one closes the one before (a thinking block before the text, the text before a tool call)."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the open block's type

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def start(self, block: dict[str, Any]) -> list[bytes]:
        events = self.close()
        self.index, self.open = self.index + 1, block["type"]
        events.append(event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                    "content_block": block}))
        return events

    def add(self, block: dict[str, Any], delta: dict[str, Any]) -> list[bytes]:
        """``delta`` into the open block of ``block``'s type, started first where another (or none) is open."""
        events = self.start(block) if self.open != block["type"] else []
        events.append(event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                    "delta": delta}))
        return events

    def tool_use(self, call: tools.ToolCall) -> list[bytes]:
        """A completed call as its own block: its input comes as one input_json_delta."""
        return [*self.start({**_tool_use(call), "input": {}}),
                *self.add({"type": "tool_use"}, {"type": "input_json_delta", "partial_json": call.arguments}),
                *self.close()]

    def finish(self) -> list[bytes]:
        """The open block closed; an empty answer is one empty text block, as the non-streamed answer has."""
        events = self.close()
        if self.index < 0:
            events += [*self.start({"type": "text", "text": ""}), *self.close()]
        return events


async def _stream(answer: AnthropicContext,
                  outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncGenerator[bytes, None]:
    """message_start, ping, then content blocks (thinking, text, tool_use), message_delta with the stop
    reason and usage, message_stop."""
    parser = answer.tools.stream_parser() if answer.tools is not None else None
    splitter = answer.reasoning.splitter(answer.reasoning_state) if answer.reasoning is not None else None
    blocks, calls, output_tokens = _Blocks(), 0, 0
    last: RequestOutput | None = None  # the latest output; None until the first
    async for _, out in outputs:
        output_tokens += len(out.new_token_ids)
        if last is None:
            yield event("message_start", {"type": "message_start", "message": {
                "id": answer.rid, "type": "message", "role": "assistant", "content": [], "model": answer.model,
                "stop_reason": None, "stop_sequence": None,
                "usage": _usage(out.num_prompt_tokens, out.num_cached_tokens, 0)}})
            yield event("ping", {"type": "ping"})
        last = out
        delta, thought = out.text_delta, ""
        if splitter is not None:
            thought, delta = thinking.feed_output(splitter, out.texts_per_token() if out.new_token_ids else [],
                                                  "" if out.new_token_ids else out.text_delta, final=out.finished)
        if thought:
            for e in blocks.add({"type": "thinking", "thinking": "", "signature": ""},
                                {"type": "thinking_delta", "thinking": thought}):
                yield e
        delta += _closing(answer, out.stop_reason) if out.finished else ""
        text, found = parser.feed(delta, final=out.finished) if parser is not None else (delta, [])
        if answer.one_call:
            found = found[:max(0, 1 - calls)]
        if text:
            for e in blocks.add({"type": "text", "text": ""}, {"type": "text_delta", "text": text}):
                yield e
        for call in found:
            calls += 1
            for e in blocks.tool_use(call):
                yield e
    for e in blocks.finish():
        yield e
    finished = last if last is not None and last.finished else None
    reason, sequence = _stop_reason(answer, finished.finish_reason if finished else None,
                                    finished.stop_reason if finished else None, calls)
    prompt_tokens, cached = (last.num_prompt_tokens, last.num_cached_tokens) if last is not None else (0, 0)
    yield event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                  "usage": _usage(prompt_tokens, cached, output_tokens)})
    yield event("message_stop", {"type": "message_stop"})


# ---- /v1/messages/count_tokens ------------------------------------------------------------------


@with_context
async def _count_tokens(request: Request, ctx: ServingContext) -> Response:
    """The prompt's tokens as /v1/messages would send it to the model (tools and system included)."""
    body = await read_json(request, "anthropic-count-tokens", ctx.options.max_request_items)
    check_model(ctx, body)
    prompt, _, _ = conversation(ctx, body)
    ids = await ctx.tokenizer.prompt_ids(prompt)
    return JSONResponse({"input_tokens": len(ids)})


messages = route(Messages())
count_tokens = endpoint(render_error, statuses=STATUSES)(_count_tokens)


PROTOCOL = Protocol("anthropic", (
    Operation("POST", "/v1/messages", messages, "Anthropic Messages", ("anthropic-messages",), streams=True),
    Operation("POST", "/v1/messages/count_tokens", count_tokens, "Anthropic token count of a Messages prompt",
              ("anthropic-count-tokens",)),
), render_refusal=render_error)
