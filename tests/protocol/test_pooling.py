"""The pooling endpoints on the scripted fake engine (tests/fake_engine.py: vectors are a fixed function of the
prompt's token ids): every endpoint's body, shapes and usage, base64, dimensions, the pair forms of /score, the
Jina and Cohere forms of rerank, and the errors, each naming its field."""

from __future__ import annotations

import base64
import math
import struct

import httpx
import pytest

from engine.request import ChatPrompt, TokensPrompt
from spark_server.app import build_app
from spark_server.settings import Settings
from tests.conftest import ServerThread, free_port
from tests.fake_engine import FAKE_HIDDEN, FAKE_MODEL, FakeEngine, fake_vector
from tests.protocol.conftest import FakeServer


def _unit(v: list[float]) -> list[float]:
    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v]


def _cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(_unit(a), _unit(b)))


def _ids(fake: FakeServer, text: str) -> list[int]:
    return fake.engine.tokenizer.encode(text)


def _post(server: FakeServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def _refused(response: httpx.Response, param: str | None, words: str, status: int = 400) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


# ---- /v1/embeddings ---------------------------------------------------------------------------------


def test_embeddings_of_every_input_form(fake):
    ids = _ids(fake, "hello world")
    cases = {"a string": ("hello world", [ids]), "strings": (["hello world", "bye"], [ids, _ids(fake, "bye")]),
             "token ids": (ids, [ids]), "token-id lists": ([ids, [5, 6]], [ids, [5, 6]])}
    for name, (value, prompts) in cases.items():
        body = _post(fake, "/v1/embeddings", {"model": FAKE_MODEL, "input": value}).json()
        assert body["object"] == "list" and body["model"] == FAKE_MODEL and body["id"].startswith("embd-"), name
        assert [d["index"] for d in body["data"]] == list(range(len(prompts)))
        for item, p in zip(body["data"], prompts):
            assert item["object"] == "embedding" and len(item["embedding"]) == FAKE_HIDDEN
            assert item["embedding"] == pytest.approx(_unit(fake_vector(p)), abs=1e-6)
        n = sum(map(len, prompts))
        assert body["usage"] == {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
                                 "prompt_tokens_details": None}
    assert isinstance(fake.engine.pooling_requests[-1].prompt, TokensPrompt)


def test_embeddings_of_chat_messages_go_through_the_chat_template(fake):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    body = _post(fake, "/v1/embeddings", {"messages": messages}).json()
    prompt = fake.engine.pooling_requests[-1].prompt
    assert isinstance(prompt, ChatPrompt) and [m.content for m in prompt.messages] == ["Be brief.", "hi"]
    assert prompt.add_generation_prompt is False  # vLLM's default for the embeddings chat form
    templated = fake.engine.encode_prompt_sync(prompt)
    assert body["usage"]["prompt_tokens"] == len(templated)
    assert body["data"][0]["embedding"] == pytest.approx(_unit(fake_vector(templated)), abs=1e-6)


def test_base64_round_trip(fake):
    as_float = _post(fake, "/v1/embeddings", {"input": ["one", "two"]}).json()["data"]
    as_b64 = _post(fake, "/v1/embeddings", {"input": ["one", "two"], "encoding_format": "base64"}).json()["data"]
    for f, b in zip(as_float, as_b64):
        raw = base64.b64decode(b["embedding"])
        assert len(raw) == 4 * FAKE_HIDDEN
        assert list(struct.unpack(f"<{FAKE_HIDDEN}f", raw)) == pytest.approx(f["embedding"], abs=1e-6)


def test_dimensions_need_a_matryoshka_model(fake):
    _refused(_post(fake, "/v1/embeddings", {"input": "x", "dimensions": 4}), "dimensions",
             "does not support matryoshka representation")
    _refused(_post(fake, "/v1/embeddings", {"input": "x", "dimensions": 0}), "dimensions", "minimum")
    fake.engine.matryoshka = True
    try:
        item = _post(fake, "/v1/embeddings", {"input": "x", "dimensions": 4}).json()["data"][0]
        assert item["embedding"] == pytest.approx(_unit(fake_vector(_ids(fake, "x"))[:4]), abs=1e-6)
        _refused(_post(fake, "/v1/embeddings", {"input": "x", "dimensions": FAKE_HIDDEN + 1}), "dimensions",
                 f"have {FAKE_HIDDEN}")
    finally:
        fake.engine.matryoshka = False


def test_truncate_prompt_tokens_keeps_the_last_tokens(fake):
    ids = _ids(fake, "one two three four five")
    body = _post(fake, "/v1/embeddings", {"input": ids, "truncate_prompt_tokens": 2}).json()
    assert body["usage"]["prompt_tokens"] == 2
    assert body["data"][0]["embedding"] == pytest.approx(_unit(fake_vector(ids[-2:])), abs=1e-6)
    assert fake.engine.pooling_requests[-1].params.truncate_prompt_tokens == 2
    _post(fake, "/v1/embeddings", {"input": "x", "truncate_prompt_tokens": -1})
    assert fake.engine.pooling_requests[-1].params.truncate_prompt_tokens == fake.engine.max_model_len - 1
    _refused(_post(fake, "/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 10 ** 6}),
             "truncate_prompt_tokens", "more than the model's context")


def test_embeddings_errors_name_the_field(fake):
    for body, param, words in [
            ({"inputs": "x"}, None, "'inputs' was unexpected"),
            ({}, "input", "either input or messages"),
            ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, "messages", "not both"),
            ({"input": [1, "a"]}, "input", "not valid"),
            ({"input": []}, "input", "not valid"),
            ({"input": "x", "encoding_format": "int8"}, "encoding_format", "int8"),
            ({"input": "x", "chat_template": "{{ x }}"}, "chat_template", "messages form only"),
            ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"}, "chat_template",
             "--trust-request-chat-template")]:
        _refused(_post(fake, "/v1/embeddings", body), param, words)
    _refused(_post(fake, "/v1/embeddings", {"model": "nope", "input": "x"}), "model", "does not exist", status=404)
    _refused(_post(fake, "/classify", {"input": "x"}), "model", "--task generate")
    not_json = httpx.post(fake.url + "/v1/embeddings", content=b"{", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and "error" in not_json.json()


def test_a_batch_larger_than_the_fan_out_limit_runs_in_turns(fake):
    limit = Settings().max_seqs_per_request
    texts = [f"text {i}" for i in range(limit + 3)]
    body = _post(fake, "/v1/embeddings", {"input": texts}).json()
    assert len(body["data"]) == len(texts) and body["data"][-1]["index"] == len(texts) - 1


def test_pooling_returns_the_embedding_for_a_generation_model(fake):
    body = _post(fake, "/pooling", {"input": ["x", "y"], "encoding_format": "float"}).json()
    assert body["id"].startswith("pool-") and [d["object"] for d in body["data"]] == ["pooling", "pooling"]
    assert body["data"][0]["data"] == pytest.approx(_unit(fake_vector(_ids(fake, "x"))), abs=1e-6)
    assert fake.engine.pooling_requests[-1].params.task == "encode"


# ---- /score and /rerank (embedding cosine) ----------------------------------------------------------


def test_score_in_its_three_pair_forms(fake):
    a, b, c = "What is the capital of France?", "Paris is the capital.", "Horses are animals."
    vec = {t: fake_vector(_ids(fake, t)) for t in (a, b, c)}
    one = _post(fake, "/score", {"text_1": a, "text_2": b, "encoding_format": "float"}).json()
    assert one["object"] == "list" and one["data"] == [{"index": 0, "object": "score",
                                                        "score": pytest.approx(_cos(vec[a], vec[b]), abs=1e-6)}]
    assert one["usage"]["prompt_tokens"] == len(_ids(fake, a)) + len(_ids(fake, b))
    many = _post(fake, "/score", {"text_1": [a], "text_2": [b, c]}).json()
    assert [d["score"] for d in many["data"]] == pytest.approx([_cos(vec[a], vec[b]), _cos(vec[a], vec[c])], abs=1e-6)
    pairs = _post(fake, "/score", {"text_1": [a, b], "text_2": [b, c]}).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx([_cos(vec[a], vec[b]), _cos(vec[b], vec[c])], abs=1e-6)
    assert _post(fake, "/v1/score", {"text_1": [a, b], "text_2": [b, c]}).json()["data"] == pairs["data"]  # vLLM's too
    _refused(_post(fake, "/score", {"text_1": [a, b], "text_2": [a, b, c]}), "text_2", "1:1, 1:N or N:N")
    _refused(_post(fake, "/score", {"text_1": a, "text2": b}), None, "'text_2' is a required property")
    _refused(_post(fake, "/score", {"text_1": a, "text_2": b, "use_activation": True}), "use_activation", "cosine")


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_by_cosine(fake, path):
    query, docs = "capital of France", ["Horses are animals.", "Paris is the capital of France.", "Bread."]
    qv = fake_vector(_ids(fake, query))
    cosines = [_cos(qv, fake_vector(_ids(fake, d))) for d in docs]
    order = sorted(range(3), key=lambda i: -cosines[i])
    jina = _post(fake, path, {"model": FAKE_MODEL, "query": query, "documents": [{"text": d} for d in docs]}).json()
    assert jina["id"].startswith("rerank-") and jina["model"] == FAKE_MODEL
    assert [r["index"] for r in jina["results"]] == order
    assert [r["relevance_score"] for r in jina["results"]] == pytest.approx([cosines[i] for i in order], abs=1e-6)
    assert [r["document"]["text"] for r in jina["results"]] == [docs[i] for i in order]
    assert jina["usage"]["total_tokens"] == len(_ids(fake, query)) + sum(len(_ids(fake, d)) for d in docs)
    cohere = _post(fake, path, {"query": query, "documents": docs, "top_n": 2, "return_documents": False}).json()
    assert [r["index"] for r in cohere["results"]] == order[:2] and all("document" not in r for r in cohere["results"])


def test_rerank_max_tokens_per_doc_and_errors(fake):
    long_doc = "Paris is the capital of France and its largest city by far."
    cut = fake.engine.tokenizer.decode(fake.engine.tokenizer.encode(long_doc, add_special_tokens=False)[:3])
    _post(fake, "/v2/rerank", {"query": "q", "documents": [long_doc], "max_tokens_per_doc": 3})
    assert [r.prompt.text for r in fake.engine.pooling_requests[-2:]] == ["q", cut]
    _refused(_post(fake, "/v1/rerank", {"query": "q", "documents": []}), "documents", "should be non-empty")
    _refused(_post(fake, "/v1/rerank", {"query": "q", "documents": [{"txt": "a"}]}), "documents.0", "not valid")
    _refused(_post(fake, "/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}), "top_n", "minimum")
    _refused(_post(fake, "/v1/rerank", {"query": "q", "documents": ["a"], "rank_fields": ["text"]}), None,
             "'rank_fields' was unexpected")


# ---- a classifier (a head with labels) --------------------------------------------------------------


@pytest.fixture(scope="module")
def classifier_server():
    engine = FakeEngine(task="classify", labels=("negative", "neutral", "positive"))
    settings = Settings(port=free_port())
    with ServerThread(build_app(settings, engine), settings.port):
        yield FakeServer(engine, settings.port)


@pytest.fixture(scope="module")
def cross_encoder_server():
    engine = FakeEngine(task="score", labels=("LABEL_0",))
    settings = Settings(port=free_port())
    with ServerThread(build_app(settings, engine), settings.port):
        yield FakeServer(engine, settings.port)


def test_classify_answers_probabilities_and_labels(classifier_server):
    server = classifier_server
    texts = ["I loved it", "meh"]
    body = _post(server, "/classify", {"input": texts}).json()
    assert body["id"].startswith("classify-") and body["object"] == "list"
    for item, text in zip(body["data"], texts):
        logits = [3 * v for v in fake_vector(_ids(server, text))[:3]]
        exp = [math.exp(v - max(logits)) for v in logits]
        assert item["probs"] == pytest.approx([e / sum(exp) for e in exp], abs=1e-6)
        assert item["num_classes"] == 3
        assert item["label"] == ("negative", "neutral", "positive")[logits.index(max(logits))]
    raw = _post(server, "/classify", {"input": texts[0], "use_activation": False}).json()["data"][0]
    assert raw["probs"] == pytest.approx([3 * v for v in fake_vector(_ids(server, texts[0]))[:3]], abs=1e-5)
    _refused(_post(server, "/classify", {"input": "x", "activation": True, "use_activation": False}), "use_activation",
             "disagree")
    _refused(_post(server, "/v1/embeddings", {"input": "x"}), "model", "--task classify")
    _refused(_post(server, "/score", {"text_1": "a", "text_2": "b"}), "model", "Score API")
    pooled = _post(server, "/pooling", {"input": "x"}).json()["data"][0]["data"]
    assert len(pooled) == 3 and sum(pooled) == pytest.approx(1.0)


def test_a_cross_encoder_scores_each_pair_as_one_prompt(cross_encoder_server):
    server = cross_encoder_server
    tok = server.engine.tokenizer
    body = _post(server, "/score", {"text_1": "query", "text_2": ["doc one", "doc two"]}).json()
    for item, doc in zip(body["data"], ["doc one", "doc two"]):
        ids = tok("query", text_pair=doc)["input_ids"]
        assert item["score"] == pytest.approx(1 / (1 + math.exp(-3 * fake_vector(ids)[0])), abs=1e-6)
    assert [r.params.task for r in server.engine.pooling_requests[-2:]] == ["score", "score"]
    ranked = _post(server, "/rerank", {"query": "query", "documents": ["doc one", "doc two"]}).json()["results"]
    assert sorted(r["relevance_score"] for r in ranked)[::-1] == [r["relevance_score"] for r in ranked]


def test_openapi_lists_the_pooling_endpoints(fake):
    paths = httpx.get(fake.url + "/openapi.json").json()["paths"]
    for path in ("/v1/embeddings", "/pooling", "/classify", "/score", "/rerank", "/v1/rerank", "/v2/rerank"):
        assert "post" in paths[path]
