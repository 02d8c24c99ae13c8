"""Anthropic Messages with the real model and the official `anthropic` client: `messages.create`,
`messages.stream` and `messages.count_tokens`, plain and through tool use -> tool result -> answer; each
greedy answer equals the OpenAI chat completion of the same conversation (one lowering, one engine)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import openai
import pytest

from tests.lazy import LazyModule

if TYPE_CHECKING:
    import anthropic
else:
    anthropic = LazyModule("anthropic")  # imported by the tests that run, not at collection

GREEDY = {"temperature": 0}  # the current SDK has no sampling arguments: sent in the body
ASK = [{"role": "user", "content": "Name three colours."}]
SYSTEM = "You are a helpful assistant."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                                           "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}
OPENAI_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                "parameters": WEATHER}}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def claude(live_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live_server.http_url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def chat(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.http_url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def model(live_server) -> str:
    return live_server.engine.model_info.name


def test_create_stream_and_count_agree_with_the_chat_completion(claude, chat, model):
    m = claude.messages.create(model=model, max_tokens=12, system=SYSTEM, messages=ASK, extra_body=GREEDY)
    c = chat.chat.completions.create(model=model, max_tokens=12, temperature=0,
                                     messages=[{"role": "system", "content": SYSTEM}, *ASK])
    assert m.content[0].text == c.choices[0].message.content and m.content[0].text
    assert {"length": "max_tokens", "stop": "end_turn"}[c.choices[0].finish_reason] == m.stop_reason
    assert m.usage.output_tokens == c.usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert claude.messages.count_tokens(model=model, system=SYSTEM, messages=ASK).input_tokens == c.usage.prompt_tokens
    with claude.messages.stream(model=model, max_tokens=12, system=SYSTEM, messages=ASK, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == final.content[0].text == m.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (m.stop_reason, m.usage.output_tokens)


def test_tool_use_then_result_then_answer_equals_the_chat_completion(claude, chat, model):
    forced = claude.messages.create(model=model, max_tokens=40, messages=WEATHER_ASK, tools=[TOOL],
                                    tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    c = chat.chat.completions.create(model=model, max_tokens=40, temperature=0, messages=WEATHER_ASK,
                                     tools=[OPENAI_TOOL],
                                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (use,) = [b for b in forced.content if b.type == "tool_use"]
    (call,) = c.choices[0].message.tool_calls
    assert forced.stop_reason == "tool_use" and use.name == call.function.name == "get_weather"
    assert use.input == json.loads(call.function.arguments)
    with claude.messages.stream(model=model, max_tokens=40, messages=WEATHER_ASK, tools=[TOOL], extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(use.name, use.input)]

    result = "18 degrees and sunny"
    m = claude.messages.create(model=model, max_tokens=16, tools=[TOOL], extra_body=GREEDY, messages=[
        *WEATHER_ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                         "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}])
    c = chat.chat.completions.create(model=model, max_tokens=16, temperature=0, tools=[OPENAI_TOOL], messages=[
        *WEATHER_ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": result}])
    message = c.choices[0].message
    text = "".join(b.text for b in m.content if b.type == "text")
    assert text == (message.content or "") and m.usage.output_tokens == c.usage.completion_tokens
    assert [(b.name, b.input) for b in m.content if b.type == "tool_use"] == [
        (t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls or []]
