"""Real clients (HF text_generation), error shapes per protocol, and greedy parity with Spark.

The error shapes are each bridge's own and run on the scripted fake engine; answers, aborts and a model
step's fault mid-stream run on the real engine."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from text_generation import Client
from text_generation.errors import ValidationError as TGIValidationError

from tests.spark.client import answer_text, converse, spark_request


def test_hf_text_generation_client_generates_and_streams(hf_server):
    client = Client(hf_server.http_url, timeout=120)
    full = client.generate("The capital of France is", max_new_tokens=8)
    assert full.generated_text and full.details.generated_tokens == len(full.details.tokens)
    assert full.details.finish_reason.value in ("length", "eos_token", "stop_sequence")
    assert all(isinstance(t.id, int) and isinstance(t.special, bool) for t in full.details.tokens)
    streamed = list(client.generate_stream("The capital of France is", max_new_tokens=8))
    assert "".join(r.token.text for r in streamed) == full.generated_text  # greedy by default
    assert streamed[-1].details.finish_reason == full.details.finish_reason
    sampled = client.generate("Once", max_new_tokens=6, do_sample=True, temperature=0.7, seed=5)
    again = client.generate("Once", max_new_tokens=6, do_sample=True, temperature=0.7, seed=5)
    assert sampled.generated_text == again.generated_text and sampled.details.seed == 5
    with pytest.raises(TGIValidationError):
        client.generate("hi", max_new_tokens=5, truncate=0)


def _model(server) -> str:
    return server.engine.model_info.name


CASES = [
    # (path, malformed status, out-of-range body, unknown-model request, expected unknown status, error key)
    ("tgi", "/generate", 400, {"inputs": "hi", "parameters": {"temperature": -1}}, 422, "error"),
    ("vllm", "/generate", 400, {"prompt": "hi", "top_p": 3}, 400, "error"),
    ("sglang", "/generate", 400, {"text": "hi", "sampling_params": {"top_p": 3}}, 400, "error"),
    ("mindie", "/infer", 400, {"inputs": "hi", "parameters": {"top_k": -3}}, 400, "error"),
    ("tokenizer", "/v1/tokenizer", 400, {"inputs": ""}, 400, "error"),
    ("openai", "/v1/completions", 400, {"model": "MODEL", "prompt": "hi", "max_tokens": 0}, 400, "error"),
    ("triton", "/v2/models/MODEL/generate", 400, {"text_input": "hi", "parameters": {"max_new_tokens": 0}}, 400,
     "error"),
]


@pytest.mark.parametrize("name, path, bad_status, out_of_range, range_status, key", CASES, ids=[c[0] for c in CASES])
def test_errors_and_the_server_keeps_serving(fake, name, path, bad_status, out_of_range, range_status, key):
    url = fake.http_url + path.replace("MODEL", _model(fake))
    body = {k: (_model(fake) if v == "MODEL" else v) for k, v in out_of_range.items()}
    bad = httpx.post(url, content=b"{oops", timeout=30)
    assert bad.status_code == bad_status and key in bad.json()
    wrong = httpx.post(url, json=body, timeout=30)
    assert wrong.status_code == range_status, wrong.text
    assert key in wrong.json()
    ok = {"tgi": {"inputs": "hi", "parameters": {"max_new_tokens": 2}},
          "vllm": {"prompt": "hi", "max_tokens": 2}, "sglang": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
          "mindie": {"inputs": "hi", "parameters": {"max_new_tokens": 2}}, "tokenizer": {"inputs": "hi"},
          "openai": {"model": _model(fake), "prompt": "hi", "max_tokens": 2},
          "triton": {"text_input": "hi", "parameters": {"max_new_tokens": 2}}}[name]
    assert httpx.post(url, json=ok, timeout=60).status_code == 200


@pytest.mark.parametrize("path, body, status", [
    ("/v2/models/no-such-model/generate", {"text_input": "hi"}, 404),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404),
    ("/generate", {"prompt": "hi", "model": "no-such-adapter"}, 404),
    ("/generate", {"inputs": "hi", "parameters": {"adapter_id": "no-such-adapter"}}, 404),
    ("/generate", {"text": "hi", "lora_path": "no-such-adapter"}, 404),
    ("/tokenize", {"prompt": "hi", "model": "no-such-model"}, 404),
])
def test_unknown_model_or_adapter(fake, path, body, status):
    r = httpx.post(fake.http_url + path, json=body, timeout=30)
    assert r.status_code == status and "error" in r.json(), r.text


def test_unknown_generate_shape(fake):
    r = httpx.post(fake.http_url + "/generate", json={"question": "hi"}, timeout=30)
    assert r.status_code == 422 and "inputs" in r.json()["error"]


def test_each_bridge_greedy_answer_equals_spark(live_server):
    question, limit = "What is the capital of France?", 12
    spark = answer_text(asyncio.run(converse(live_server.ws_url, spark_request(question, max_tokens=limit, top_k=1))))
    tok = live_server.engine.tokenizer
    templated = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                        add_generation_prompt=True)
    # raw-text protocols tokenize the text as it is (the GGUF says add_bos_token false: no BOS is added)
    text = templated
    ids = tok.encode(templated, add_special_tokens=False)
    model = _model(live_server)
    base = live_server.http_url
    answers = {
        "tgi": httpx.post(base + "/generate", json={"inputs": text, "parameters": {"max_new_tokens": limit}},
                          timeout=60).json()["generated_text"],
        "vllm": httpx.post(base + "/generate", json={"prompt": text, "max_tokens": limit, "temperature": 0},
                           timeout=60).json()["text"][0][len(text):],
        "sglang": httpx.post(base + "/generate", json={"input_ids": ids, "sampling_params":
                             {"temperature": 0, "max_new_tokens": limit}}, timeout=60).json()["text"],
        "triton": httpx.post(base + f"/v2/models/{model}/generate", json={"text_input": text, "parameters":
                             {"max_new_tokens": limit}}, timeout=60).json()["text_output"],
        "mindie": httpx.post(base + "/infer", json={"inputs": text, "parameters": {"max_new_tokens": limit}},
                             timeout=60).json()["generated_text"],
        "openai-chat": httpx.post(base + "/v1/chat/completions", json={"model": model, "messages": [
            {"role": "user", "content": question}], "max_tokens": limit, "temperature": 0},
            timeout=60).json()["choices"][0]["message"]["content"],
        "openai-completion": httpx.post(base + "/v1/completions", json={"model": model, "prompt": ids,
                                        "max_tokens": limit, "temperature": 0},
                                        timeout=60).json()["choices"][0]["text"],
    }
    for name, answer in answers.items():
        assert answer == spark, name
    triton_ids = httpx.post(base + f"/v2/models/{model}/infer", json={
        "inputs": [{"name": "input0", "shape": [len(ids)], "datatype": "UINT32", "data": ids}],
        "outputs": [{"name": "output0"}], "parameters": {"max_new_tokens": limit}}, timeout=60).json()
    assert tok.decode(triton_ids["outputs"][0]["data"][len(ids):], skip_special_tokens=True) == spark


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Write a very long story about the sea.", "max_tokens": 3000, "ignore_eos": True}),
    ("/generate", {"text": "Write a very long story about the sea.",  # SGLang's shape
                   "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}),
    ("/turing/v3/func/gpt", None),  # Spark's own HTTP form
])
def test_client_hanging_up_on_a_non_streaming_call_aborts_it(live_server, path, body):
    """Nobody is left to read the answer: the engine must stop generating it and free its cache."""
    core = live_server.engine.engine
    aborted_before = core.num_aborted
    if path == "/v1/completions":
        body = {**body, "model": _model(live_server)}
    if body is None:  # Spark has no ignore_eos: greedy, whose answer here runs to max_tokens (sampled, it
        # could end within the second the client waits, and the call would not be cut off)
        body = spark_request("Write a very long story about the sea.", max_tokens=4000, temperature=0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.http_url + path, json=body, timeout=httpx.Timeout(10, read=1.0))
    live_server.wait_idle(timeout=10)  # far sooner than 3,000 tokens would take
    assert core.num_aborted == aborted_before + 1


@pytest.mark.parametrize("path, body, last_event", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 32,
                              "stream": True},
     lambda events: events[-2].startswith('{"error"') and events[-1] == "[DONE]"),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 32, "stream": True},
     lambda events: events[-2].startswith('{"error"') and events[-1] == "[DONE]"),
    ("/generate_stream", {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 32}},
     lambda events: '"error_type"' in events[-1]),
    ("/generate", {"prompt": "Once upon a time", "max_tokens": 32, "stream": True},
     lambda chunks: chunks[-1].startswith('{"error"')),
    ("/generate", {"text": "Once upon a time", "stream": True, "sampling_params": {"max_new_tokens": 32}},
     lambda events: events[-2].startswith('{"error"') and events[-1] == "[DONE]"),
    ("/v2/models/{model}/generate_stream", {"text_input": "Once upon a time", "parameters": {"max_new_tokens": 32}},
     lambda events: events[-1].startswith('{"error"')),
    ("/infer", {"inputs": "Once upon a time", "stream": True, "parameters": {"max_new_tokens": 32}},
     lambda events: events[-1].startswith('{"error"')),
])
def test_a_failure_mid_stream_ends_with_the_protocols_error_event(live_server, path, body, last_event):
    """After the first byte the status is sent: a model-step failure must end the stream with the
    protocol's own error event (and terminator), not a cut connection."""
    model = live_server.engine.model_info.name
    if path.startswith("/v1/"):
        body = {"model": model, **body}
    core = live_server.engine.engine
    steps = {"n": 0}

    def fail_later(seqs):
        steps["n"] += 1
        if steps["n"] > 3:
            raise RuntimeError("injected fault")

    core.fault_hook = fail_later
    try:
        resp = httpx.post(live_server.http_url + path.format(model=model), json=body, timeout=60)
    finally:
        core.fault_hook = None
    assert resp.status_code == 200
    if "\0" in resp.text:
        events = [c for c in resp.text.split("\0") if c]
    else:
        events = [line.removeprefix("data: ") for line in resp.text.splitlines() if line.startswith("data: ")]
    assert len(events) >= 2 and last_event(events), events[-3:]
    assert "injected fault" in resp.text
    live_server.wait_idle()
