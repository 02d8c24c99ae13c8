"""OpenAI's logit_bias on /v1/completions and /v1/chat/completions (fake engine): the map of token id
strings to biases reaches the engine as SamplingParams.logit_bias, a -100 entry counting as a ban, and a
map the field cannot mean is refused with a 400 naming ``logit_bias`` before the engine sees it."""

from __future__ import annotations

import httpx
import pytest

MSGS = [{"role": "user", "content": "hi"}]
BODIES = {"/v1/completions": {"prompt": "hi"}, "/v1/chat/completions": {"messages": MSGS}}


@pytest.mark.parametrize("path", sorted(BODIES))
def test_the_bias_reaches_the_engine_as_id_bias_pairs(fake, path):
    body = {**BODIES[path], "logit_bias": {"11": 2.5, "0": -100, "300": 100, "12": -3}, "bad_words_token_ids": [7]}
    r = httpx.post(fake.url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    p = fake.last_request().params
    assert p.logit_bias == ((11, 2.5), (0, -100.0), (300, 100.0), (12, -3.0))
    assert all(type(t) is int and type(b) is float for t, b in p.logit_bias)
    assert p.bans_and_bias() == ([7, 0], ((11, 2.5), (300, 100.0), (12, -3.0)))


@pytest.mark.parametrize("path", sorted(BODIES))
@pytest.mark.parametrize("bias", [
    {"5": 100.5},  # outside OpenAI's [-100, 100]
    {"5": -101},
    {"x": 1},  # keys are token ids
    {"-5": 1},
    {"05": 1},  # one spelling per id, so no id can be named twice
    {"5": "1"},
    {"5": None},
    [[5, 1.0]],  # llama.cpp's list form is not OpenAI's
    "5",
])
def test_a_bias_the_field_cannot_mean_is_refused_naming_it(fake, path, bias):
    r = httpx.post(fake.url + path, json={**BODIES[path], "logit_bias": bias}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    # the param is the field's path, as for every schema refusal here (logit_bias, or logit_bias.5)
    assert "logit_bias" in error["message"] and error["param"].split(".")[0] == "logit_bias", error
    assert not fake.engine.requests


def test_null_and_empty_mean_no_bias(fake):
    for bias in (None, {}):
        r = httpx.post(fake.url + "/v1/completions", json={"prompt": "hi", "logit_bias": bias}, timeout=30)
        assert r.status_code == 200, r.text
        assert fake.last_request().params.logit_bias == ()
