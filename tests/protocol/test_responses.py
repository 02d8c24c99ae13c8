"""OpenAI Responses on the fake engine: the typed event sequence, the response object and its usage, the
incomplete status, tool calls as items, the lowering of input items (the chat lowering's messages),
errors naming their field, and the kept responses (GET, input items, DELETE, cancel, background, and
the store's count and byte bounds)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from engine.errors import InferenceError
from spark_server.app import build_app
from spark_server.settings import Settings
from tests.conftest import ServerThread, free_port
from tests.fake_engine import DEFAULT_ANSWER, Script

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
TOOLS = [{"type": "function", "name": "add", "description": "Add two numbers", "parameters": {"type": "object"}}]


def _events(r: httpx.Response) -> list[dict]:
    """The stream's events, each checked to carry its type in both the event line and the data."""
    events = []
    for block in r.text.strip().split("\n\n"):
        head, data = block.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        events.append(event)
    return events


def _post(fake, **body) -> httpx.Response:
    return httpx.post(fake.url + "/v1/responses", json={"input": "hi", **body}, timeout=30)


def _tokens(fake, text: str) -> int:
    return len(fake.engine.tokenizer.encode(text, add_special_tokens=False))


def test_a_text_stream_is_the_typed_event_sequence(fake):
    r = _post(fake, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    kinds = [e["type"] for e in events]
    n = _tokens(fake, DEFAULT_ANSWER)
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * n
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.completed"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    item_id = events[2]["item"]["id"]
    assert item_id.startswith("msg_") and all(e["item_id"] == item_id for e in events[3:-2] if "item_id" in e)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == DEFAULT_ANSWER == events[-4]["text"] == events[-2]["item"]["content"][0]["text"]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"] == [events[-2]["item"]]
    usage = final["usage"]
    assert usage["output_tokens"] == n and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + n
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}


def test_the_whole_answer_and_its_usage_equal_the_chat_completion(fake):
    data = _post(fake, instructions="Be brief.").json()
    chat = httpx.post(fake.url + "/v1/chat/completions", json={"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}).json()
    assert data["object"] == "response" and data["id"].startswith("resp_") and data["status"] == "completed"
    (item,) = data["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert data["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert data["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]
    assert data["instructions"] == "Be brief." and data["model"] == "fake-model" and data["store"] is True


def test_a_length_end_is_incomplete_with_its_reason(fake):
    data = _post(fake, max_output_tokens=3).json()
    assert data["status"] == "incomplete" and data["incomplete_details"] == {"reason": "max_output_tokens"}
    assert data["usage"]["output_tokens"] == 3 and data["output"][0]["status"] == "incomplete"
    assert fake.last_request().params.max_tokens == 3
    events = _events(_post(fake, max_output_tokens=3, stream=True))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_tool_call_is_a_function_call_item_streamed_with_its_arguments(fake):
    fake.engine.script = Script(answer=CALL)
    data = _post(fake, tools=TOOLS).json()
    (item,) = data["output"]
    assert item["type"] == "function_call" and item["name"] == "add" and item["call_id"].startswith("call_")
    assert json.loads(item["arguments"]) == {"a": 1, "b": 2} and item["id"].startswith("fc_")
    events = _events(_post(fake, tools=TOOLS, stream=True))
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert events[2]["item"]["type"] == "function_call" and events[2]["item"]["arguments"] == ""
    assert json.loads(events[3]["delta"]) == {"a": 1, "b": 2} and events[4]["name"] == "add"
    assert events[-1]["response"]["output"] == [events[5]["item"]]


def test_text_then_a_call_is_a_message_item_then_a_function_call_item(fake):
    fake.engine.script = Script(answer="Let me add. " + CALL)
    events = _events(_post(fake, tools=TOOLS, stream=True))
    output = events[-1]["response"]["output"]
    assert [i["type"] for i in output] == ["message", "function_call"]
    assert output[0]["content"][0]["text"].strip() == "Let me add."
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1]
    # the output items sent back as they came (the client's usual loop), then the call's output: one
    # assistant message with its text and its call, as chat has it
    fake.engine.script = Script(answer="3")
    call = output[1]
    items = [{"role": "user", "content": "hi"}, *output,
             {"type": "function_call_output", "call_id": call["call_id"], "output": "3"}]
    assert httpx.post(fake.url + "/v1/responses", json={"input": items, "tools": TOOLS}).status_code == 200
    messages = fake.last_request().prompt.messages
    assert [m.role for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[2].content.startswith("Let me add.") and '"name": "add"' in messages[2].content


def test_input_items_lower_to_the_chat_messages_of_the_same_conversation(fake):
    fake.engine.script = Script(answer="3")
    items = [{"role": "developer", "content": "Use tools."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "1+2?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "3"}]
    data = httpx.post(fake.url + "/v1/responses", json={"input": items, "tools": TOOLS, "instructions": "Hi."}).json()
    assert data["output"][0]["content"][0]["text"] == "3"
    ours = fake.last_request().prompt.messages
    httpx.post(fake.url + "/v1/chat/completions", json={"tools": [{"type": "function", "function": {
        k: v for k, v in TOOLS[0].items() if k != "type"}}], "messages": [
        {"role": "system", "content": "Hi."}, {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]})
    assert ours == fake.last_request().prompt.messages
    assert "<tool_response>\n3\n</tool_response>" in ours[-1].content


def test_sampling_and_format_reach_the_engine(fake):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    _post(fake, temperature=0.3, top_p=0.5, text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
    params = fake.last_request().params
    assert params.temperature == 0.3 and params.top_p == 0.5
    assert params.constraint.kind == "json" and json.loads(params.constraint.value) == schema
    assert params.constraint.field == "text.format.schema"
    _post(fake, text={"format": {"type": "json_object"}})
    assert fake.last_request().params.constraint.kind == "json_object"
    _post(fake, text={"format": {"type": "text"}})
    assert fake.last_request().params.constraint is None


def test_no_effect_fields_are_named_in_a_header(fake):
    r = _post(fake, prompt_cache_key="k", reasoning={"effort": "low"})
    assert r.status_code == 200 and r.headers["X-Ignored-Parameters"] == "prompt_cache_key,reasoning"
    assert "X-Ignored-Parameters" not in _post(fake, metadata={"a": "b"}, user="u").headers


@pytest.mark.parametrize("body, status, param", [
    ({"input": None}, 400, "input"),
    ({}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "text": "x"}]}]}, 400, "input.0.content.0.type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "add", "arguments": "{oops"}]}, 400,
     "input[0].arguments"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, 400, "previous_response_id"),
    ({"input": "hi", "truncation": "auto"}, 400, "truncation"),
    ({"input": "hi", "background": True, "stream": True}, 400, "background"),
    ({"input": "hi", "background": True, "store": False}, 400, "background"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, 400,
     "text.format"),
    ({"input": "hi", "model": "other"}, 404, "model"),
])
def test_errors_are_openai_shaped_and_name_the_field(fake, body, status, param):
    r = httpx.post(fake.url + "/v1/responses", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_an_unknown_field_is_refused_naming_it(fake):
    r = _post(fake, frequency_penalty=1)
    assert r.status_code == 400 and "frequency_penalty" in r.json()["error"]["message"]


def test_an_engine_failure_mid_stream_ends_with_error_and_failed_events(fake):
    fake.engine.script = Script(fail_after=(2, InferenceError("inference failed: scripted")))
    events = _events(_post(fake, stream=True))
    assert events[-2]["type"] == "error" and "scripted" in events[-2]["message"]
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert "scripted" in failed["response"]["error"]["message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    fake.engine.script = Script(fail_before=InferenceError("inference failed: before"))
    assert _post(fake, stream=True).status_code == 500


def test_a_kept_response_is_retrieved_listed_continued_and_deleted(fake):
    first = _post(fake, input=[{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]).json()
    url = f"{fake.url}/v1/responses/{first['id']}"
    assert httpx.get(url).json() == first
    items = httpx.get(url + "/input_items").json()
    assert [i["content"][0]["text"] for i in items["data"]] == ["two", "one"]  # newest first, as OpenAI
    assert items["data"][0]["id"].startswith("msg_") and items["has_more"] is False
    page = httpx.get(url + "/input_items", params={"order": "asc", "limit": 1}).json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["one"] and page["has_more"] is True
    # the continuation: the earlier turn's input and output, then the new input (instructions not carried)
    second = _post(fake, input="three", previous_response_id=first["id"]).json()
    assert second["previous_response_id"] == first["id"]
    assert [(m.role, m.content) for m in fake.last_request().prompt.messages] == [
        ("user", "one"), ("user", "two"), ("assistant", DEFAULT_ANSWER), ("user", "three")]
    assert httpx.post(url + "/cancel").json()["error"]["message"] == "Cannot cancel a synchronous response."
    assert httpx.delete(url).json() == {"id": first["id"], "object": "response", "deleted": True}
    assert httpx.get(url).status_code == 404 and httpx.delete(url).status_code == 404
    not_kept = _post(fake, store=False).json()
    assert not_kept["store"] is False and httpx.get(f"{fake.url}/v1/responses/{not_kept['id']}").status_code == 404


def test_a_streamed_response_is_kept_too(fake):
    events = _events(_post(fake, stream=True))
    rid = events[-1]["response"]["id"]
    assert httpx.get(f"{fake.url}/v1/responses/{rid}").json() == events[-1]["response"]


def _poll(fake, rid: str, until: set[str]) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        data = httpx.get(f"{fake.url}/v1/responses/{rid}").json()
        if data["status"] in until:
            return data
        time.sleep(0.02)
    raise AssertionError(f"{rid} never reached {until}")


def test_background_responses_run_after_the_answer_and_can_be_cancelled(fake):
    queued = _post(fake, background=True).json()
    assert queued["status"] == "queued" and queued["background"] is True and queued["output"] == []
    done = _poll(fake, queued["id"], {"completed"})
    assert done["output"][0]["content"][0]["text"] == DEFAULT_ANSWER and done["usage"]["output_tokens"] > 0
    assert httpx.post(f"{fake.url}/v1/responses/{queued['id']}/cancel").status_code == 400
    fake.engine.script = Script(token_delay_s=0.5)
    slow = _post(fake, background=True).json()
    _poll(fake, slow["id"], {"in_progress"})
    cancelled = httpx.post(f"{fake.url}/v1/responses/{slow['id']}/cancel").json()
    assert cancelled["status"] == "cancelled"
    assert httpx.get(f"{fake.url}/v1/responses/{slow['id']}").json()["status"] == "cancelled"
    assert httpx.post(f"{fake.url}/v1/responses/{slow['id']}/cancel").json()["status"] == "cancelled"


@pytest.fixture(scope="module")
def small_store(fake_server):
    """A server whose store keeps at most 3 responses and 20 KiB."""
    settings = Settings(port=free_port(), responses_store_max_items=3, responses_store_max_mb=20 / 1024)
    app = build_app(settings, fake_server.engine, owns_engine=False)
    with ServerThread(app, settings.port):
        yield f"http://127.0.0.1:{settings.port}", app


def test_the_store_is_bounded_by_count_and_bytes(fake, small_store):
    url, app = small_store
    ids = [httpx.post(url + "/v1/responses", json={"input": f"q{i}"}).json()["id"] for i in range(5)]
    assert [httpx.get(f"{url}/v1/responses/{rid}").status_code for rid in ids] == [404, 404, 200, 200, 200]
    store = app.state.responses_store
    assert len(store) == 3
    # 6,000-character inputs: each entry holds its input twice (the items and the conversation), over 12 KB,
    # so the 20 KiB keep only the newest: the count bound is not reached, the byte bound evicts
    big = [httpx.post(url + "/v1/responses", json={"input": "x" * 6000}).json()["id"] for _ in range(3)]
    assert [httpx.get(f"{url}/v1/responses/{rid}").status_code for rid in ids[2:] + big] == [404] * 5 + [200]
    assert store.nbytes <= store.max_bytes and len(store) == 1
    # one answer larger than the whole store is answered, not kept
    huge = httpx.post(url + "/v1/responses", json={"input": "x" * 30000})
    assert huge.status_code == 200 and httpx.get(f"{url}/v1/responses/{huge.json()['id']}").status_code == 404
    assert store.nbytes <= store.max_bytes


def test_a_client_filling_the_store_evicts_its_own_responses_first(fake, small_store):
    """The store's bounds are shared, but over them the client holding the most goes first: another client's
    kept response outlives any number of a flooding client's (clients told apart by their address)."""
    url, app = small_store
    victim = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    with victim:
        kept = victim.post(url + "/v1/responses", json={"input": "mine"}).json()["id"]
        flood = [httpx.post(url + "/v1/responses", json={"input": "x" * 6000}).json()["id"] for _ in range(4)]
        flood += [httpx.post(url + "/v1/responses", json={"input": f"q{i}"}).json()["id"] for i in range(4)]
        assert victim.get(f"{url}/v1/responses/{kept}").status_code == 200
        follow = victim.post(url + "/v1/responses", json={"input": "and then?", "previous_response_id": kept})
        assert follow.status_code == 200
    assert httpx.get(f"{url}/v1/responses/{flood[-1]}").status_code == 200  # the flood keeps its newest
    store = app.state.responses_store
    assert store.nbytes <= store.max_bytes and len(store) <= store.max_items


def test_logprobs_ride_on_the_output_text_when_included(fake):
    n = _tokens(fake, DEFAULT_ANSWER)
    data = _post(fake, include=["message.output_text.logprobs"], top_logprobs=2).json()
    entries = data["output"][0]["content"][0]["logprobs"]
    assert len(entries) == n and len(entries[0]["top_logprobs"]) == 2 and entries[0]["logprob"] == -0.5
    events = _events(_post(fake, include=["message.output_text.logprobs"], stream=True))
    assert sum(len(e["logprobs"]) for e in events if e["type"] == "response.output_text.delta") == n
    assert _post(fake).json()["output"][0]["content"][0]["logprobs"] == []


def test_the_clients_stream_helper_reassembles_text_and_calls(fake):
    import openai

    fake.engine.script = Script(answer="Let me add. " + CALL)
    client = openai.OpenAI(base_url=fake.url + "/v1", api_key="x", max_retries=0)
    with client.responses.stream(model="fake-model", input="1+2?", tools=TOOLS) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    message, call = final.output
    assert message.content[0].text.strip() == "Let me add." and final.output_text.strip() == "Let me add."
    assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 1, "b": 2}


THINKING, ANSWER = "<think>\nI add 1 and 2: that makes 3.\n</think>\n\n", "The sum is 3."


@pytest.fixture(scope="module")
def thinker():
    """A server with --reasoning-parser qwen3 on a fake engine with Qwen3's tokenizer and template."""
    from tests.fake_engine import FakeEngine
    from tests.protocol.reasoning_fixtures import qwen3_tokenizer

    engine = FakeEngine()
    engine.tokenizer = qwen3_tokenizer()
    settings = Settings(port=free_port(), reasoning_parser="qwen3")
    with ServerThread(build_app(settings, engine, owns_engine=False), settings.port):
        yield f"http://127.0.0.1:{settings.port}", engine


def test_with_a_reasoning_parser_the_thinking_is_a_reasoning_item(thinker):
    url, engine = thinker
    engine.script = Script(answer=THINKING + ANSWER, burst=2)
    data = httpx.post(url + "/v1/responses", json={"input": "1+2?"}).json()
    chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "1+2?"}]}).json()
    reasoning, message = data["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    expected = chat["choices"][0]["message"]["reasoning_content"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": expected}]
    assert message["content"][0]["text"] == chat["choices"][0]["message"]["content"] == "\n\n" + ANSWER
    tokens = chat["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert data["usage"]["output_tokens_details"]["reasoning_tokens"] == tokens > 0
    events = _events(httpx.post(url + "/v1/responses", json={"input": "1+2?", "stream": True}))
    kinds = [e["type"] for e in events]
    assert kinds[2] == "response.output_item.added" and events[2]["item"]["type"] == "reasoning"
    first_text = kinds.index("response.output_text.delta")
    assert kinds.index("response.reasoning_text.done") < first_text
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == \
        reasoning["content"][0]["text"]
    final = events[-1]["response"]
    assert [(i["type"], i.get("content")) for i in final["output"]] == [
        (i["type"], i.get("content")) for i in data["output"]]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == tokens
    # an earlier turn's reasoning item is its assistant message's reasoning_content, left to the template
    engine.script = Script(answer=ANSWER)
    items = [{"role": "user", "content": "1+1?"}, {"type": "reasoning", "summary": [],
             "content": [{"type": "reasoning_text", "text": "OLD THOUGHT"}]},
             {"role": "assistant", "content": "2"}, {"role": "user", "content": "1+2?"}]
    assert httpx.post(url + "/v1/responses", json={"input": items}).status_code == 200
    assert engine.requests[-1].prompt.messages[1].reasoning_content == "OLD THOUGHT"
