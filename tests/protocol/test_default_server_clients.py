"""Clients that must work against a server started with no flags: the HF `text_generation` client (it
posts to the root), and the `ollama` client with the names Ollama users write (`smollm2:latest`)."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest

from engine.model_loader import EMBEDDED_MODEL_NAME
from spark_server.app import build_app
from spark_server.settings import Settings
from tests.conftest import ServerThread, free_port
from tests.fake_engine import DEFAULT_ANSWER, FakeEngine


@pytest.fixture(scope="module")
def url():
    engine = FakeEngine()
    engine.model_info = replace(engine.model_info, name=EMBEDDED_MODEL_NAME)  # as the default server names it
    settings = Settings(port=free_port())  # no flags
    with ServerThread(build_app(settings, engine), settings.port):
        yield f"http://127.0.0.1:{settings.port}"


def test_text_generation_generate_and_stream(url):
    from text_generation import Client

    client = Client(url, timeout=30)
    full = client.generate("The capital of France is", max_new_tokens=32)
    assert full.generated_text == DEFAULT_ANSWER and full.details.generated_tokens == len(full.details.tokens)
    assert all(isinstance(t.id, int) and isinstance(t.special, bool) for t in full.details.tokens)
    streamed = list(client.generate_stream("The capital of France is", max_new_tokens=32))
    assert "".join(r.token.text for r in streamed) == DEFAULT_ANSWER
    assert streamed[-1].generated_text == DEFAULT_ANSWER and streamed[-1].details is not None


def test_the_documented_generate_keeps_the_spec_shape(url):
    r = httpx.post(url + "/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 3, "details": True}})
    assert r.status_code == 200 and isinstance(r.json(), dict)
    assert r.json()["details"]["tokens"][0]["special"] is None  # the spec's, not the HF client's


@pytest.mark.parametrize("name", ["smollm2:latest", "smollm2", "smollm2:135m", "SmolLM2-135M-Instruct:latest",
                                  EMBEDDED_MODEL_NAME])
def test_ollama_names_of_the_default_model(url, name):
    import ollama

    answer = ollama.Client(host=url).chat(model=name, messages=[{"role": "user", "content": "hi"}])
    assert answer.message.content == DEFAULT_ANSWER


def test_an_unknown_ollama_name_is_ollamas_404(url):
    r = httpx.post(url + "/api/chat", json={"model": "llama3:latest", "stream": False,
                                            "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and 'model "llama3:latest" not found' in r.json()["error"]


def test_the_ollama_client_shows_and_lists_the_running_model(url):
    """`ollama show` and `ollama ps` (what desktop front ends ask before a chat): the served model's family,
    context and capabilities, parsed by the official client; an unknown name is Ollama's 404."""
    import ollama

    client = ollama.Client(host=url)
    shown = client.show("smollm2:latest")
    assert shown.capabilities == ["completion"] and shown.details is not None and shown.details.family
    assert shown.modelinfo is not None and any(k.endswith(".context_length") for k in shown.modelinfo)
    (running,) = client.ps().models
    assert running.model == EMBEDDED_MODEL_NAME
    with pytest.raises(ollama.ResponseError) as err:
        client.show("llama3:latest")
    assert err.value.status_code == 404
    refused = httpx.post(url + "/api/show", json={"verbose": True})  # no model named
    assert refused.status_code == 400 and "model" in refused.json()["error"]


def test_tgi_best_of_answers_the_best_and_lists_the_others(url):
    """TGI's best_of with the HF client: two sequences sampled, the one of the highest logprob sum answered,
    the other in details.best_of_sequences; refused as TGI refuses it for greedy decoding, a set seed, a
    stream, more than its default --max-best-of, and on protocols that answer one sequence."""
    from text_generation import Client
    from text_generation.errors import ValidationError

    client = Client(url, timeout=30)
    answer = client.generate("The capital of France is", max_new_tokens=8, best_of=2, do_sample=True)
    assert answer.generated_text == DEFAULT_ANSWER[:len(answer.generated_text)] and answer.details is not None
    (other,) = answer.details.best_of_sequences
    assert other.generated_tokens == len(other.tokens) and other.finish_reason is not None
    for kwargs, field in (({"best_of": 2}, "best_of"), ({"best_of": 2, "do_sample": True, "seed": 1}, "seed")):
        with pytest.raises(ValidationError, match=field):
            client.generate("hi", max_new_tokens=4, **kwargs)
    for path, body, status in (("/generate_stream", {"best_of": 2, "do_sample": True}, 422),
                               ("/generate", {"best_of": 3, "do_sample": True}, 422),
                               ("/infer", {"best_of": 2, "do_sample": True}, 400)):
        r = httpx.post(url + path, json={"inputs": "hi", "parameters": body})
        assert r.status_code == status and "best_of" in r.text, (path, r.text)
