"""OpenAI's logit_bias on the real model, through the official openai client: -100 on the greedy answer's
first token bans it (the greedy head's path), +100 on another token forces it (greedy and sampled), and
an id outside the vocabulary is a 400 naming the field."""

from __future__ import annotations

import openai
import pytest

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def first_token(client, model, **fields) -> int:
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, logprobs=0,
                                     extra_body={"return_tokens_as_token_ids": True}, **fields)
    return int(resp.choices[0].logprobs.tokens[0].removeprefix("token_id:"))


def test_a_ban_changes_the_greedy_answer_and_a_boost_forces_a_token(client, live_server):
    model = live_server.engine.model_info.name
    greedy = first_token(client, model, temperature=0)
    assert first_token(client, model, temperature=0, logit_bias={str(greedy): -100}) != greedy
    (forced,) = live_server.engine.tokenizer.encode(" banana", add_special_tokens=False)
    assert forced != greedy
    assert first_token(client, model, temperature=0, logit_bias={str(forced): 100}) == forced
    assert first_token(client, model, temperature=1.0, seed=5, logit_bias={str(forced): 100}) == forced
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a fruit."}],
                                          max_tokens=1, temperature=0, logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == " banana"


def test_an_id_outside_the_vocabulary_is_refused_naming_the_field(client, live_server):
    vocab = live_server.engine.model_info.vocab_size
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=live_server.engine.model_info.name, prompt=PROMPT, max_tokens=1,
                                  logit_bias={str(vocab): -100})
    assert caught.value.body["param"] == "logit_bias" and "vocabulary" in caught.value.body["message"]
