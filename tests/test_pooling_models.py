"""The pooling endpoints on real models, through real clients: the embedded model's embeddings equal
transformers' (the last token's final-normed hidden state, L2-normalised) through the official openai client,
rerank and score rank documents as those embeddings' cosine does (Jina's and Cohere's shapes), and a tiny
random Qwen3 classifier served with --task classify answers /classify with transformers' logits."""

from __future__ import annotations

import itertools
import math

import httpx
import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.model_loader import resolve_model_dir
from spark_server.app import build_app
from spark_server.settings import Settings
from tests.conftest import ServerThread, free_port
from tests.tiny_checkpoints import LABELS, save_tiny_classifier

# Natural sentences: the engine's bf16 activations keep these within ~2e-4 of transformers' fp32 cosine (a
# 3-token phrase such as "A short one" reaches 1.3e-3, as transformers' own bf16 forward does).
QUERY = "What is the capital of France?"
DOCUMENTS = ["The capital of Brazil is Brasilia.", "The capital of France is Paris.",
             "Horses and cows are both animals"]


@pytest.fixture(scope="module")
def reference(live_server):
    """transformers' fp32 forward of the served model's converted directory: text -> embedding."""
    from transformers import AutoModelForCausalLM

    # the embedded GGUF file the live server serves, as transformers converts it (model_info.path is its
    # metadata directory: no weights there)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(None), dtype=torch.float32).eval()

    def embed(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            last = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(last, dim=-1)

    return embed


def _cos(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(a @ b / (a.norm() * b.norm()))


def test_embeddings_equal_transformers_through_the_openai_client(live_server, reference):
    from openai import OpenAI

    client = OpenAI(base_url=live_server.http_url + "/v1", api_key="unused")
    tok = live_server.engine.tokenizer
    texts = [QUERY, DOCUMENTS[1]]
    ids = tok.encode(DOCUMENTS[0])
    batch = client.embeddings.create(model=live_server.engine.model_info.name, input=texts)  # base64 on the wire
    single = client.embeddings.create(model=live_server.engine.model_info.name, input=QUERY, encoding_format="float")
    by_ids = client.embeddings.create(model=live_server.engine.model_info.name, input=[ids])
    assert [d.index for d in batch.data] == [0, 1]
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(len(tok.encode(t)) for t in texts)
    got = [(batch.data[0].embedding, tok.encode(QUERY)), (batch.data[1].embedding, tok.encode(DOCUMENTS[1])),
           (single.data[0].embedding, tok.encode(QUERY)), (by_ids.data[0].embedding, ids)]
    for vector, prompt in got:
        assert len(vector) == 576 and math.isclose(sum(v * v for v in vector), 1.0, rel_tol=1e-4)
        assert _cos(vector, reference(prompt)) > 1 - 1e-3


# A text embedded in another batch rounds its bf16 activations in another order: each vector stays within
# 1 - cos ~2e-4 of the fp32 one (above), i.e. moves by up to ~0.02, and a cosine between two by about as much.
BATCH_ROUNDING = 2e-2


def test_rerank_and_score_rank_as_the_embedding_cosine(live_server):
    url = live_server.http_url
    vectors = httpx.post(url + "/v1/embeddings", json={"input": [QUERY, *DOCUMENTS]}, timeout=60).json()["data"]
    cosines = [_cos(vectors[0]["embedding"], d["embedding"]) for d in vectors[1:]]
    ranked = sorted(range(len(DOCUMENTS)), key=lambda i: -cosines[i])
    # the ranks below are compared exactly: no two documents are within the rounding of each other
    assert all(cosines[a] - cosines[b] > 2 * BATCH_ROUNDING for a, b in itertools.pairwise(ranked)), cosines
    assert ranked[0] == 1  # the model does know where Paris is

    jina = httpx.post(url + "/v1/rerank", json={"model": live_server.engine.model_info.name, "query": QUERY,
                                                "documents": [{"text": d} for d in DOCUMENTS]}, timeout=60).json()
    assert [r["index"] for r in jina["results"]] == ranked
    assert [r["document"]["text"] for r in jina["results"]] == [DOCUMENTS[i] for i in ranked]
    for r in jina["results"]:
        assert r["relevance_score"] == pytest.approx(cosines[r["index"]], abs=BATCH_ROUNDING)
    assert jina["usage"]["total_tokens"] > 0

    cohere = httpx.post(url + "/v2/rerank", json={"model": "default", "query": QUERY, "documents": DOCUMENTS,
                                                  "top_n": 2, "return_documents": False}, timeout=60).json()
    assert [r["index"] for r in cohere["results"]] == ranked[:2] and "document" not in cohere["results"][0]

    score = httpx.post(url + "/score", json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=60).json()
    assert [d["score"] for d in score["data"]] == pytest.approx(cosines, abs=BATCH_ROUNDING)


@pytest.fixture(scope="module")
def classify_server(tmp_path_factory):
    path = save_tiny_classifier(tmp_path_factory.mktemp("tiny") / "qwen3-cls")
    engine = AsyncEngine.from_config(EngineConfig(model=str(path), task="classify", dtype="float32", num_kv_blocks=64,
                                                  kv_cache_prefault=False))
    engine.start()
    settings = Settings(port=free_port())
    try:
        with ServerThread(build_app(settings, engine, owns_engine=False), settings.port):
            yield path, f"http://127.0.0.1:{settings.port}"
    finally:
        engine.shutdown()


def test_a_tiny_qwen3_classifier_answers_classify_with_transformers_logits(classify_server):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path, url = classify_server
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    texts = ["I loved this film.", "The weather is grey today, and the bus was late again."]
    probs = httpx.post(url + "/classify", json={"input": texts}).json()
    raw = httpx.post(url + "/classify", json={"input": texts, "use_activation": False}).json()
    assert probs["usage"]["prompt_tokens"] == sum(len(tok.encode(t)) for t in texts)
    for i, text in enumerate(texts):
        with torch.inference_mode():
            logits = hf(**tok(text, return_tensors="pt")).logits[0]
        item = probs["data"][i]
        assert item["num_classes"] == 3 and item["label"] == LABELS[int(logits.argmax())]
        assert item["probs"] == pytest.approx(logits.softmax(-1).tolist(), abs=1e-5)
        assert raw["data"][i]["probs"] == pytest.approx(logits.tolist(), abs=1e-4)
    refused = httpx.post(url + "/v1/embeddings", json={"input": "x"})
    assert refused.status_code == 400 and "--task classify" in refused.json()["error"]["message"]
    generation = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert generation.status_code == 400 and "does not generate" in generation.json()["error"]["message"]
