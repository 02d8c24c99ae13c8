"""The one scripted conversation the parity harness sends through every protocol, as protocol-neutral
``Ask``s, and what the scripted engine makes of each (the expected outcome, in neutral words)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.errors import InferenceError
from tests.fake_engine import DEFAULT_ANSWER, Script
from tests.parity.protocols import Ask

SYSTEM = "You are terse."
ASK: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 1 + 2?"}]
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
ARGS = {"a": 1, "b": 2}
CALL_TEXT = f'<tool_call>\n{json.dumps({"name": "add", "arguments": ARGS})}\n</tool_call>'
AFTER_CALL = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": json.dumps(ARGS)}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 1234}
STOP = "scripted"
BOOM = "inference failed: scripted failure"


@dataclass(frozen=True)
class Case:
    name: str
    ask: Ask
    script: Script
    needs: tuple[str, ...] = ()  # the Caps a protocol must have to express it ("tools", "seed", "stop")
    # expected, in neutral words (None: not checked)
    text: str | None = None
    finish: str | None = None
    calls: tuple[tuple[str, dict], ...] = ()
    error: str | None = None
    error_names: str = ""  # a pattern the error message must match


def _script(**kw: Any) -> Script:
    return Script(**kw)


CASES: tuple[Case, ...] = (
    Case("greedy", Ask(ASK, 32), _script(), text=DEFAULT_ANSWER, finish="end"),
    Case("seeded sample", Ask(ASK, 32, sampling=SAMPLING), _script(), ("seed",), text=DEFAULT_ANSWER, finish="end"),
    Case("tool call", Ask(ASK, 64, tools=[ADD]), _script(answer=CALL_TEXT), ("tools",), text="", finish="tool_call",
         calls=(("add", ARGS),)),
    Case("tool result", Ask(AFTER_CALL, 32, tools=[ADD]), _script(), ("tools",), text=DEFAULT_ANSWER, finish="end"),
    Case("stop string", Ask(ASK, 32, stop=[STOP]), _script(), ("stop",),
         text=DEFAULT_ANSWER[:DEFAULT_ANSWER.index(STOP)], finish="stop_string"),
    Case("length", Ask(ASK, 3), _script(), finish="length"),
    Case("invalid parameter", Ask(ASK, 32, invalid=True), _script(), error="invalid", error_names="temperature"),
    Case("engine failure after the first token", Ask(ASK, 32, stream=True),
         _script(fail_after=(2, InferenceError(BOOM))), error="engine", error_names="scripted failure"),
)
# what a protocol without tools answers to a request that carries them
TOOLS_REFUSED = Case("tools refused", Ask(ASK, 32, tools=[ADD]), _script(), error="invalid",
                     error_names="tools|functions")
