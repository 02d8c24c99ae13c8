"""tool_choice required on the embedded model with a schema that says nothing of additionalProperties: the
arguments grammar allows only the named properties (as vLLM's default backend does), so the call closes and
the answer finishes with tool_calls, greedy and sampled."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

OPEN = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"}},
        "required": ["city"]}  # no additionalProperties
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": OPEN}}]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_finishes_with_a_call_for_a_schema_without_additional_properties(live_server, temperature):
    client = openai.OpenAI(base_url=live_server.http_url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=live_server.engine.model_info.name, tools=TOOLS, tool_choice="required",
                                       messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                       temperature=temperature, seed=7, max_tokens=48, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}


# as pydantic writes a model with a nested one: the nested type under $defs, named by "#/$defs/..."
WITH_DEFS = {"type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}, "days": {"type": "integer",
                                                                                         "minimum": 1, "maximum": 7}},
             "required": ["place", "days"],
             "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                 "required": ["city"]}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "forecast"}}],
                         ids=["required", "named"])
def test_a_schema_with_defs_and_refs_constrains_the_call(live_server, choice):
    """The parameters' "#/$defs/..." references still name their definitions once the parameters are one
    property of the call's grammar (they were refused as pointing nowhere)."""
    client = openai.OpenAI(base_url=live_server.http_url + "/v1", api_key="x", max_retries=0)
    tools = [*TOOLS, {"type": "function", "function": {"name": "forecast", "parameters": WITH_DEFS}}]
    r = client.chat.completions.create(model=live_server.engine.model_info.name, tools=tools, tool_choice=choice,
                                       messages=[{"role": "user", "content": "The forecast for Paris, 3 days?"}],
                                       temperature=0, max_tokens=64, parallel_tool_calls=False)
    answer = r.choices[0]
    assert answer.finish_reason == "tool_calls"
    (call,) = answer.message.tool_calls
    if call.function.name == "forecast":
        jsonschema.validate(json.loads(call.function.arguments), WITH_DEFS)
    else:  # "required" lets the model pick either function
        assert choice == "required" and set(json.loads(call.function.arguments)) == {"city"}
