"""The sampling table is the one place sampling fields and their defaults live: every sampling field
each schema accepts is either a knob in the table or a field the table names as handled elsewhere, and
no schema states a default that differs from the table's."""

from __future__ import annotations

import pytest

import schemas
from bridges.sampling_table import OTHER_FIELDS, TABLE, default, fields_of, sampling_kwargs
from engine.sampling_params import SamplingParams


def _properties(schema: str, *pointer: str) -> dict:
    node = schemas.load_schema(schema)
    for key in pointer:
        node = node[key]
    return node["properties"]


# where each protocol's sampling fields live in its schema
SAMPLING_OBJECTS = {
    "openai": [("openai-common", "$defs", "sampling"), ("openai-chat",), ("openai-completion",)],
    "vllm": [("vllm-generate",)],
    "sglang": [("sglang-generate", "$defs", "sampling")],
    "textgen": [("textgen-parameters",)],
    "ollama": [("ollama-common", "$defs", "options")],
    "spark": [("spark-request", "$defs", "chat")],
    "anthropic": [("anthropic-messages",)],
}
# fields of the request bodies themselves (not sampling) in the schemas that mix both
BODY_FIELDS = {
    "openai-chat": {"messages", "logprobs", "top_logprobs", "chat_template_kwargs", "response_format", "echo",
                    "add_generation_prompt", "continue_final_message", "documents", "chat_template",
                    "disable_chat_template", "tools", "tool_choice"},
    "openai-completion": {"prompt", "logprobs", "echo"},
}


@pytest.mark.parametrize("protocol", sorted(SAMPLING_OBJECTS))
def test_every_sampling_field_of_each_schema_is_in_the_table(protocol):
    known = fields_of(protocol) | OTHER_FIELDS[protocol]
    for location in SAMPLING_OBJECTS[protocol]:
        names = set(_properties(*location)) - BODY_FIELDS.get(location[0], set())
        missing = names - known
        assert not missing, f"{protocol}: {location[0]} accepts {sorted(missing)}, which the sampling table lacks"


@pytest.mark.parametrize("protocol", sorted(SAMPLING_OBJECTS))
def test_schema_defaults_agree_with_the_table(protocol):
    for location in SAMPLING_OBJECTS[protocol]:
        for name, spec in _properties(*location).items():
            if "default" not in spec:
                continue
            knob = next((k for k in TABLE if name in ((k.fields.get(protocol),) if isinstance(
                k.fields.get(protocol), str) else (k.fields.get(protocol) or ()))), None)
            if knob is not None:
                effective = default(protocol, knob.name)
                if effective is None:  # the engine's own
                    effective = getattr(SamplingParams(), knob.name)
                assert effective == spec["default"], (protocol, name)


def test_a_field_is_read_only_when_set_and_defaults_come_from_the_table():
    assert sampling_kwargs("spark", {}) == {"max_tokens": 2048, "temperature": 0.5, "top_k": 4}
    assert sampling_kwargs("spark", {"temperature": 0, "top_k": None})["temperature"] == 0.0  # 0 is a value
    assert sampling_kwargs("openai", {"max_tokens": 5, "max_completion_tokens": 7})["max_tokens"] == 7
    assert sampling_kwargs("openai", {"max_tokens": 5, "max_completion_tokens": None})["max_tokens"] == 5
    assert sampling_kwargs("sglang", {"seed": 46997.0})["seed"] == 46997 and isinstance(
        sampling_kwargs("sglang", {"seed": 46997.0})["seed"], int)
    assert sampling_kwargs("ollama", {})["temperature"] == 0.8
    assert sampling_kwargs("textgen", {"stop": "x"})["stop"] == ["x"]


def test_max_tokens_defaults_per_endpoint_and_the_context_come_from_the_table():
    assert sampling_kwargs("openai", {}, endpoint="completions", context=4096)["max_tokens"] == 16
    assert sampling_kwargs("openai", {}, endpoint="chat", context=4096)["max_tokens"] == 4096
    assert sampling_kwargs("vllm", {}, context=512)["max_tokens"] == 512
    assert sampling_kwargs("openai", {"max_tokens": 3}, endpoint="chat")["max_tokens"] == 3  # no context needed
    assert default("openai", "max_tokens", "completions") == 16
    with pytest.raises(ValueError, match="context"):
        sampling_kwargs("openai", {}, endpoint="chat")
