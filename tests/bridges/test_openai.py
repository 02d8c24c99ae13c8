"""The official openai client against /v1: chat and completions, streaming and not.

Answers come from the real model; error shapes, model names and accepted fields are the bridge's own and
run on the scripted fake engine (``fake``)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.spark.client import answer_text, converse, spark_request


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(live_server):
    return live_server.engine.model_info.name


def _fake_client(fake) -> openai.OpenAI:
    return openai.OpenAI(base_url=fake.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_model(fake):
    assert [m.id for m in _fake_client(fake).models.list().data] == [fake.engine.model_info.name]


def test_chat_stream_joined_equals_non_stream(client, model):
    messages = [{"role": "user", "content": "Name three colors."}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]


def test_completion_stream_joined_equals_non_stream(client, model):
    full = client.completions.create(model=model, prompt="The capital of France is", max_tokens=12, temperature=0)
    assert full.object == "text_completion"
    chunks = list(client.completions.create(model=model, prompt="The capital of France is", max_tokens=12,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_n_stop_seed_and_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell me a story."}],
                                       n=2, max_tokens=12, temperature=1.0, seed=42, logprobs=True, top_logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.content) > 0 and len(c.logprobs.content[0].top_logprobs) == 2
    again = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell me a story."}],
                                           n=2, max_tokens=12, temperature=1.0, seed=42)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    base = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    assert " 6" in base.choices[0].text
    cut = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 6"])
    assert cut.choices[0].text == base.choices[0].text[: base.choices[0].text.index(" 6")]
    assert cut.choices[0].finish_reason == "stop"
    lp = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    assert len(lp.choices[0].logprobs.tokens) == 3 and len(lp.choices[0].logprobs.top_logprobs[0]) == 2


def test_extra_body_top_k_changes_sampling(client, model):
    greedy = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10, temperature=0)
    top1 = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10, temperature=1.5,
                                     seed=3, extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy.choices[0].text  # top_k=1 is greedy whatever the temperature


def test_chat_greedy_equals_the_spark_answer(client, model, live_server):
    import asyncio

    question = "What is the capital of France?"
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                       max_tokens=12, temperature=0)
    frames = asyncio.run(converse(live_server.ws_url, spark_request(question, max_tokens=12, top_k=1)))
    assert r.choices[0].message.content == answer_text(frames)


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400, "temperature"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, 400, None),
    ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "xml"}}, 400, "response_format.type"),
])
def test_errors_use_openai_shape(fake, body, status, param):
    model = fake.engine.model_info.name
    if isinstance(body, dict) and body.get("model") == "M":
        body["model"] = model
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(fake.http_url + "/v1/chat/completions", timeout=60, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param:
        assert err["param"] == param
    ok = httpx.post(fake.http_url + "/v1/chat/completions", timeout=60,
                    json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200


def test_openai_client_raises_typed_errors(client, model):
    """On the real engine: a prompt over the context is refused by the engine's own length check."""
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=model, prompt=[5] * 9000, max_tokens=1)


@pytest.mark.parametrize("model", [None, "", "default", "null"])
def test_an_omitted_or_placeholder_model_is_the_served_model(fake, model):
    """FastDeploy's examples omit `model` or send "default" / "null"; vLLM accepts them too."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    if model is not None:
        body["model"] = model
    r = httpx.post(fake.http_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == fake.engine.model_info.name


def test_an_unknown_model_is_not_found_naming_what_is_served(fake):
    r = httpx.post(fake.http_url + "/v1/completions", json={"model": "gpt-4", "prompt": "Hi"}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model"
    assert "gpt-4" in err["message"] and fake.engine.model_info.name in err["message"]
    assert "LoRA" not in err["message"]


@pytest.mark.parametrize("priority", [0, -3, 7])
def test_vllm_priorities_are_accepted(fake, priority):
    body = {"model": fake.engine.model_info.name, "prompt": "Hi", "max_tokens": 2, "priority": priority,
            "parallel_tool_calls": False}
    assert httpx.post(fake.http_url + "/v1/completions", json=body, timeout=60).status_code == 200


def test_vllm_priority_maps_onto_the_engine_scale():
    from bridges.openai import engine_priority

    assert [engine_priority(p) for p in (None, 0, 3, -1, -4, -100)] == [5, 5, 5, 4, 1, 1]


@pytest.mark.parametrize("code, status", [
    ("unknown_adapter", 404), ("disabled", 404), ("host_not_allowed", 400), ("too_large", 400),
    ("md5_mismatch", 400), ("invalid_pack", 400), ("incompatible", 400), ("download_failed", 502),
    ("download_timeout", 504),
])
def test_lora_failures_map_to_their_own_status(code, status):
    from bridges.errors import error_info
    from engine.errors import LoraUnavailableError

    assert error_info(LoraUnavailableError("x", code=code)).status == status
