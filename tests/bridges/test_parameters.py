"""Bridge parameters that reshape the answer: echo, return_full_text, truncate, timeout, priority."""

from __future__ import annotations

import httpx


def _post(server, path, body):
    return httpx.post(server.http_url + path, json=body, timeout=120)


def test_openai_echo_prepends_the_prompt(live_server):
    model = live_server.engine.model_info.name
    plain = _post(live_server, "/v1/completions", {"model": model, "prompt": "Roses are", "max_tokens": 5,
                                                   "temperature": 0}).json()["choices"][0]["text"]
    echoed = _post(live_server, "/v1/completions", {"model": model, "prompt": "Roses are", "max_tokens": 5,
                                                    "temperature": 0, "echo": True}).json()["choices"][0]["text"]
    assert echoed == "Roses are" + plain


def test_tgi_return_full_text_and_truncate(live_server):
    body = {"inputs": "Roses are red, violets are", "parameters": {"max_new_tokens": 5}}
    plain = _post(live_server, "/generate", body).json()["generated_text"]
    full = _post(live_server, "/generate", {**body, "parameters": {"max_new_tokens": 5, "return_full_text": True}})
    assert full.json()["generated_text"] == body["inputs"] + plain
    cut = _post(live_server, "/generate", {**body, "parameters": {"max_new_tokens": 1, "truncate": 3,
                                                                  "details": True}}).json()
    assert cut["details"]["prompt_tokens"] == 3  # the last 3 tokens of the input


def test_triton_timeout_ends_the_request(live_server):
    model = live_server.engine.model_info.name
    r = _post(live_server, f"/v2/models/{model}/generate", {
        # greedy, and an answer far longer than one second of decoding
        "text_input": "Count from 1 to 1000, separated by commas: 1, 2, 3,",
        "parameters": {"max_new_tokens": 4000, "timeout": 1, "do_sample": False}})
    assert r.status_code == 504 and "timed out" in r.json()["error"]
    live_server.wait_idle()


def test_mindie_unknown_adapter(fake):
    r = _post(fake, "/infer", {"inputs": "hi", "parameters": {"adapter_id": "nope"}})
    assert r.status_code == 404 and "nope" in r.json()["error"]
