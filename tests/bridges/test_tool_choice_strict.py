"""tool_choice required on the embedded model with a schema that says nothing of additionalProperties: the
arguments grammar allows only the named properties (as vLLM's default backend does), so the call closes and
the answer finishes with tool_calls, greedy and sampled."""

from __future__ import annotations

import json

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
