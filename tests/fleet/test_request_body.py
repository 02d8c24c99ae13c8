"""What the fleet front end (--engine-url) sends its backends: the request's sampling parameters in the
sampling table's OpenAI vocabulary (bridges/openai_fields.py) inside a streamed /v1/completions body,
and a refusal naming the field, before any backend sees the request, for a parameter that vocabulary
cannot carry. Fake backends on real sockets: no model, no router."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from bridges.openai_fields import openai_fields
from engine.errors import InvalidRequestError
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import LeadingSection, SamplingParams
from spark_server.app import build_app
from spark_server.settings import Settings
from tests.conftest import ServerThread, free_port
from tests.fleet.test_retry import MODEL, FakeBackend


def test_the_backend_gets_the_requests_params_in_the_tables_words():
    with FakeBackend("ok") as backend:
        settings = Settings(port=free_port(), engine_url=backend.url)
        engine = settings.remote_engine()
        with ServerThread(build_app(settings, engine), settings.port):
            resp = httpx.post(f"http://127.0.0.1:{settings.port}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "top_k": 4, "seed": 9, "stop": "x",
                "bad_words_token_ids": [11], "logit_bias": {"12": 1.5, "13": -100}, "logprobs": 2,
                "guided_regex": "a+"})
            assert resp.status_code == 200, resp.text
    (body,) = backend.bodies
    sent = SamplingParams(max_tokens=3, top_k=4, seed=9, stop=["x"], banned_token_ids=[11],
                          logit_bias=((12, 1.5), (13, -100.0)), logprobs=True, top_logprobs=2)
    expected = openai_fields(sent) | {"guided_regex": "a+"}
    assert {k: v for k, v in body.items() if k in expected} == expected
    assert body["stream"] is True and body["return_tokens_as_token_ids"] is True
    # bans and biases travel as OpenAI's logit_bias, which vLLM, SGLang and this server's replicas all read
    assert body["logit_bias"] == {"11": -100, "13": -100, "12": 1.5}
    assert "bad_words_token_ids" not in body


def test_a_parameter_the_backends_cannot_carry_is_refused_before_any_backend_sees_it():
    with FakeBackend("ok") as backend:
        engine = Settings(engine_url=backend.url).remote_engine()
        params = SamplingParams(leading_section=LeadingSection((7,), max_tokens=4, field="reasoning_max_tokens"))

        async def run() -> None:
            async for _ in engine.generate(GenerationRequest("r1", TokensPrompt([5, 6]), params)):
                pass

        with pytest.raises(InvalidRequestError, match="'reasoning_max_tokens' cannot be carried") as caught:
            asyncio.run(run())
        assert caught.value.parameter == "reasoning_max_tokens"
        assert backend.completions == 0
        engine.shutdown()
