"""JSON text inside a request's strings (tool-call arguments, schemas given as text, Ollama's format)
goes through the same bounded parser as request bodies: 10,000 nested brackets are the protocol's own
400 naming the field, never a RecursionError (500), and the server keeps serving."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.fake_engine import FAKE_MODEL
from tests.spark.client import converse, spark_request

DEEP = "[" * 10_000
DEEP_OBJECT = '{"a":' * 10_000


def _chat(**extra):
    return {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}


def _assistant_call(arguments: str) -> dict:
    return {"model": FAKE_MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "What is the weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}


CASES = [
    ("chat tool-call arguments", "/v1/chat/completions", _assistant_call(DEEP), 400,
     "messages[1].tool_calls[0].function.arguments"),
    ("chat tool-call arguments, objects", "/v1/chat/completions", _assistant_call(DEEP_OBJECT), 400,
     "messages[1].tool_calls[0].function.arguments"),
    ("chat guided_json", "/v1/chat/completions", _chat(guided_json=DEEP), 400, "guided_json"),
    ("chat structural_tag", "/v1/chat/completions", _chat(structural_tag=DEEP), 400, "structural_tag"),
    ("completions guided_json", "/v1/completions",
     {"model": FAKE_MODEL, "prompt": "Hi", "max_tokens": 4, "guided_json": DEEP}, 400, "guided_json"),
    ("sglang json_schema", "/generate", {"text": "Hi", "sampling_params": {"json_schema": DEEP}}, 400,
     "sampling_params.json_schema"),
    ("tgi grammar", "/generate", {"inputs": "Hi", "parameters": {"grammar": {"type": "json", "value": DEEP}}},
     422, "parameters.grammar.value"),
    ("triton grammar", f"/v2/models/{FAKE_MODEL}/generate",
     {"text_input": "Hi", "parameters": {"grammar": {"type": "json", "value": DEEP}}}, 400,
     "parameters.grammar.value"),
    ("mindie grammar", "/infer", {"inputs": "Hi", "parameters": {"grammar": {"type": "json", "value": DEEP}}}, 400,
     "parameters.grammar.value"),
    ("ollama generate format", "/api/generate", {"model": FAKE_MODEL, "prompt": "Hi", "stream": False,
                                                 "format": DEEP}, 400, "format"),
    ("ollama chat format", "/api/chat", {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                         "stream": False, "format": DEEP}, 400, "format"),
]


@pytest.mark.parametrize("label, path, body, status, field", CASES, ids=[c[0] for c in CASES])
def test_deeply_nested_json_text_is_a_400_naming_its_field(fake, label, path, body, status, field):
    with httpx.Client(base_url=fake.url, timeout=30) as client:
        resp = client.post(path, json=body)
        assert resp.status_code == status, resp.text
        assert field in resp.text and "nests deeper than 64 levels" in resp.text, resp.text
        error = resp.json()["error"]
        if isinstance(error, dict):
            assert error["param"] == field, error
        assert not fake.engine.requests  # refused while lowering
        ok = client.post("/v1/completions", json={"model": FAKE_MODEL, "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text  # the server goes on


def test_tool_call_arguments_that_are_not_json_name_the_field(fake):
    with httpx.Client(base_url=fake.url, timeout=30) as client:
        resp = client.post("/v1/chat/completions", json=_assistant_call('{"city": '))
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
    assert "is not valid JSON" in resp.json()["error"]["message"]


def test_a_spark_schema_given_as_deep_text_is_10000(fake):
    body = spark_request("Hi", max_tokens=4,
                         response_format={"type": "json_schema", "json_schema": {"name": "x", "json_schema": DEEP}})
    frames = asyncio.run(converse(fake.ws_url, body))
    header = frames[-1]["header"]
    assert header["code"] == 10000 and header["status"] == 2, header
    assert "response_format" in header["message"], header
    ok = asyncio.run(converse(fake.ws_url, spark_request("Hi", max_tokens=2)))
    assert ok[-1]["header"]["code"] == 0


def test_a_model_answer_of_deep_brackets_in_a_call_block_is_plain_text():
    """The Hermes parser reads the model's own text: nesting it cannot parse is not a call, not a crash."""
    from bridges import tools

    text = f"<tool_call>\n{DEEP}\n</tool_call>"
    content, calls = tools.parse(text, {"weather"})
    assert calls == [] and content == text
