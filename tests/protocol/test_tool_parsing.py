"""Tool calling's `auto` path on the fake engine: the answer is parsed with the Hermes parser, in whole
answers and in streams (calls emitted once their block closes, text before them as content)."""

from __future__ import annotations

import json

import httpx

from bridges.tools import StreamParser, parse
from tests.fake_engine import Script

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
BODY = {"messages": [{"role": "user", "content": "1+2?"}], "tools": TOOLS}


def test_auto_parses_the_call(fake):
    fake.engine.script = Script(answer="Let me add. " + CALL)
    data = httpx.post(fake.url + "/v1/chat/completions", json=BODY).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me add."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}
    prompt = fake.last_request().prompt
    assert prompt.messages[0].role == "system" and '"name": "add"' in prompt.messages[0].content


def test_auto_streams_content_then_the_call(fake):
    fake.engine.script = Script(answer="Let me add. " + CALL)
    events = [json.loads(line[6:]) for line in httpx.post(fake.url + "/v1/chat/completions", json={
        **BODY, "stream": True}).text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    calls = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls") or []]
    assert content.strip() == "Let me add." and "<tool_call>" not in content
    assert calls[0]["function"]["name"] == "add" and calls[0]["id"].startswith("call_")
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"a": 1, "b": 2}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_without_a_known_call_the_answer_is_text(fake):
    fake.engine.script = Script(answer='<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    choice = httpx.post(fake.url + "/v1/chat/completions", json=BODY).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "nope" in choice["message"]["content"]
    fake.engine.script = Script(answer="plain")
    r = httpx.post(fake.url + "/v1/chat/completions", json=BODY).json()
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "plain"}


def test_tool_choice_none_offers_no_tools(fake):
    httpx.post(fake.url + "/v1/chat/completions", json={**BODY, "tool_choice": "none"})
    assert all("<tools>" not in m.content for m in fake.last_request().prompt.messages)


def test_parsers_agree_on_any_split_of_the_text():
    text = "a <tool_c" + "x " + CALL + " b " + CALL
    content, calls = parse(text, {"add"})
    for cut in range(1, len(text)):
        parser = StreamParser({"add"})
        got, streamed = parser.feed(text[:cut])
        more, later = parser.feed(text[cut:], final=True)
        assert got + more == text.replace(CALL, "") and len(streamed + later) == 2, cut
    assert len(calls) == 2 and content == "a <tool_cx  b"
