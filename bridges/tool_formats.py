"""The tool-call formats ``--tool-call-parser`` names, each in its model family's own form: how tools are
written into a prompt whose template does not render them, how earlier calls and results are written
back, the grammar that ``tool_choice`` required / named enforces, and how calls are read from an answer
(whole or streamed). vLLM's parsers of the same names are the reference for what the models write:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (bridges/tools.py).
- ``llama3_json``: the answer is JSON calls ``{"name": ..., "parameters": {...}}`` separated by ``; ``,
  maybe after ``<|python_tag|>``; tools are offered in the first user turn, as Llama 3.1's template does.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (content may precede it);
  tools offered as ``[AVAILABLE_TOOLS] [...][/AVAILABLE_TOOLS]``, results as ``[TOOL_RESULTS]``; call ids
  of 9 letters and digits, as Mistral's templates require.
- ``pythonic``: the answer is a Python list of calls, ``[get_weather(city='Paris'), f()]`` (Llama 3.2 /
  4), read with ``ast``, never evaluated.

Calls in the last three formats are the answer itself (``[TOOL_CALLS]`` excepted, which may follow text):
a streamed answer that opens like a call is held back and read once complete; any other streams as it
comes. Model text is bounded like a request's JSON before it is read (64 levels at most)."""

from __future__ import annotations

import ast
import json
import secrets
import string
from typing import Any

from bridges import tools
from bridges.tools import ToolCall, call_schemas, strict_parameters
from engine.request import ChatMessage
from engine.structured import Constraint
from schemas.json_body import JsonBodyError, parse_json

MAX_DEPTH = 64  # nesting a model's call text may have before it is just text (as a request's JSON)


class ToolFormat:
    """Hermes, as bridges/tools.py implements it; the other formats override."""

    name = "hermes"
    skip_special_tokens = True  # the call markers are text the answer keeps (False: special tokens to keep)

    def describe(self, messages: list[ChatMessage], functions: list[dict]) -> None:
        """Write the offered tools into the conversation (a template that does not render them)."""
        described = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
        _to_system(messages, tools.SYSTEM_TOOLS.format(tools=described))

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        return "\n".join(tools.call_text(name, args) for name, args in calls)

    def result_text(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def grammar(self, functions: list[dict], many: bool) -> Constraint:
        return tools._calls_grammar(functions, many)

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
        return tools.parse(text, names)

    def stream_parser(self, names: set[str]) -> Any:
        return tools.StreamParser(names)

    def new_id(self) -> str:
        return ToolCall("", "").id


def _to_system(messages: list[ChatMessage], text: str) -> None:
    if messages and messages[0].role == "system":
        messages[0] = ChatMessage("system", messages[0].content + "\n\n" + text)
    else:
        messages.insert(0, ChatMessage("system", text))


def _compact(schema: dict) -> str:
    return json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})


def _too_deep(text: str) -> bool:
    """Whether brackets nest deeper than MAX_DEPTH (strings not looked into: a cheap upper bound)."""
    depth = 0
    for ch in text:
        if ch in "[{(":
            depth += 1
            if depth > MAX_DEPTH:
                return True
        elif ch in "]})":
            depth -= 1
    return False


def _split_top_level(text: str, sep: str) -> list[str]:
    """``text`` cut at ``sep`` where it stands outside strings and brackets."""
    parts, depth, start, quote, i = [], 0, 0, "", 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif depth == 0 and text.startswith(sep, i):
            parts.append(text[start:i])
            start = i + len(sep)
        i += 1
    parts.append(text[start:])
    return parts


class Llama3Json(ToolFormat):
    name = "llama3_json"
    skip_special_tokens = False  # <|python_tag|> may lead the calls
    TAG = "<|python_tag|>"
    PROMPT = ("Given the following functions, please respond with a JSON for a function call with its proper "
              "arguments that best answers the given prompt.\n\nRespond in the format {{\"name\": function name, "
              "\"parameters\": dictionary of argument name and its value}}. Do not use variables.\n\n{tools}\n\n")

    def describe(self, messages: list[ChatMessage], functions: list[dict]) -> None:
        # Llama 3.1 reads the tools in the first user turn, before the question
        described = "\n\n".join(json.dumps({"type": "function", "function": f}, indent=4, ensure_ascii=False)
                                for f in functions)
        text = self.PROMPT.format(tools=described)
        first = next((i for i, m in enumerate(messages) if m.role == "user"), None)
        if first is None:
            _to_system(messages, text.rstrip())
        else:
            m = messages[first]
            messages[first] = ChatMessage("user", text + m.content, reasoning_content=m.reasoning_content)

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)

    def result_text(self, content: str) -> str:
        return content

    def grammar(self, functions: list[dict], many: bool) -> Constraint:
        body = call_schemas(functions, "parameters")
        repeat = ' ("; " call)*' if many else ""
        return Constraint("grammar", f"start: call{repeat}\ncall: %json {_compact(body)}\n", field="tool_choice")

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        body = body[len(self.TAG):].strip() if body.startswith(self.TAG) else body
        if not body.startswith("{") or _too_deep(body):
            return text, []
        calls = []
        for part in _split_top_level(body, ";"):
            try:
                obj = parse_json(part.strip())
            except JsonBodyError:
                return text, []
            if not isinstance(obj, dict) or obj.get("name") not in names:
                return text, []
            args = obj.get("parameters", obj.get("arguments", {}))
            calls.append(ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)))
        return None, calls

    def stream_parser(self, names: set[str]) -> Any:
        return HeldCalls(self, names, (self.TAG, "{"), anywhere=False)


class Mistral(ToolFormat):
    name = "mistral"
    skip_special_tokens = False  # [TOOL_CALLS] is a special token of Mistral's vocabularies
    TAG = "[TOOL_CALLS]"
    _ALPHABET = string.ascii_letters + string.digits

    def describe(self, messages: list[ChatMessage], functions: list[dict]) -> None:
        # Mistral's templates put the tools just before the last user turn
        described = json.dumps([{"type": "function", "function": f} for f in functions], ensure_ascii=False)
        text = f"[AVAILABLE_TOOLS] {described}[/AVAILABLE_TOOLS]"
        last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].role == "user"), None)
        if last is None:
            _to_system(messages, text)
        else:
            m = messages[last]
            messages[last] = ChatMessage("user", text + "\n" + m.content, reasoning_content=m.reasoning_content)

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        return self.TAG + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)

    def result_text(self, content: str) -> str:
        return f"[TOOL_RESULTS] {json.dumps({'content': content}, ensure_ascii=False)}[/TOOL_RESULTS]"

    def grammar(self, functions: list[dict], many: bool) -> Constraint:
        item = call_schemas(functions, "arguments", at="/items")
        array = {"type": "array", "items": item, "minItems": 1, **({} if many else {"maxItems": 1})}
        return Constraint("grammar", f'start: "{self.TAG}" calls\ncalls: %json {_compact(array)}\n',
                          field="tool_choice")

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.TAG)
        if at < 0:
            return text, []
        body = text[at + len(self.TAG):].strip()
        if _too_deep(body):
            return text, []
        calls: list[ToolCall] = []
        try:
            items = parse_json(body)
        except JsonBodyError:  # the newer form: name{arguments}, maybe several
            items = self._named_form(body)
        if not isinstance(items, list) or not items:
            return text, []
        for obj in items:
            if not isinstance(obj, dict) or obj.get("name") not in names:
                return text, []
            calls.append(ToolCall(obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False),
                                  id=self.new_id()))
        content = text[:at].strip()
        return content or None, calls

    def _named_form(self, body: str) -> list | None:
        items = []
        for part in body.split(self.TAG):
            brace = part.find("{")
            if brace <= 0:
                return None
            try:
                args = parse_json(part[brace:].strip())
            except JsonBodyError:
                return None
            items.append({"name": part[:brace].strip(), "arguments": args})
        return items

    def stream_parser(self, names: set[str]) -> Any:
        return HeldCalls(self, names, (self.TAG,), anywhere=True)

    def new_id(self) -> str:
        return "".join(secrets.choice(self._ALPHABET) for _ in range(9))


class Pythonic(ToolFormat):
    name = "pythonic"
    PROMPT = ("You are an expert in composing functions. You are given a question and a set of possible functions. "
              "Based on the question, you will need to make one or more function/tool calls to achieve the purpose. "
              "If none of the functions can be used, point it out. If the given question lacks the parameters "
              "required by the function, also point it out. You should only return the function call in tools call "
              "sections.\n\nIf you decide to invoke any of the function(s), you MUST put it in the format of "
              "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n"
              "You SHOULD NOT include any other text in the response.\n\nHere is a list of functions in JSON format "
              "that you can invoke.\n\n{tools}")
    _WRAP = ("<|python_start|>", "<|python_end|>")  # Llama 4 may wrap the list

    def describe(self, messages: list[ChatMessage], functions: list[dict]) -> None:
        described = json.dumps(functions, indent=4, ensure_ascii=False)
        _to_system(messages, self.PROMPT.format(tools=described))

    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        def call(name: str, args: Any) -> str:
            items = args.items() if isinstance(args, dict) else []
            return f"{name}({', '.join(f'{k}={_python_literal(v)}' for k, v in items)})"
        return "[" + ", ".join(call(n, a) for n, a in calls) + "]"

    def result_text(self, content: str) -> str:
        return content

    def grammar(self, functions: list[dict], many: bool) -> Constraint:
        """The call list with each function's own keyword names (unnamed ones only where its schema allows
        them); values are Python literals (their types are not checked against the schema)."""
        rules, alts = [], []
        for i, f in enumerate(functions):
            params = strict_parameters(f.get("parameters") or {"type": "object"})
            names = list((params.get("properties") or {}).keys()) if isinstance(params, dict) else []
            open_ended = not isinstance(params, dict) or params.get("additionalProperties", True) is not False
            keys = [json.dumps(n) for n in names if n.isidentifier()] + (["IDENT"] if open_ended or not names else [])
            if not keys:
                keys = ['""']
            rules.append(f'call{i}: {json.dumps(f["name"] + "(")} (arg{i} (", " arg{i})*)? ")"')
            rules.append(f'arg{i}: ({" | ".join(keys)}) "=" value')
            alts.append(f"call{i}")
        repeat = ' (", " call)*' if many else ""
        lark = "\n".join([
            f'start: "[" call{repeat} "]"',
            f"call: {' | '.join(alts)}",
            *rules,
            'value: STRING | NUMBER | "True" | "False" | "None" | list | dict',
            'list: "[" (value (", " value)*)? "]"',
            'dict: "{" (STRING ": " value (", " STRING ": " value)*)? "}"',
            r"""STRING: /'([^'\\\n]|\\.)*'/ | /"([^"\\\n]|\\.)*"/""",
            r"NUMBER: /-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?/",
            r"IDENT: /[A-Za-z_][A-Za-z0-9_]*/",
        ]) + "\n"
        return Constraint("grammar", lark, field="tool_choice")

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self._WRAP[0]) and body.endswith(self._WRAP[1]):
            body = body[len(self._WRAP[0]):-len(self._WRAP[1])].strip()
        if not (body.startswith("[") and body.endswith("]")) or _too_deep(body):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
                    and not node.args and all(k.arg for k in node.keywords)):
                return text, []
            try:
                args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                arguments = json.dumps(args, ensure_ascii=False)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return text, []
            calls.append(ToolCall(node.func.id, arguments))
        return None, calls

    def stream_parser(self, names: set[str]) -> Any:
        return HeldCalls(self, names, ("[", self._WRAP[0]), anywhere=False)


def _python_literal(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_python_literal(k)}: {_python_literal(v)}" for k, v in value.items()) + "}"
    return repr(str(value))


class HeldCalls:
    """A streamed answer in a format whose calls run to the answer's end: text streams as content until
    a call may begin (at the answer's start, or anywhere for ``anywhere``); from there it is held and read
    whole at the end (what is not calls after all is content then)."""

    def __init__(self, fmt: ToolFormat, names: set[str], openers: tuple[str, ...], anywhere: bool) -> None:
        self.fmt, self.names, self.openers, self.anywhere = fmt, names, openers, anywhere
        self.buffer = ""
        self.mode = "start"  # start | text | held

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        content = ""
        if self.mode == "start":
            lead = self.buffer.lstrip()
            if any(lead.startswith(o) for o in self.openers):
                self.mode = "held"
            elif not final and (not lead or any(o.startswith(lead) for o in self.openers)):
                return "", []
            else:
                self.mode = "text"
        if self.mode == "text":
            if not self.anywhere:
                content, self.buffer = self.buffer, ""
                return content, []
            at = min((i for o in self.openers if (i := self.buffer.find(o)) >= 0), default=-1)
            if at >= 0:
                content, self.buffer, self.mode = self.buffer[:at], self.buffer[at:], "held"
            else:
                keep = 0 if final else max(tools._partial_suffix(self.buffer, o) for o in self.openers)
                content = self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return content, []
        if not final:
            return content, []
        held, self.buffer = self.buffer, ""
        text, calls = self.fmt.parse(held, self.names)
        return content + (text or ""), calls


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (ToolFormat(), Llama3Json(), Mistral(), Pythonic())}
PARSERS = tuple(FORMATS)  # --tool-call-parser choices


def get_format(name: str) -> ToolFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"tool call parser {name!r} is not one of {', '.join(PARSERS)}") from None
