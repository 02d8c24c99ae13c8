"""Anthropic Messages on the scripted engine, through the official `anthropic` client and raw HTTP: what
reaches the engine (prompt, tools, sampling), the answer's blocks and stop reasons, the stream's event
sequence, and every refusal in Anthropic's error shape and status."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import httpx
import pytest

from bridges import tools
from engine.errors import EngineOverloadedError, InferenceError
from spark_server.app import build_app
from spark_server.settings import Settings
from tests.conftest import ServerThread, free_port
from tests.fake_engine import Script
from tests.lazy import LazyModule

if TYPE_CHECKING:
    import anthropic
else:
    anthropic = LazyModule("anthropic")  # imported by the tests that run, not at collection

ASK = [{"role": "user", "content": "What is 1 + 2?"}]
ADD = {"name": "add", "description": "Add two integers", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.fixture
def client(fake) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=fake.url, api_key="x", max_retries=0)


def _events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event."""
    out = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_create_answers_with_a_text_block_usage_and_end_turn(client, fake):
    m = client.messages.create(model="fake-model", max_tokens=64, messages=ASK, system="Be brief.")
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == "fake-model"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == fake.engine.script.answer
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    count = client.messages.count_tokens(model="fake-model", messages=ASK, system="Be brief.")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count.input_tokens
    assert m.usage.output_tokens == len(fake.engine.tokenizer.encode(m.content[0].text, add_special_tokens=False))
    (system, user) = fake.last_request().prompt.messages
    assert (system.role, system.content, user.content) == ("system", "Be brief.", ASK[0]["content"])


def test_sampling_fields_in_the_body_are_honoured_and_defaults_are_anthropics(client, fake):
    client.messages.create(model="fake-model", max_tokens=9, messages=ASK, stop_sequences=["###"],
                           extra_body={"temperature": 0.25, "top_k": 7, "top_p": 0.5, "seed": 11})
    p = fake.last_request().params
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.stop) == (9, 0.25, 7, 0.5, 11, ["###"])
    client.messages.create(model="fake-model", max_tokens=9, messages=ASK)
    p = fake.last_request().params
    assert (p.temperature, p.top_k, p.top_p, p.seed) == (1.0, 0, 1.0, None)


def test_stream_sends_anthropics_event_sequence(fake):
    r = httpx.post(fake.url + "/v1/messages", json={"model": "fake-model", "max_tokens": 64, "messages": ASK,
                                                    "stream": True})
    events = _events(r.text)
    names = [name for name, _ in events]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(name == data["type"] for name, data in events)
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == fake.engine.script.answer
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(fake.engine.tokenizer.encode(text, add_special_tokens=False))


def test_the_sdk_stream_accumulates_the_same_message(client, fake):
    with client.messages.stream(model="fake-model", max_tokens=64, messages=ASK) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    whole = client.messages.create(model="fake-model", max_tokens=64, messages=ASK)
    assert "".join(pieces) == final.content[0].text == whole.content[0].text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.stop_reason == "end_turn"


def test_stop_sequence_and_max_tokens_in_anthropics_words(client, fake):
    m = client.messages.create(model="fake-model", max_tokens=64, messages=ASK, stop_sequences=["scripted"])
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", "scripted", "Hello from the ")
    m = client.messages.create(model="fake-model", max_tokens=2, messages=ASK)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2


def test_tool_use_then_tool_result_then_answer(client, fake):
    fake.engine.script = Script(answer=CALL)
    m = client.messages.create(model="fake-model", max_tokens=64, messages=ASK, tools=[ADD])
    assert m.stop_reason == "tool_use"
    (use,) = m.content
    assert use.type == "tool_use" and use.name == "add" and use.input == {"a": 1, "b": 2}
    assert use.id.startswith("toolu_")
    with client.messages.stream(model="fake-model", max_tokens=64, messages=ASK, tools=[ADD]) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", "add", {"a": 1, "b": 2})]
    assert streamed.stop_reason == "tool_use"
    fake.engine.script = Script(answer="It is 3.")
    follow = ASK + [{"role": "assistant", "content": [{"type": "text", "text": "Let me add."}, use.model_dump(
        include={"type", "id", "name", "input"})]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "3"}]}]}]
    answer = client.messages.create(model="fake-model", max_tokens=64, messages=follow, tools=[ADD])
    assert answer.content[0].text == "It is 3." and answer.stop_reason == "end_turn"
    roles = [(m.role, m.content) for m in fake.last_request().prompt.messages]
    assert roles[-2] == ("assistant", "Let me add.\n" + tools.call_text("add", {"a": 1, "b": 2}))
    assert roles[-1] == ("tool", "<tool_response>\n3\n</tool_response>")


def test_an_error_result_reads_as_an_error(client, fake):
    client.messages.create(model="fake-model", max_tokens=8, tools=[ADD], messages=ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": "b is missing"}, {"type": "text", "text": "Try again."}]}])
    *_, result, user = fake.last_request().prompt.messages
    assert result.content == "<tool_response>\nError: b is missing\n</tool_response>" and user.content == "Try again."


def test_tool_choice_any_tool_and_none(client, fake):
    fake.engine.script = Script(answer=CALL)
    client.messages.create(model="fake-model", max_tokens=64, messages=ASK, tools=[ADD], tool_choice={"type": "any"})
    assert fake.last_request().params.constraint.field == "tool_choice"
    client.messages.create(model="fake-model", max_tokens=64, messages=ASK, tools=[ADD],
                           tool_choice={"type": "tool", "name": "add"})
    assert '"const": "add"' in fake.last_request().params.constraint.value
    m = client.messages.create(model="fake-model", max_tokens=64, messages=ASK, tools=[ADD],
                               tool_choice={"type": "none"})
    assert "# Tools" not in fake.last_request().prompt.messages[0].content and m.content[0].type == "text"
    with pytest.raises(anthropic.BadRequestError, match="tool_choice names 'sub'"):
        client.messages.create(model="fake-model", max_tokens=64, messages=ASK, tools=[ADD],
                               tool_choice={"type": "tool", "name": "sub"})


def test_disable_parallel_tool_use_ends_the_answer_after_one_call(client, fake):
    fake.engine.script = Script(answer=CALL + "\n" + CALL)
    m = client.messages.create(model="fake-model", max_tokens=64, messages=ASK, tools=[ADD],
                               tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert tools.CALL_CLOSE in fake.last_request().params.stop
    assert [b.type for b in m.content] == ["tool_use"] and m.stop_reason == "tool_use"


def test_prefill_continues_the_assistant_turn(client, fake):
    client.messages.create(model="fake-model", max_tokens=8, messages=ASK + [{"role": "assistant", "content": "The"}])
    prompt = fake.last_request().prompt
    assert prompt.continue_final_message and not prompt.add_generation_prompt


@pytest.mark.parametrize("body, field", [
    ({"model": "fake-model", "messages": ASK}, "max_tokens"),
    ({"model": "fake-model", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}, "image"),
    ({"model": "fake-model", "max_tokens": 8, "messages": ASK, "temperature": 1.5}, "temperature"),
    ({"model": "fake-model", "max_tokens": 8, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 2048}},
     "thinking"),
    ({"model": "fake-model", "max_tokens": 8, "messages": ASK, "presence_penalty": 1}, "presence_penalty"),
])
def test_bad_requests_are_invalid_request_errors_naming_the_field(fake, body, field):
    r = httpx.post(fake.url + "/v1/messages", json=body)
    assert r.status_code == 400
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert field in error["error"]["message"]


def test_thinking_disabled_is_accepted(client, fake):
    m = client.messages.create(model="fake-model", max_tokens=8, messages=ASK, thinking={"type": "disabled"})
    assert m.content[0].type == "text"


def test_errors_have_anthropics_statuses_and_sdk_classes(client, fake):
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.messages.create(model="claude-nope", max_tokens=8, messages=ASK)
    assert exc.value.body["error"]["type"] == "not_found_error"
    fake.engine.script = Script(fail_before=EngineOverloadedError("queue is full"))
    with pytest.raises(anthropic.APIStatusError) as exc:
        client.messages.create(model="fake-model", max_tokens=8, messages=ASK)
    assert exc.value.status_code == 529 and exc.value.body["error"]["type"] == "overloaded_error"
    fake.engine.script = Script(fail_before=InferenceError("scripted failure"))
    with pytest.raises(anthropic.InternalServerError) as exc:
        client.messages.create(model="fake-model", max_tokens=8, messages=ASK)
    assert exc.value.body["error"]["type"] == "api_error"


def test_a_failure_mid_stream_is_an_error_event(client, fake):
    fake.engine.script = Script(fail_after=(2, InferenceError("inference failed: scripted failure")))
    r = httpx.post(fake.url + "/v1/messages", json={"model": "fake-model", "max_tokens": 64, "messages": ASK,
                                                    "stream": True})
    events = _events(r.text)
    assert events[0][0] == "message_start" and any(n == "content_block_delta" for n, _ in events)
    assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error",
                                                              "message": "inference failed: scripted failure"}})
    with (pytest.raises(anthropic.APIStatusError, match="scripted failure"),
          client.messages.stream(model="fake-model", max_tokens=64, messages=ASK) as stream):
        list(stream.text_stream)


@pytest.fixture(scope="module")
def keyed_server(fake_server):
    settings = Settings(port=free_port(), api_key="sekret")
    with ServerThread(build_app(settings, fake_server.engine, owns_engine=False), settings.port):
        yield f"http://127.0.0.1:{settings.port}"


def test_x_api_key_is_the_api_key_and_refusals_are_anthropic_shaped(keyed_server, fake):
    ok = anthropic.Anthropic(base_url=keyed_server, api_key="sekret", max_retries=0)
    assert ok.messages.create(model="fake-model", max_tokens=8, messages=ASK).content[0].text
    bearer = anthropic.Anthropic(base_url=keyed_server, auth_token="sekret", max_retries=0)
    assert bearer.messages.count_tokens(model="fake-model", messages=ASK).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as exc:
        anthropic.Anthropic(base_url=keyed_server, api_key="wrong", max_retries=0).messages.create(
            model="fake-model", max_tokens=8, messages=ASK)
    assert exc.value.body == {"type": "error", "error": {"type": "authentication_error", "message": exc.value.body[
        "error"]["message"]}} and "invalid API key" in exc.value.body["error"]["message"]
    r = httpx.post(keyed_server + "/v1/chat/completions", headers={"x-api-key": "sekret"},
                   json={"messages": ASK, "max_tokens": 4})
    assert r.status_code == 200  # one key, either header, on every endpoint


@pytest.fixture(scope="module")
def thinking_server(fake_server):
    """A reasoning parser whose markers are text (granite's), so the fake engine's tokenizer can think."""
    settings = Settings(port=free_port(), reasoning_parser="granite")
    with ServerThread(build_app(settings, fake_server.engine, owns_engine=False), settings.port):
        yield f"http://127.0.0.1:{settings.port}"


def test_thinking_comes_back_as_thinking_blocks_whole_and_streamed(thinking_server, fake):
    fake.engine.script = Script(answer="Here's my thought process: one and two. Here's my response: It is 3.")
    client = anthropic.Anthropic(base_url=thinking_server, api_key="x", max_retries=0)
    m = client.messages.create(model="fake-model", max_tokens=64, messages=ASK)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert "one and two" in m.content[0].thinking and m.content[1].text.strip() == "It is 3."
    with client.messages.stream(model="fake-model", max_tokens=64, messages=ASK) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in kinds and "text_delta" in kinds
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        (b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content]
    # a budget is a cap on the thinking: not below max_tokens, and refused where the markers are text
    enabled = {"type": "enabled", "budget_tokens": 1024}
    with pytest.raises(anthropic.BadRequestError, match="must be less than max_tokens"):
        client.messages.create(model="fake-model", max_tokens=1024, messages=ASK, thinking=enabled)
    with pytest.raises(anthropic.BadRequestError, match=r"thinking\.budget_tokens: .* cannot be capped"):
        client.messages.create(model="fake-model", max_tokens=2048, messages=ASK, thinking=enabled)


@pytest.mark.parametrize("schema", ["anthropic-messages", "anthropic-count-tokens"])
def test_each_content_block_is_validated_once(schema):
    """Validation runs on one thread for every large body, so its cost a block bounds what one body can hold
    up: a text block's schema is evaluated once, its type picked by one if/else chain, and the top level's
    unevaluatedProperties reads the shared prompt's keys through $ref instead of validating the prompt again
    (jsonschema re-validates allOf branches for it: five times the work a block, measured)."""
    import jsonschema

    from schemas import load_schema, registry

    seen: list[int] = []
    properties_keyword = jsonschema.Draft202012Validator.VALIDATORS["properties"]

    def counting_properties(validator, properties, instance, schema_):
        if isinstance(instance, dict) and instance.get("type") == "text":
            seen.append(id(instance))
        yield from properties_keyword(validator, properties, instance, schema_)

    counting = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"properties": counting_properties})
    blocks = [{"type": "text", "text": f"part {i}"} for i in range(50)]
    body = {"model": "m", "messages": [{"role": "user", "content": blocks}]}
    if schema == "anthropic-messages":
        body["max_tokens"] = 1
    assert not list(counting(load_schema(schema), registry=registry()).iter_errors(body))
    per_block = len(seen) / len(blocks)
    assert per_block <= 3, f"each text block's properties were checked {per_block:g} times"
