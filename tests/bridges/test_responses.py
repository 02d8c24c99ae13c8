"""OpenAI Responses with the official `openai` client against the real model: plain, streamed (both the
raw events and the `responses.stream` helper), a function tool's call -> output -> answer, a JSON schema
format, a continuation by previous_response_id, and retrieve. Greedy responses equal the chat completion
of the same conversation: the same text and the same token counts."""

from __future__ import annotations

import json

import openai
import pytest

ASK = "Name one primary color."
INSTRUCTIONS = "Answer in a few words."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"}},
           "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
         "additionalProperties": False}
FORMAT = {"format": {"type": "json_schema", "name": "color", "schema": COLOR, "strict": True}}


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.http_url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(live_server):
    return live_server.engine.model_info.name


@pytest.fixture(scope="module")
def colored(client, model):
    return client.responses.create(model=model, input=ASK, max_output_tokens=24, temperature=0, text=FORMAT)


@pytest.fixture(scope="module")
def plain(client, model):
    return client.responses.create(model=model, instructions=INSTRUCTIONS, input=ASK, max_output_tokens=12,
                                   temperature=0)


def _same_as_chat(response, chat) -> None:
    assert response.output_text == (chat.choices[0].message.content or "")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    length = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if length else "completed")


def test_a_greedy_response_is_the_chat_completion(client, model, plain):
    chat = client.chat.completions.create(model=model, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ASK}])
    assert plain.output_text and plain.id.startswith("resp_")
    _same_as_chat(plain, chat)
    assert client.responses.retrieve(plain.id).output_text == plain.output_text


def test_streams_with_the_helper_and_the_raw_events_give_the_same_answer(client, model, colored, plain):
    args = dict(model=model, input=ASK, max_output_tokens=24, temperature=0, text=FORMAT)
    with client.responses.stream(**args) as stream:  # its final response needs a completed one
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == colored.output_text
    assert final.usage.output_tokens == colored.usage.output_tokens and final.status == "completed"
    events = list(client.responses.create(model=model, instructions=INSTRUCTIONS, input=ASK, max_output_tokens=12,
                                          temperature=0, stream=True, store=False))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_function_call_then_its_output_then_the_answer(client, model):
    ask = "What is the weather in Paris?"
    called = client.responses.create(model=model, input=ask, tools=[TOOL], tool_choice="required",
                                     max_output_tokens=32, temperature=0)
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}
    answer = client.responses.create(model=model, previous_response_id=called.id, input=[result], tools=[TOOL],
                                     max_output_tokens=16, temperature=0)
    chat = client.chat.completions.create(model=model, tools=[CHAT_TOOL], max_tokens=16, temperature=0, messages=[
        {"role": "user", "content": ask},
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C and sunny"}])
    assert chat.choices[0].message.tool_calls is None  # the answer is text (a call would be compared below too)
    _same_as_chat(answer, chat)


def test_a_json_schema_format_constrains_the_answer(client, model, colored):
    assert json.loads(colored.output_text)["color"] in ("red", "green", "blue")
    chat = client.chat.completions.create(model=model, max_tokens=24, temperature=0, messages=[
        {"role": "user", "content": ASK}], response_format={"type": "json_schema", "json_schema": {
            "name": "color", "schema": COLOR, "strict": True}})
    _same_as_chat(colored, chat)


def test_a_continuation_is_the_chat_of_the_whole_conversation_from_the_prefix_cache(client, model, plain):
    more = "And another one?"
    # instructions are not carried over from the earlier turn: given again, the conversation's start is the
    # earlier prompt's, which the prefix cache serves
    r = client.responses.create(model=model, previous_response_id=plain.id, instructions=INSTRUCTIONS, input=more,
                                max_output_tokens=12, temperature=0)
    assert r.usage.input_tokens_details.cached_tokens > 0
    chat = client.chat.completions.create(model=model, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ASK},
        {"role": "assistant", "content": plain.output_text}, {"role": "user", "content": more}])
    _same_as_chat(r, chat)
