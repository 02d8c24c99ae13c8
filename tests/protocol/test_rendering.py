"""Response shapes on the fake engine, field by field as the documents state them."""

from __future__ import annotations

import json

import httpx

from tests.fake_engine import Script


def _events(r: httpx.Response) -> list:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line[6:] != "[DONE]"]


def test_tgi_stream_events_carry_their_own_tokens_text_when_outputs_were_merged(fake):
    """Under load a slow consumer gets several tokens in one output; each TGI event must still carry its
    own token's text (it once came one event late: {id:[288], text:""}, then both texts together)."""
    fake.engine.script = Script(burst=3)
    r = httpx.post(fake.url + "/generate_stream", json={"inputs": "hi", "parameters": {"max_new_tokens": 20}})
    events = _events(r)
    tok = fake.engine.tokenizer
    for e in events:
        (tid,) = e["token"]["id"]
        assert e["token"]["text"] == tok.decode([tid]), e
    assert "".join(e["token"]["text"] for e in events) == fake.engine.script.answer


def test_tgi_generate_details_token_ids_are_ints_in_the_spec_shape(fake):
    r = httpx.post(fake.url + "/generate", json={"inputs": "hi", "parameters": {"details": True,
                                                                                 "max_new_tokens": 3}})
    tokens = r.json()["details"]["tokens"]
    assert all(isinstance(t["id"], int) and t["special"] is None and t["logprob"] is None for t in tokens)
    stream = _events(httpx.post(fake.url + "/generate_stream", json={"inputs": "hi",
                                                                      "parameters": {"max_new_tokens": 2}}))
    assert all(isinstance(e["token"]["id"], list) for e in stream)
    assert all(e["details"] is None for e in stream)  # no details unless asked


def test_tgi_stream_refuses_decoder_input_details(fake):
    r = httpx.post(fake.url + "/generate_stream", json={"inputs": "hi", "parameters": {"decoder_input_details": True}})
    assert r.status_code == 422 and "decoder_input_details" in r.json()["error"]


def test_mindie_infer_details_only_when_asked(fake):
    plain = httpx.post(fake.url + "/infer", json={"inputs": "hi", "parameters": {"details": False}}).json()
    assert "details" not in plain
    asked = httpx.post(fake.url + "/infer", json={"inputs": "hi", "parameters": {"details": True}}).json()
    answer_ids = fake.engine.tokenizer.encode(fake.engine.script.answer, add_special_tokens=False)
    assert asked["details"]["generated_tokens"] == len(answer_ids)


def test_triton_perf_stat_times_are_filled_in(fake):
    r = httpx.post(fake.url + "/v2/models/fake-model/generate",
                   json={"text_input": "hi", "parameters": {"perf_stat": True, "max_new_tokens": 4}})
    perf = r.json()["details"]["perf_stat"]
    assert len(perf) == 4 and all(isinstance(ms, (int, float)) and ms >= 0 for _, ms in perf)


def test_completions_echo_with_logprobs_covers_the_prompts_tokens(fake):
    """vLLM's and OpenAI's legacy form (what lm-evaluation-harness reads to score a text): with echo, logprobs
    list the prompt's tokens first (the first with none), then the answer's, each text_offset counting from
    the echoed text's start, streamed or not; each top_logprobs holds the chosen token too."""
    body = {"model": "fake-model", "prompt": "The capital of France is", "max_tokens": 3, "echo": True,
            "logprobs": 1, "temperature": 0}
    tok = fake.engine.tokenizer
    prompt_ids = tok.encode(body["prompt"], add_special_tokens=False)
    whole = httpx.post(fake.url + "/v1/completions", json=body).json()["choices"][0]
    events = _events(httpx.post(fake.url + "/v1/completions", json={**body, "stream": True}))
    streamed = [e["choices"][0] for e in events if e["choices"]]
    for logprobs in (whole["logprobs"], {
            key: [v for c in streamed if c["logprobs"] for v in c["logprobs"][key]] for key in whole["logprobs"]}):
        names = logprobs["tokens"]
        assert names[:len(prompt_ids)] == [tok.decode([t]) for t in prompt_ids] and len(names) == len(prompt_ids) + 3
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:len(prompt_ids)] == [-p / 10 for p in range(1, len(prompt_ids))]
        assert logprobs["text_offset"] == [sum(map(len, names[:k])) for k in range(len(names))]
        assert logprobs["text_offset"][len(prompt_ids)] == len(body["prompt"])  # the answer's first token
        assert all(names[k] in top for k, top in enumerate(logprobs["top_logprobs"]) if top is not None)
    assert whole["text"].startswith(body["prompt"]) and whole["prompt_logprobs"][0] is None
    assert not any("prompt_logprobs" in c for c in streamed)  # a stream carries them only when asked
    # n samples: each echoes the prompt's tokens, which the engine sends with the first sample's output only
    events = _events(httpx.post(fake.url + "/v1/completions", json={**body, "n": 2, "stream": True}))
    for index in (0, 1):
        first = next(e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index)
        assert first["logprobs"]["tokens"][:len(prompt_ids)] == [tok.decode([t]) for t in prompt_ids], index


def test_completions_echo_with_max_tokens_0_scores_the_prompt_alone(fake):
    """vLLM's echo without generation: the prompt back with its tokens' logprobs and nothing of an answer,
    streamed or not; max_tokens 0 without echo, or in chat, is refused naming the field."""
    body = {"model": "fake-model", "prompt": "The capital of France is", "max_tokens": 0, "echo": True,
            "logprobs": 2}
    prompt_ids = fake.engine.tokenizer.encode(body["prompt"], add_special_tokens=False)
    whole = httpx.post(fake.url + "/v1/completions", json=body).json()
    events = _events(httpx.post(fake.url + "/v1/completions", json={**body, "stream": True}))
    streamed = [e["choices"][0] for e in events if e["choices"]]
    assert whole["choices"][0]["text"] == "".join(c["text"] for c in streamed) == body["prompt"]
    assert whole["choices"][0]["finish_reason"] == streamed[-1]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 0
    for logprobs in (whole["choices"][0]["logprobs"], streamed[0]["logprobs"]):
        assert len(logprobs["tokens"]) == len(prompt_ids) and logprobs["token_logprobs"][0] is None
    for refused in ({**body, "echo": False}, {"model": "fake-model", "max_tokens": 0,
                                               "messages": [{"role": "user", "content": "hi"}]}):
        path = "/v1/chat/completions" if "messages" in refused else "/v1/completions"
        r = httpx.post(fake.url + path, json=refused)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_openai_chat_stream_shapes(fake):
    r = httpx.post(fake.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = _events(r)
    first = events[0]
    assert first["choices"][0]["delta"]["role"] == "assistant" and first["prompt_token_ids"]
    body = [e for e in events[1:] if e["choices"]]
    assert all(e["usage"]["completion_tokens"] >= 1 for e in body)  # continuous usage
    assert sum(len(e["choices"][0]["token_ids"]) for e in body) == events[-1]["usage"]["completion_tokens"]
    assert body[-1]["choices"][0]["finish_reason"] == "stop"
    # FastDeploy's places: the prompt's ids in the first delta, each chunk's ids in its delta
    assert first["choices"][0]["delta"]["prompt_token_ids"] == first["prompt_token_ids"]
    assert all(e["choices"][0]["delta"]["completion_token_ids"] == e["choices"][0]["token_ids"] for e in body)


def test_openai_chat_token_ids_where_vllm_and_fastdeploy_put_them(fake):
    r = httpx.post(fake.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "return_token_ids": True})
    data = r.json()
    message = data["choices"][0]["message"]
    assert message["prompt_token_ids"] == data["prompt_token_ids"] and data["prompt_token_ids"]
    assert message["completion_token_ids"] == data["choices"][0]["token_ids"]
    assert fake.engine.tokenizer.decode(message["completion_token_ids"]) == message["content"]


def test_openai_logprobs_as_token_ids_and_prompt_logprobs(fake):
    r = httpx.post(fake.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 1,
                                                        "return_tokens_as_token_ids": True, "prompt_logprobs": 1})
    choice = r.json()["choices"][0]
    assert all(t.startswith("token_id:") for t in choice["logprobs"]["tokens"])
    assert "prompt_logprobs" in choice


def test_openai_chat_echo_continues_the_last_assistant_message(fake):
    r = httpx.post(fake.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well, "}],
        "echo": True, "continue_final_message": True, "add_generation_prompt": False})
    assert r.json()["choices"][0]["message"]["content"] == "Well, " + fake.engine.script.answer


def test_ollama_shapes(fake):
    lines = [json.loads(x) for x in httpx.post(fake.url + "/api/generate", json={
        "model": "fake-model", "prompt": "hi"}).text.splitlines()]
    assert all(not x["done"] and x["response"] for x in lines[:-1])
    final = lines[-1]
    assert final["done"] and final["done_reason"] == "stop" and final["eval_count"] == len(lines) - 1
    assert isinstance(final["context"], list) and final["prompt_eval_count"] > 0
    tags = httpx.get(fake.url + "/api/tags").json()["models"]
    assert tags[0]["name"] == "fake-model"
    r = httpx.post(fake.url + "/api/chat", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and "not found" in r.json()["error"]


def test_spark_http_answer_follows_the_documents_markers(fake):
    fake.engine.script = Script(answer="Line one.\nLine two.")
    body = {"header": {"traceId": "t"}, "payload": {"message": {"text": [{"role": "user", "content": "hi"}]}}}
    r = httpx.post(fake.url + "/turing/v3/func/gpt", json=body)
    assert r.json()["payload"]["choices"]["text"][0]["content"] == "Line one.<ret>Line two.<end>"
