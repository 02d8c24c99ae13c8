"""The model's recommended sampling (its generation_config.json) as the OpenAI-compatible endpoints'
defaults, as vLLM applies it (``--generation-config auto``, its default, ``vllm`` or a directory, and
``--override-generation-config``): a knob the request leaves out takes the recommendation, a knob it sets
keeps its value, and the other protocols keep their own documented defaults. Driven with the official
OpenAI SDK against the fake engine, which records what reached it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from openai import OpenAI

from engine.generation_config import recommended_sampling
from spark_server.settings import Settings
from tests.conftest import FakeServer, fake_server_with, free_port
from tests.fake_engine import FakeEngine

QWEN_LIKE = (("temperature", 0.7), ("top_p", 0.8), ("top_k", 20), ("repetition_penalty", 1.05))


@contextmanager
def served(**settings) -> Iterator[tuple[FakeServer, OpenAI]]:
    engine = FakeEngine(recommended_sampling=QWEN_LIKE)
    with fake_server_with(Settings(port=free_port(), **settings), engine) as server:
        yield server, OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none")


def _last(server: FakeServer):
    return server.engine.requests[-1].params


def test_a_chat_request_takes_the_models_recommendation_for_what_it_leaves_out():
    with served() as (server, client):
        client.chat.completions.create(model=server.engine.model_info.name, max_tokens=3,
                                       messages=[{"role": "user", "content": "Hi"}])
        p = _last(server)
        assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.7, 0.8, 20, 1.05)
        client.chat.completions.create(model=server.engine.model_info.name, max_tokens=3, temperature=0.2,
                                       messages=[{"role": "user", "content": "Hi"}], extra_body={"top_k": 5})
        p = _last(server)
        assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.2, 0.8, 5, 1.05)
        client.completions.create(model=server.engine.model_info.name, prompt="Once", max_tokens=3)
        assert _last(server).temperature == 0.7 and _last(server).top_k == 20


def test_a_response_echoes_the_sampling_that_applied():
    with served() as (server, client):
        response = client.responses.create(model=server.engine.model_info.name, input="Hi", max_output_tokens=3)
        assert (response.temperature, response.top_p) == (0.7, 0.8)
        assert _last(server).top_k == 20
        response = client.responses.create(model=server.engine.model_info.name, input="Hi", max_output_tokens=3,
                                           temperature=0.3)
        assert response.temperature == 0.3 and _last(server).temperature == 0.3


def test_the_other_protocols_keep_their_own_defaults():
    """A TGI or Ollama client meets its protocol's documented defaults, not the model's recommendation."""
    with served() as (server, _), served(generation_config="vllm") as (plain, _):
        for s in (server, plain):
            httpx.post(f"http://127.0.0.1:{s.port}/generate", json={"inputs": "Hi",
                                                                     "parameters": {"max_new_tokens": 3}}, timeout=30)
            httpx.post(f"http://127.0.0.1:{s.port}/api/generate", json={"model": s.engine.model_info.name,
                                                                         "prompt": "Hi", "stream": False,
                                                                         "options": {"num_predict": 3}}, timeout=30)
        tgi, ollama = server.engine.requests[-2:]
        tgi_plain, ollama_plain = plain.engine.requests[-2:]
        assert tgi.params.temperature == tgi_plain.params.temperature and tgi.params.top_k == tgi_plain.params.top_k
        assert ollama.params.temperature == ollama_plain.params.temperature != 0.7


def test_generation_config_vllm_keeps_openais_defaults():
    with served(generation_config="vllm") as (server, client):
        client.chat.completions.create(model=server.engine.model_info.name, max_tokens=3,
                                       messages=[{"role": "user", "content": "Hi"}])
        p = _last(server)
        assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (1.0, 1.0, 0, 1.0)


def test_an_override_lays_over_the_recommendation(tmp_path):
    override = json.dumps({"temperature": 0.5, "max_new_tokens": 7, "min_p": 0.05})
    with served(override_generation_config=override) as (server, client):
        client.chat.completions.create(model=server.engine.model_info.name,
                                       messages=[{"role": "user", "content": "Hi"}])
        p = _last(server)
        assert (p.temperature, p.top_p, p.max_tokens, p.min_p) == (0.5, 0.8, 7, 0.05)
    with pytest.raises(ValueError, match="'temprature' is not a sampling default"):
        Settings(override_generation_config='{"temprature": 0.5}')
    with pytest.raises(ValueError, match="top_k: expected an integer"):
        Settings(override_generation_config='{"top_k": 2.5}')
    # out of the engine's range: refused at start, not per request
    with pytest.raises(ValueError, match="top_p"), served(override_generation_config='{"top_p": 0}'):
        pass


def test_an_override_null_drops_a_recommendation_and_its_max_new_tokens_caps():
    """As vLLM: null leaves a knob to OpenAI's default, do_sample is read by no one (logged), and under
    auto the override's max_new_tokens caps every request's max_tokens."""
    override = json.dumps({"top_k": None, "do_sample": True, "max_new_tokens": 5})
    with served(override_generation_config=override) as (server, client):
        client.chat.completions.create(model=server.engine.model_info.name, max_tokens=40,
                                       messages=[{"role": "user", "content": "Hi"}])
        p = _last(server)
        assert (p.temperature, p.top_k, p.max_tokens) == (0.7, 0, 5)


def test_completions_keep_their_max_tokens_default_and_anthropic_messages_take_the_rest():
    """vLLM's completions default max_tokens is 16 whatever the model recommends; its /v1/messages is its chat
    endpoint underneath, so the recommendation applies there too."""
    engine = FakeEngine(recommended_sampling=(*QWEN_LIKE, ("max_tokens", 512)))
    with fake_server_with(Settings(port=free_port()), engine) as server:
        client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none")
        client.completions.create(model=engine.model_info.name, prompt="Once")
        assert _last(server).max_tokens == 16 and _last(server).temperature == 0.7
        client.chat.completions.create(model=engine.model_info.name, messages=[{"role": "user", "content": "Hi"}])
        assert _last(server).max_tokens == 512
        import anthropic

        claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="none")
        claude.messages.create(model=engine.model_info.name, max_tokens=8,
                               messages=[{"role": "user", "content": "Hi"}])
        p = _last(server)
        assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.7, 0.8, 20, 8)


def test_a_config_files_mapping_is_taken_as_vllms_yaml_takes_it(tmp_path):
    config = tmp_path / "server.yaml"
    config.write_text("override-generation-config:\n  temperature: 0.4\n  max_new_tokens: 12\n")
    from spark_server.settings import resolve

    settings = resolve({"config": str(config)}, environ={})
    assert json.loads(settings.override_generation_config) == {"temperature": 0.4, "max_new_tokens": 12}


def test_a_directory_of_its_own_whose_max_new_tokens_caps_every_request(tmp_path):
    """A directory's file replaces the model's (every value it spells out, top_k 50 too, as vLLM on
    transformers 5 reads it), and its max_new_tokens caps a request's own max_tokens, as vLLM's
    override_max_tokens does."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 50, "do_sample": True,
                                                                 "max_new_tokens": 9}))
    with served(generation_config=str(tmp_path)) as (server, client):
        client.chat.completions.create(model=server.engine.model_info.name, max_tokens=30,
                                       messages=[{"role": "user", "content": "Hi"}])
        p = _last(server)
        assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 1.0, 50, 9)
    with pytest.raises(ValueError, match="--generation-config"):
        Settings(generation_config=str(tmp_path / "missing"))


def test_reading_a_generation_config(tmp_path):
    assert recommended_sampling(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
        "repetition_penalty": 1.05, "max_new_tokens": 512, "min_p": None}))
    assert recommended_sampling(tmp_path) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                              "repetition_penalty": 1.05, "max_tokens": 512}  # no do_sample
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="temperature: expected a number"):
        recommended_sampling(tmp_path)
