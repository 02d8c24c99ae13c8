"""Every spec example body, sent verbatim; each answer checked field by field against the spec's shape.

Shapes are the bridges' own: they run on the scripted fake engine (real tokenizer, scripted answers). The
SGLang example, whose answer must name Paris, runs on the real model, as does each bridge's greedy answer in
test_clients_and_errors."""

from __future__ import annotations

import itertools
import json

import httpx

from tests.bridges import spec_examples as ex


def post(server, path, body, **kw):
    return httpx.post(server.http_url + path, json=body, timeout=120, **kw)


def sse_events(resp) -> list:
    return [json.loads(line[len("data:"):]) for line in resp.text.splitlines()
            if line.startswith("data:") and line.strip() != "data: [DONE]"]


def test_tgi_generate(fake):
    r = post(fake, "/generate", ex.TGI_GENERATE)
    assert r.status_code == 200
    data = r.json()
    assert isinstance(data["generated_text"], str) and data["generated_text"]
    d = data["details"]
    assert d["finish_reason"] in ("length", "eos_token", "stop_sequence")
    assert d["generated_tokens"] == len(d["tokens"]) <= 20
    assert isinstance(d["seed"], int) and d["prompt_tokens"] > 0
    assert len(d["prefill"]) == d["prompt_tokens"]  # decoder_input_details
    for tok in d["tokens"] + d["prefill"]:
        assert set(tok) == {"id", "logprob", "special", "text"} and tok["special"] is None
    assert isinstance(d["tokens"][0]["id"], int)  # the MindIE document: details.tokens[].id is an int
    assert r.headers["X-Ignored-Parameters"] == "typical_p"


def test_tgi_generate_stream(fake):
    r = post(fake, "/generate_stream", ex.TGI_GENERATE_STREAM)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    for e in events[:-1]:
        assert set(e) == {"token", "generated_text", "details"} and e["generated_text"] is None
        assert isinstance(e["token"]["id"], list) and e["token"]["special"] is None
    last = events[-1]
    assert last["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert set(last["details"]) >= {"prompt_tokens", "finish_reason", "generated_tokens", "seed"}
    assert last["details"]["generated_tokens"] == len(events)


def test_vllm_generate(fake):
    r = post(fake, "/generate", ex.VLLM_GENERATE)
    assert r.status_code == 200
    text = r.json()["text"]
    assert isinstance(text, list) and len(text) == 1 and text[0].startswith(ex.VLLM_GENERATE["prompt"])


def test_vllm_generate_stream_is_nul_separated_deltas(fake):
    body = dict(ex.VLLM_GENERATE, stream=True, temperature=0)
    r = post(fake, "/generate", body)
    chunks = [json.loads(c) for c in r.content.decode().split("\0") if c]
    assert len(chunks) > 1 and all(list(c) == ["text"] and len(c["text"]) == 1 for c in chunks)
    full = post(fake, "/generate", dict(ex.VLLM_GENERATE, temperature=0)).json()["text"][0]
    assert ex.VLLM_GENERATE["prompt"] + "".join(c["text"][0] for c in chunks) == full


def test_vllm_cumulative_and_full_text_variants(fake_variant_server):
    r = post(fake_variant_server, "/generate", dict(ex.VLLM_GENERATE, stream=True, temperature=0))
    lines = [json.loads(x) for x in r.text.splitlines() if x]
    assert all(x["text"][0].startswith(ex.VLLM_GENERATE["prompt"]) for x in lines)
    assert all(b["text"][0].startswith(a["text"][0]) for a, b in itertools.pairwise(lines))
    events = sse_events(post(fake_variant_server, "/generate_stream", ex.TGI_GENERATE_STREAM))
    texts = [e["token"]["text"] for e in events]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # fullTextEnabled: cumulative
    assert events[-1]["generated_text"] == texts[-1]


def test_triton_generate(fake):
    model = fake.engine.model_info.name
    r = post(fake, f"/v2/models/{model}/generate", ex.TRITON_GENERATE)
    assert r.status_code == 200
    data = r.json()
    assert data["id"] == "a123" and data["model_name"] == model and data["model_version"] is None
    assert isinstance(data["text_output"], str)
    d = data["details"]
    assert d["finish_reason"] in ("length", "eos_token", "stop_sequence") and d["generated_tokens"] <= 5
    assert d["first_token_cost"] is None and d["decode_cost"] is None
    assert len(d["perf_stat"]) == d["generated_tokens"]


def test_triton_generate_stream(fake):
    model = fake.engine.model_info.name
    r = post(fake, f"/v2/models/{model}/generate_stream", ex.TRITON_GENERATE)
    events = sse_events(r)
    assert 1 <= len(events) <= 5
    assert r.text.count("data:") == len(events)  # one event per write
    counts = [e["details"]["generated_tokens"] for e in events]
    # a token an event as the stream keeps up; a reader that falls a step behind gets two in one event
    assert counts == sorted(set(counts)) and counts[0] >= 1 and counts[-1] <= 5, counts
    for i, e in enumerate(events):
        assert e["id"] == "a123" and e["model_name"] == model and "text_output" in e
        d = e["details"]
        assert d["batch_size"] == 100 and isinstance(d["queue_wait_time"], int)
        assert len(d["perf_stat"]) == d["generated_tokens"]  # cumulative, one entry a token
        assert (e["prefill_time"] is None) == (i > 0) and (e["decode_time"] is None) == (i == 0)
    assert events[-1]["details"]["finish_reason"] in ("length", "eos_token", "stop_sequence")


def test_triton_infer(fake):
    model = fake.engine.model_info.name
    r = post(fake, f"/v2/models/{model}/infer", ex.TRITON_INFER)
    assert r.status_code == 200
    data = r.json()
    assert data["id"] == "42"
    (out,) = data["outputs"]
    assert out["name"] == "output0" and out["datatype"] == "UINT32"
    assert out["shape"] == [1, len(out["data"])] and out["data"][:10] == ex.TRITON_INFER["inputs"][0]["data"]
    assert 10 < len(out["data"]) <= 30
    assert r.headers["X-Ignored-Parameters"] == "watermark"


def test_mindie_infer(fake):
    r = post(fake, "/infer", ex.MINDIE_INFER)
    data = r.json()
    assert isinstance(data["generated_text"], str)
    assert set(data["details"]) == {"finish_reason", "generated_tokens", "seed"}
    stream = sse_events(post(fake, "/infer", dict(ex.MINDIE_INFER, stream=True)))
    assert stream[0]["prefill_time"] is not None and stream[0]["decode_time"] is None
    for e in stream[1:]:
        assert e["prefill_time"] is None and e["decode_time"] is not None
    for e in stream:
        assert isinstance(e["token"]["id"], list) and isinstance(e["token"]["text"], str)
    assert stream[-1]["generated_text"] == "".join(e["token"]["text"] for e in stream)
    assert stream[-1]["details"]["generated_tokens"] == sum(len(e["token"]["id"]) for e in stream)


def test_tokenizer(fake):
    data = post(fake, "/v1/tokenizer", ex.TOKENIZER).json()
    assert data["token_number"] == len(data["tokens"]) > 0
    assert "".join(data["tokens"]).endswith(ex.TOKENIZER["inputs"])
    ids = post(fake, "/tokenize", {"prompt": ex.TOKENIZER["inputs"]}).json()
    assert ids["count"] == data["token_number"] and ids["max_model_len"] > 0
    bare = post(fake, "/tokenize", {"prompt": ex.TOKENIZER["inputs"], "add_special_tokens": False}).json()
    assert bare["count"] == ids["count"]  # the model's GGUF says add_bos_token false: no BOS to leave out
    assert post(fake, "/detokenize", {"tokens": bare["tokens"]}).json()["prompt"] == ex.TOKENIZER["inputs"]


def test_sglang_generate(live_server):
    data = post(live_server, "/generate", ex.SGLANG_GENERATE).json()
    assert "Paris" in data["text"] and len(data["output_ids"]) == data["meta_info"]["completion_tokens"]
    meta = data["meta_info"]
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["prompt_tokens"] > 0
    assert "cached_tokens" in meta and meta["id"]
    stream = post(live_server, "/generate", dict(ex.SGLANG_GENERATE, stream=True))
    assert stream.text.rstrip().endswith("data: [DONE]")
    events = sse_events(stream)
    assert events[-1]["text"] == data["text"]  # cumulative text; greedy equals the non-streamed answer
    batch = post(live_server, "/generate", {"text": ["1, 2, 3,", "a, b, c,"], "sampling_params":
                                            {"temperature": 0, "max_new_tokens": 4}, "return_logprob": True,
                                            "top_logprobs_num": 2}).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert len(batch[0]["meta_info"]["output_top_logprobs"][0]) == 2
    info = httpx.get(live_server.http_url + "/get_model_info").json()
    assert info["is_generation"] is True


def test_openapi_document(fake):
    doc = httpx.get(fake.http_url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    for path in ("/v1/chat/completions", "/generate", "/v2/models/{model}/infer", "/infer", "/v1/tokenizer",
                 "/turing/v3/func/gpt"):
        assert path in doc["paths"]
    import schemas

    assert set(doc["components"]["schemas"]) == set(schemas.available())
    assert "urn:" not in json.dumps(doc)


def test_details_only_when_asked_for(fake):
    """TGI stream and MindIE: `details` only when the request says details=true (the spec's rule);
    decoder_input_details=true is refused on a TGI stream."""
    plain = {"inputs": "My name is Olivier and I", "parameters": {"max_new_tokens": 4}}
    tgi = sse_events(post(fake, "/generate_stream", plain))
    assert all(e["details"] is None for e in tgi) and tgi[-1]["generated_text"] is not None
    refused = httpx.post(fake.http_url + "/generate_stream", json={
        "inputs": "hi", "parameters": {"max_new_tokens": 4, "decoder_input_details": True}}, timeout=60)
    assert refused.status_code == 422 and "decoder_input_details" in refused.json()["error"]
    mindie = post(fake, "/infer", plain).json()
    assert "details" not in mindie and isinstance(mindie["generated_text"], str)
    stream = sse_events(post(fake, "/infer", dict(plain, stream=True)))
    assert all("details" not in e for e in stream) and "generated_text" in stream[-1]
