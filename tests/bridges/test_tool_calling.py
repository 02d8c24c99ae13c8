"""OpenAI tool calling with the real model and the official client: `tool_choice` required and named
are enforced (the arguments validate against the function's schema), streamed `tool_calls` deltas
reassemble into the non-streamed call, and a call -> result -> answer conversation runs through the
template."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

# Both tools are bounded in tokens, so a sampled call always ends within the tests' max_tokens: a city of at most
# 20 plain letters is at most ~50 tokens with the call's frame (a bare maxLength would let a sample write 20
# escapes, six tokens each, and be cut by max_tokens at random)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                                           "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                       "b": {"type": "integer", "minimum": -999, "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.http_url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def model(live_server):
    return live_server.engine.model_info.name


def test_required_gives_calls_whose_arguments_validate(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required", n=4,
                                       temperature=1.0, max_tokens=64)
    for choice in r.choices:
        # `required` allows several calls: a sample that keeps calling may be cut by max_tokens after
        # complete ones (finish "length"); every complete call must still be there and validate
        assert choice.finish_reason in ("tool_calls", "length") and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            assert call.id.startswith("call_") and call.type == "function"


def test_a_named_function_is_always_that_function(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, n=4, temperature=1.0, max_tokens=48,
                                       tool_choice={"type": "function", "function": {"name": "add"}})
    for choice in r.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), ADD)


def test_parallel_tool_calls_false_makes_one_call(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required", n=3,
                                       temperature=1.0, max_tokens=64, parallel_tool_calls=False)
    assert all(len(c.message.tool_calls) == 1 for c in r.choices)


def test_streamed_deltas_reassemble_into_the_same_call(client, model):
    whole = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=48)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                temperature=0, max_tokens=48, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += (delta.function.name or "") if delta.function else ""
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
        finish = chunk.choices[0].finish_reason or finish
    expected = [{"name": c.function.name, "arguments": c.function.arguments}
                for c in whole.choices[0].message.tool_calls]
    assert [calls[i] for i in sorted(calls)] == expected and finish == "tool_calls"


def test_a_call_result_answer_conversation_runs_through_the_template(client, model, live_server):
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=48)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=12,
                                           extra_body={"return_token_ids": True})
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = live_server.engine.tokenizer.decode(final.model_extra["prompt_token_ids"])
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt  # the tools, in the system turn
    assert "18 degrees and sunny" in prompt and "<tool_call>" in prompt  # the earlier call and its result


def test_tool_choice_errors(fake):
    """Refused by the bridge before any engine: on the scripted fake engine."""
    client = openai.OpenAI(base_url=fake.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = fake.engine.model_info.name
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(model=model, messages=ASK, tool_choice="required")
