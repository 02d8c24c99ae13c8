"""Every protocol: an engine failure after the first token reaches the real client as that protocol's
own error event (never a cut connection), and the server keeps serving."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engine.errors import InferenceError
from tests.fake_engine import Script
from tests.spark.client import converse, spark_request

BOOM = "inference failed: scripted failure"


@pytest.fixture
def failing(fake):
    fake.engine.script = Script(fail_after=(2, InferenceError(BOOM)))
    return fake


def _sse_events(text: str) -> list:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def test_openai_chat_stream(failing):
    import openai

    client = openai.OpenAI(base_url=failing.url + "/v1", api_key="x", max_retries=0)
    seen = []
    with pytest.raises(openai.APIError, match="scripted failure"):
        for chunk in client.chat.completions.create(model="fake-model", stream=True,
                                                    messages=[{"role": "user", "content": "hi"}]):
            seen.append(chunk.choices[0].delta.content if chunk.choices else None)
    assert "Hello" in "".join(s or "" for s in seen)


def test_openai_completions_stream(failing):
    r = httpx.post(failing.url + "/v1/completions", json={"prompt": "hi", "stream": True, "max_tokens": 20})
    events = _sse_events(r.text)
    assert r.status_code == 200 and json.loads(events[0])["choices"][0]["text"]
    assert BOOM in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"


def test_tgi_stream_with_the_hf_client(failing, fake_hf_server):
    from text_generation import Client
    from text_generation.errors import GenerationError

    tokens = []
    with pytest.raises(GenerationError, match="scripted failure"):
        for response in Client(fake_hf_server.url).generate_stream("hi", max_new_tokens=20):
            tokens.append(response.token.text)
    assert tokens


def test_tgi_generate_stream_spec_shape(failing):
    r = httpx.post(failing.url + "/generate_stream", json={"inputs": "hi", "parameters": {"max_new_tokens": 20}})
    events = [json.loads(e) for e in _sse_events(r.text)]
    assert events[0]["token"]["text"] and BOOM in events[-1]["error"]


def test_vllm_stream(failing):
    r = httpx.post(failing.url + "/generate", json={"prompt": "hi", "stream": True, "max_tokens": 20})
    chunks = [json.loads(c) for c in r.content.split(b"\0") if c]
    assert r.status_code == 200 and chunks[0]["text"][0]
    assert BOOM in chunks[-1]["error"]


def test_sglang_stream(failing):
    r = httpx.post(failing.url + "/generate", json={"text": "hi", "stream": True,
                                                     "sampling_params": {"max_new_tokens": 20}})
    events = _sse_events(r.text)
    assert json.loads(events[0])["text"]
    assert BOOM in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"


def test_triton_stream(failing):
    r = httpx.post(failing.url + "/v2/models/fake-model/generate_stream",
                   json={"text_input": "hi", "parameters": {"max_new_tokens": 20}})
    events = [json.loads(e) for e in _sse_events(r.text)]
    assert events[0]["text_output"] and BOOM in events[-1]["error"]


def test_mindie_stream(failing):
    r = httpx.post(failing.url + "/infer", json={"inputs": "hi", "stream": True, "parameters": {"max_new_tokens": 20}})
    events = [json.loads(e) for e in _sse_events(r.text)]
    assert events[0]["token"]["text"] and BOOM in events[-1]["error"]


def test_ollama_stream_with_the_ollama_client(failing):
    import ollama

    pieces = []
    with pytest.raises(ollama.ResponseError, match="scripted failure"):
        for part in ollama.Client(host=failing.url).chat(model="fake-model", stream=True,
                                                         messages=[{"role": "user", "content": "hi"}]):
            pieces.append(part.message.content)
    assert pieces


def test_spark_websocket(failing):
    frames = asyncio.run(converse(failing.ws_url, spark_request("hi")))
    assert frames[0]["header"]["code"] == 0 and frames[0]["header"]["status"] in (0, 1)
    assert frames[-1]["header"]["code"] != 0 and BOOM in frames[-1]["header"]["message"]


def test_the_server_keeps_serving_afterwards(fake):
    r = httpx.post(fake.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == fake.engine.script.answer
