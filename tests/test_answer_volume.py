"""The answer-volume budget (--max-logprob-entries): a request whose answers could hold more logprob
entries than the budget is refused at admission, before any engine work, with the protocol's own 400
naming the field; one just within it is served; a large answer is rendered off the event loop.

Admission is counted by the server from the request and the tokenizer: those tests run on the scripted fake
engine (real tokenizer, no model). The large answer rendered beside a running session runs on the real one."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from spark_server.settings import Settings
from tests.conftest import FakeServer, LiveServer, fake_server_with, free_port
from tests.spark.client import converse, spark_request

BUDGET = 60


@pytest.fixture(scope="module")
def small_budget_server():
    with fake_server_with(Settings(port=free_port(), max_logprob_entries=BUDGET)) as server:
        yield server


def _model(live: LiveServer | FakeServer) -> str:
    return live.engine.model_info.name


def _queries(server: FakeServer) -> int:
    """Requests that reached the engine."""
    return len(server.engine.requests)


def _ids(k: int) -> list[int]:
    return list(range(100, 100 + k))


async def test_a_request_just_within_the_budget_is_served_and_one_entry_more_is_refused(small_budget_server):
    """10 prompt ids, prompt_logprobs=1, logprobs=1, n=2: 10 x 2 x 2 prompt entries + max_tokens x 2 x 2
    output entries; max_tokens=5 makes exactly 60."""
    live = small_budget_server
    body = {"model": _model(live), "prompt": _ids(10), "prompt_logprobs": 1, "logprobs": 1, "n": 2,
            "max_tokens": 5, "temperature": 0}
    async with httpx.AsyncClient(base_url=live.http_url, timeout=120) as client:
        ok = await client.post("/v1/completions", json=body)
        assert ok.status_code == 200, ok.text
        choices = ok.json()["choices"]
        assert len(choices) == 2 and all(len(c["prompt_logprobs"]) == 10 for c in choices)
        assert all(c["logprobs"]["top_logprobs"] for c in choices)
        before = _queries(live)
        over = await client.post("/v1/completions", json={**body, "max_tokens": 6})  # 40 + 24 = 64
        assert over.status_code == 400, over.text
        error = over.json()["error"]
        assert error["param"] == "prompt_logprobs" and "--max-logprob-entries" in error["message"], error
        over = await client.post("/v1/completions", json={**body, "max_tokens": 50})  # 40 + 200: the output's
        assert over.status_code == 400 and over.json()["error"]["param"] == "logprobs", over.text
        assert _queries(live) == before  # nothing reached the engine


async def test_text_prompts_are_counted_by_their_tokens_not_their_bytes(small_budget_server):
    """The tokenizer-free bound (one token per byte) is over the budget; the real count is not."""
    live = small_budget_server
    text = "hello " * 20  # 120 bytes, ~20 tokens
    body = {"model": _model(live), "prompt": text, "prompt_logprobs": 0, "max_tokens": 1, "n": 2}
    async with httpx.AsyncClient(base_url=live.http_url, timeout=120) as client:
        ok = await client.post("/v1/completions", json=body)
        assert ok.status_code == 200, ok.text
        over = await client.post("/v1/completions", json={**body, "prompt": "hello " * 40})
        assert over.status_code == 400 and over.json()["error"]["param"] == "prompt_logprobs", over.text


@pytest.mark.parametrize("path, body, status, field", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                              "top_logprobs": 5, "max_tokens": 20}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "n": 4,
                              "max_tokens": 20}, 400, "logprobs"),
    ("/generate", {"text": ["a", "b"], "return_logprob": True, "top_logprobs_num": 3,
                   "sampling_params": {"max_new_tokens": 20}}, 400, "top_logprobs_num"),
    ("/generate", {"input_ids": [_ids(3), _ids(4)], "return_logprob": True,
                   "sampling_params": {"max_new_tokens": 40}}, 400, "return_logprob"),
    ("/generate_stream", {"inputs": "Hi", "parameters": {"top_n_tokens": 5, "max_new_tokens": 20}}, 422,
     "parameters.top_n_tokens"),
    ("/v2/models/{model}/generate", {"text_input": "Hi", "parameters": {"details": True, "max_new_tokens": 100}},
     400, "parameters.details"),
])
async def test_every_protocol_refuses_in_its_own_form(small_budget_server, path, body, status, field):
    live = small_budget_server
    body = {**body, "model": _model(live)} if path.startswith("/v1/") else body
    before = _queries(live)
    async with httpx.AsyncClient(base_url=live.http_url, timeout=60) as client:
        resp = await client.post(path.format(model=_model(live)), json=body)
    assert resp.status_code == status, resp.text
    assert field in resp.text and "--max-logprob-entries" in resp.text, resp.text
    error = resp.json()["error"]
    if isinstance(error, dict):
        assert error["param"] == field, error
    assert _queries(live) == before


def test_a_small_request_with_a_huge_answer_is_refused_fast_through_the_openai_client(fake):
    """~30 KB of prompts asking for every prompt position's 20 best tokens, 32 times over: the default
    budget refuses it at once (1.7 million entries), and the server goes on answering."""
    client = openai.OpenAI(base_url=fake.http_url + "/v1", api_key="none", max_retries=0, timeout=60)
    model = _model(fake)
    before = _queries(fake)
    prompts = ["hi " * 2500] * 4  # 4 x 7.5 KB, 2,500 tokens each
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=prompts, n=8, max_tokens=1,
                                  extra_body={"prompt_logprobs": 20})
    assert err.value.body["param"] == "prompt_logprobs", err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=["Hi"] * 4, n=4, max_tokens=4000, logprobs=20)
    assert err.value.body["param"] == "logprobs", err.value.body
    with pytest.raises(openai.BadRequestError) as err:  # the chat default: as many tokens as the context holds
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], n=8,
                                       logprobs=True, top_logprobs=20)
    assert err.value.body["param"] == "top_logprobs", err.value.body
    assert time.monotonic() - started < 5.0
    assert _queries(fake) == before  # refused before the engine
    ok = client.completions.create(model=model, prompt="Hi", max_tokens=2, logprobs=2)
    assert ok.choices[0].logprobs.top_logprobs


async def test_a_large_allowed_answer_is_rendered_while_other_sessions_go_on(live_server):
    """~25,000 prompt-logprob entries (rendered in a worker thread): the answer is whole, and a Spark
    session running beside it finishes normally."""
    model = _model(live_server)
    spark = asyncio.ensure_future(converse(live_server.ws_url, spark_request("Count to ten.", max_tokens=16, top_k=1)))
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=300) as client:
        resp = await client.post("/v1/completions", json={"model": model, "prompt": _ids(1200), "max_tokens": 1,
                                                          "prompt_logprobs": 20, "temperature": 0})
    assert resp.status_code == 200, resp.text
    entries = resp.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == 1200 and entries[0] is None and all(len(e) >= 20 for e in entries[1:])
    frames = await spark
    assert frames[-1]["header"]["code"] == 0, frames[-1]


def test_large_answers_are_serialized_in_small_pieces_with_the_same_bytes():
    """The C JSON encoder holds the GIL for a whole call: a large answer is written in pieces of a few
    thousand values, which together are exactly what one json.dumps call writes."""
    import json

    from bridges.serving import _PIECE_VALUES, json_pieces

    item = {"token": "é\"", "logprob": -0.25, "bytes": [195, 169, 34], "top_logprobs": [{"token": "x"}] * 20}
    answer = {"id": "x", "choices": [{"index": i, "logprobs": {"content": [item] * 3000}} for i in range(3)],
              "prompt_logprobs": [None] + [{"7": {"logprob": -1.0, "rank": 1}}] * 5000, "empty": [], "n": {}}
    out: list[str] = []
    json_pieces(answer, out)
    assert "".join(out) == json.dumps(answer, ensure_ascii=False, separators=(",", ":"))
    assert len(out) > 50 and max(len(p) for p in out) < _PIECE_VALUES * 40
