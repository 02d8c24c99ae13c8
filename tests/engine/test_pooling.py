"""Pooling in the engine core, on tiny random Qwen3 checkpoints held to transformers (fp32): LAST, MEAN and CLS
pooling through chunked prefill, the classification head, the task rules, and a long pooled prompt prefilled
beside a generating stream without stalling it."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.pooling import PoolerConfig, PoolingParams, PoolingRequest, resolve_task, served_tasks
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams
from tests.tiny_checkpoints import save_tiny_classifier

PROMPTS = [[1, 5, 900, 3000, 42], list(range(100, 190)), [7]]  # the 90-token one spans several 32-token chunks


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    from transformers import AutoModelForSequenceClassification

    path = save_tiny_classifier(tmp_path_factory.mktemp("tiny") / "qwen3-cls")
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def _engine(path, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32,
                                  kv_cache_prefault=False, **options))


def _pool_all(engine: LLMEngine, params: PoolingParams, prompts=PROMPTS) -> list:
    for i, p in enumerate(prompts):
        engine.add_pooling_request(PoolingRequest(f"p{i}", TokensPrompt(p), params))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    assert all(done[f"p{i}"].finish_reason == "stop" for i in range(len(prompts)))
    return [torch.tensor(done[f"p{i}"].pooled) for i in range(len(prompts))]


def _hidden(hf, ids) -> torch.Tensor:
    with torch.inference_mode():
        return hf.model(torch.tensor([ids])).last_hidden_state[0]


@pytest.mark.slow  # the served form of this check runs by default (tests/test_pooling_models.py)
def test_classify_equals_transformers_logits(classifier):
    path, hf = classifier
    engine = _engine(path)  # --task auto: a *ForSequenceClassification checkpoint classifies
    assert engine.model_info.task == "classify" and engine.model_info.labels == ("negative", "neutral", "positive")
    raw = _pool_all(engine, PoolingParams("classify", activation=False))
    probs = _pool_all(engine, PoolingParams("classify"))
    for ids, logits, p in zip(PROMPTS, raw, probs):
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(p, ref.softmax(-1), atol=1e-5, rtol=1e-4)
    with pytest.raises(InvalidRequestError, match="embed"):  # no embeddings from a classifier (as vLLM)
        engine.check_pooling(PoolingParams("embed"))


@pytest.mark.parametrize("kind", ["MEAN", pytest.param("LAST", marks=pytest.mark.slow),
                                  pytest.param("CLS", marks=pytest.mark.slow)])
def test_embedding_pooling_types_equal_transformers(classifier, kind):
    path, hf = classifier
    engine = _engine(path, task="embed", override_pooler_config=f'{{"pooling_type": "{kind}"}}')
    for ids, got in zip(PROMPTS, _pool_all(engine, PoolingParams("embed"))):
        h = _hidden(hf, ids)
        ref = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]
        torch.testing.assert_close(got, torch.nn.functional.normalize(ref, dim=-1), atol=1e-5, rtol=1e-4)


def test_task_resolution():
    assert resolve_task("auto", ["Qwen3ForSequenceClassification"], True, "m") == "classify"
    assert resolve_task("auto", ["LlamaForCausalLM"], False, "m") == "generate"
    assert resolve_task("embedding", ["LlamaForCausalLM"], False, "m") == "embed"
    with pytest.raises(ValueError, match="needs a checkpoint with a sequence-classification head"):
        resolve_task("classify", ["LlamaForCausalLM"], False, "m")
    assert served_tasks("generate", 0) == ("embed", "encode", "score")
    assert served_tasks("classify", 3) == ("classify", "encode")  # scores need a one-label head
    assert served_tasks("score", 1) == ("classify", "encode", "score")
    assert PoolerConfig.parse('{"pooling_type": "mean", "normalize": false}') == PoolerConfig("MEAN", False, None)
    with pytest.raises(ValueError, match="pooling_kind"):
        PoolerConfig.parse('{"pooling_kind": "MEAN"}')


def test_task_rules_at_start(classifier, tmp_path):
    path, _ = classifier
    with pytest.raises(ValueError, match="transcription"):
        _engine(path, task="transcription")
    with pytest.raises(ValueError, match="pooling_type"):
        _engine(path, override_pooler_config='{"pooling_type": "MAX"}')


def test_a_long_pooled_prompt_does_not_stall_a_generating_stream(classifier):
    path, _ = classifier
    engine = _engine(path, task="embed")
    engine.add_request(GenerationRequest("g", TokensPrompt([1, 2, 3]), SamplingParams(max_tokens=40, temperature=0,
                                                                                     ignore_eos=True)))
    engine.step()  # the generating stream's prompt
    engine.add_pooling_request(PoolingRequest("long", TokensPrompt(list(range(200, 480))), PoolingParams("embed")))
    steps = stalled = 0
    pooled = None
    while pooled is None:
        outs = engine.step()
        steps += 1
        stalled += not any(o.new_token_ids for o in outs if o.request_id == "g")
        pooled = next((o for o in outs if o.request_id == "long"), None)
    assert steps >= 280 // 32  # chunked by --max-num-batched-tokens
    assert stalled == 0  # the stream got a token in every step the long prompt took
    assert pooled.finish_reason == "stop" and len(pooled.pooled) == 64
