"""OpenAI tool calling on any chat model: tools rendered for the template, `tool_choice` enforced with the
structured-output machinery, and the answer parsed back into `tool_calls`.

The call format is Hermes-style (what ChatML models such as Qwen and Hermes are trained on):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template that knows tools gets them (and earlier calls and results) natively; one that does not
(SmolLM2's) gets them written into the system turn, as vLLM does, with earlier calls and results as text
in the same format."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from bridges.common import BridgeError, parse_json_field
from engine.request import ChatMessage
from engine.structured import Constraint
from schemas.json_body import JsonBodyError, parse_json

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PARSERS = ("hermes",)  # --tool-call-parser choices

SYSTEM_TOOLS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass
class ToolPlan:
    """What a chat request's tool fields mean for the prompt, the constraint and the answer's parsing."""

    messages: list[ChatMessage]
    template_tools: list[dict] | None = None  # for templates that render tools themselves
    constraint: Constraint | None = None  # tool_choice required / named
    parse: bool = False  # look for calls in the answer
    names: set[str] = field(default_factory=set)
    format: Any = None  # the model's call format (bridges/tool_formats.py); None: Hermes

    def parse_answer(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls) of a whole answer, in this plan's format."""
        return self.format.parse(text, self.names) if self.format is not None else parse(text, self.names)

    def stream_parser(self) -> Any:
        """A parser with ``feed(delta, final) -> (content, completed calls)`` for a streamed answer."""
        return self.format.stream_parser(self.names) if self.format is not None else StreamParser(self.names)


def _functions(tools: list[dict]) -> list[dict]:
    functions = []
    for i, tool in enumerate(tools):
        if tool.get("type", "function") != "function" or "function" not in tool:
            raise BridgeError(400, f"tools[{i}]: only function tools are supported", param=f"tools[{i}]")
        functions.append(tool["function"])
    return functions


def _arguments(call: dict, where: str) -> Any:
    args = call.get("function", {}).get("arguments", "{}")
    if isinstance(args, str):
        return parse_json_field(args or "{}", f"{where}.function.arguments")
    return args


def call_text(name: str, arguments: Any) -> str:
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def plan(body: dict[str, Any], messages: list[dict[str, Any]], native: bool, fmt: Any = None) -> ToolPlan:
    """``messages``: the request's own; ``native``: the chat template renders tools itself; ``fmt``: the
    model's call format (bridges/tool_formats.py; None: Hermes)."""
    tools = body.get("tools") or []
    choice = body.get("tool_choice")
    functions = _functions(tools)
    names = {f["name"] for f in functions}
    if choice not in (None, "none", "auto", "required"):
        name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
        if name not in names:
            raise BridgeError(400, f"tool_choice names {name!r}, which is not among the tools "
                                   f"({', '.join(sorted(names)) or 'none given'})", param="tool_choice")
    if choice in ("auto", "required") and not functions:
        raise BridgeError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
    offered = functions if choice != "none" else []
    lowered = _messages(messages, native, fmt)
    result = ToolPlan(lowered, names=names, format=fmt)
    if offered and native:
        result.template_tools = tools
    elif offered and fmt is not None:
        fmt.describe(lowered, offered)
    elif offered:
        described = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in offered)
        text = SYSTEM_TOOLS.format(tools=described)
        if lowered and lowered[0].role == "system":
            lowered[0] = ChatMessage("system", lowered[0].content + "\n\n" + text)
        else:
            lowered.insert(0, ChatMessage("system", text))
    if choice == "required" or isinstance(choice, dict):
        forced = [f for f in functions if not isinstance(choice, dict) or f["name"] == choice["function"]["name"]]
        many = choice == "required" and body.get("parallel_tool_calls") is not False
        result.constraint = fmt.grammar(forced, many) if fmt is not None else _calls_grammar(forced, many)
    result.parse = bool(offered)
    return result


def _messages(messages: list[dict[str, Any]], native: bool, fmt: Any = None) -> list[ChatMessage]:
    out = []
    for i, m in enumerate(messages):
        role = "system" if m["role"] == "developer" else m["role"]
        content = _content(m)
        calls = m.get("tool_calls") or []
        # an earlier answer's thinking (vLLM's reasoning_content, or its newer name): the template decides
        # whether it is shown (Qwen3's keeps only the latest turns'); others leave it out
        thinking = m.get("reasoning_content", m.get("reasoning")) if role == "assistant" else None
        if native:
            out.append(ChatMessage(role, content, tool_calls=[
                {"type": "function", "id": c.get("id"), "function": {
                    "name": c["function"]["name"], "arguments": _arguments(c, f"messages[{i}].tool_calls[{j}]")}}
                for j, c in enumerate(calls)] or None, tool_call_id=m.get("tool_call_id"),
                reasoning_content=thinking))
        elif calls:  # the template knows no calls: they are the answer's own text, as the model wrote them
            pairs = [(c["function"]["name"], _arguments(c, f"messages[{i}].tool_calls[{j}]"))
                     for j, c in enumerate(calls)]
            texts = [fmt.calls_text(pairs)] if fmt is not None else [call_text(n, a) for n, a in pairs]
            out.append(ChatMessage(role, "\n".join(filter(None, [content, *texts])), reasoning_content=thinking))
        elif role == "tool":
            out.append(ChatMessage("tool", fmt.result_text(content) if fmt is not None
                                   else f"<tool_response>\n{content}\n</tool_response>"))
        else:
            out.append(ChatMessage(role, content, reasoning_content=thinking))
    return out


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


def strict_parameters(schema: Any) -> Any:
    """A function's parameters schema as its calls' grammar reads it: an object schema that names its
    properties and says nothing of others allows no others (vLLM's default grammar backend does the same;
    a model left free to add keys may add them until max_tokens). Nested schemas alike; a schema that
    states ``additionalProperties`` keeps it."""
    if isinstance(schema, list):
        return [strict_parameters(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_parameters(v) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    for k in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(schema.get(k), dict):
            out[k] = {name: strict_parameters(v) for name, v in schema[k].items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema \
            and "patternProperties" not in schema and "unevaluatedProperties" not in schema:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = {"items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf", "not", "if", "then", "else",
               "contains", "propertyNames", "unevaluatedItems"}


# Keywords whose values are data, not schemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = {"const", "enum", "default", "examples"}


def rebased_refs(schema: Any, pointer: str) -> Any:
    """``schema`` with its document-local references ("#", "#/$defs/X", any JSON pointer) made to point
    into the same schema placed at ``pointer`` inside a larger document: a function's parameters become
    one property of the call's schema, and their "#/$defs/..." (as pydantic writes them) would otherwise
    name the call's root, where nothing is defined."""
    if isinstance(schema, list):
        return [rebased_refs(s, pointer) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + pointer + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = rebased_refs(value, pointer)
    return out


def _call_schema(f: dict, args_key: str, at: str) -> dict[str, Any]:
    """One function's call as a JSON object, placed at JSON pointer ``at`` of the grammar's document (its
    parameters' "#/..." references are rebased to where they land)."""
    params = strict_parameters(f.get("parameters") or {"type": "object"})
    return {"type": "object", "properties": {"name": {"const": f["name"]},
                                             args_key: rebased_refs(params, f"{at}/properties/{args_key}")},
            "required": ["name", args_key], "additionalProperties": False}


def call_schemas(functions: list[dict], args_key: str, at: str = "") -> dict[str, Any]:
    """Any one of the functions' calls, as a JSON object whose ``args_key`` holds the arguments, placed at
    JSON pointer ``at``: the call itself for one function, else an anyOf of them."""
    if len(functions) == 1:
        return _call_schema(functions[0], args_key, at)
    return {"anyOf": [_call_schema(f, args_key, f"{at}/anyOf/{i}") for i, f in enumerate(functions)]}


def _calls_grammar(functions: list[dict], many: bool) -> Constraint:
    """Exactly the call format, each call's arguments valid against its function's parameters."""
    # compact JSON, as the call format shows it
    body = {**call_schemas(functions, "arguments"), "x-guidance": {"whitespace_flexible": False}}
    repeat = "+" if many else ""
    lark = (f"start: call{repeat}\n"
            f'call: "{CALL_OPEN}\\n" args "\\n{CALL_CLOSE}"\n'
            f"args: %json {json.dumps(body)}\n")
    return Constraint("grammar", lark, field="tool_choice")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(the content outside the calls, or None when only calls; the calls) of a Hermes-format answer.
    A block that is not a JSON call of a known function stays in the content."""
    calls: list[ToolCall] = []
    rest: list[str] = []
    pos = 0
    while True:
        start = text.find(CALL_OPEN, pos)
        end = text.find(CALL_CLOSE, start + len(CALL_OPEN)) if start >= 0 else -1
        if start < 0 or end < 0:
            rest.append(text[pos:])
            break
        rest.append(text[pos:start])
        call = _call(text[start + len(CALL_OPEN):end], names)
        if call is None:
            rest.append(text[start:end + len(CALL_CLOSE)])
        else:
            calls.append(call)
        pos = end + len(CALL_CLOSE)
    content = "".join(rest).strip()
    return (content or None) if calls else text, calls


def _call(block: str, names: set[str]) -> ToolCall | None:
    try:  # the model's text: bounded like a request's, so a deeply nested "call" is just text
        obj = parse_json(block)
    except JsonBodyError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    return ToolCall(obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False))


class StreamParser:
    """Splits a streamed answer into content deltas and completed tool calls: text is passed on until a
    `<tool_call>` may be starting; a call is emitted once its block closes."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.buffer = ""
        self.calls = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        content, calls = "", []
        while True:
            start = self.buffer.find(CALL_OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self.buffer, CALL_OPEN)
                content += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            end = self.buffer.find(CALL_CLOSE, start)
            if end < 0:
                content += self.buffer[:start]
                self.buffer = self.buffer[start:]
                if final:  # an unfinished call: it was text after all
                    content += self.buffer
                    self.buffer = ""
                break
            content += self.buffer[:start]
            block = self.buffer[start:end + len(CALL_CLOSE)]
            self.buffer = self.buffer[end + len(CALL_CLOSE):]
            call = _call(block[len(CALL_OPEN):-len(CALL_CLOSE)], self.names)
            if call is None:
                content += block
            else:
                calls.append(call)
        return content, calls


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a beginning of ``marker``."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
