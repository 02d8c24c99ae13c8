"""Request options the engine honours itself (vLLM's names): prompt_logprobs, allowed_token_ids,
truncate_prompt_tokens, the chat-template switches, --seed and --max-logprobs."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.request import ChatMessage, ChatPrompt, GenerationRequest, TextPrompt
from engine.sampling_params import SamplingParams
from tests.engine.helpers import run_all, text_of, tokens_of

TEXT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"


def test_prompt_logprobs_equal_transformers_across_prefill_chunks(tmp_path):
    # chunks of 8 tokens: the prompt's logprobs come from several steps, each position exactly once (the
    # fused forward, whose row gathering once skipped a permuted full set of rows). A 2-layer model of the
    # embedded one's family, read by the engine and by transformers: the gathering is checked, not the weights.
    from transformers import AutoModelForCausalLM

    from tests.tiny_checkpoints import save_tiny_llama

    model = save_tiny_llama(tmp_path / "tiny")
    hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", max_num_batched_tokens=8,
                                    kv_cache_space_gib=0.5))
    req = GenerationRequest("p", TextPrompt(TEXT), SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))
    outs = run_all(engine, [req])["p"]
    got = outs[0].prompt_logprobs
    ids = engine.encode_prompt(req.prompt)
    assert got[0] is None and len(got) == len(ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].log_softmax(-1)
    for pos, entry in enumerate(got[1:]):
        assert entry.token_id == ids[pos + 1]
        assert abs(entry.logprob - ref[pos, ids[pos + 1]].item()) < 1e-3
        top_ids = ref[pos].topk(3).indices.tolist()
        assert [t for t, _ in entry.top] == top_ids
    assert all(o.prompt_logprobs is None for o in outs[1:])  # once, on the first output


def test_allowed_token_ids_are_the_only_ones_sampled(llm_engine):
    allowed = llm_engine.tokenizer.encode(" yes no maybe", add_special_tokens=False)
    req = GenerationRequest("a", TextPrompt(TEXT), SamplingParams(max_tokens=6, temperature=1.0, seed=3,
                                                                  allowed_token_ids=allowed))
    assert set(tokens_of(run_all(llm_engine, [req])["a"])) <= set(allowed)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm_engine):
    ids = llm_engine.encode_prompt(TextPrompt(TEXT))
    full = GenerationRequest("f", TextPrompt(TEXT), SamplingParams(max_tokens=1, truncate_prompt_tokens=5))
    out = run_all(llm_engine, [full])["f"]
    assert out[0].num_prompt_tokens == 5
    assert llm_engine.encode_prompt(TextPrompt(TEXT), truncate=5) == ids[-5:]


def test_continue_final_message_and_add_generation_prompt(llm_engine):
    messages = [ChatMessage("user", "Name a colour."), ChatMessage("assistant", "My favourite colour is")]
    open_turn = llm_engine.render_chat(ChatPrompt(messages, add_generation_prompt=False, continue_final_message=True))
    assert open_turn.endswith("My favourite colour is")
    closed = llm_engine.render_chat(ChatPrompt(messages[:1], add_generation_prompt=False))
    assert not closed.rstrip().endswith("assistant")
    with pytest.raises(InvalidRequestError, match="continue_final_message"):
        llm_engine.render_chat(ChatPrompt(messages, add_generation_prompt=True, continue_final_message=True))


def test_a_request_chat_template_replaces_the_models(llm_engine):
    template = "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{% endfor %}"
    text = llm_engine.render_chat(ChatPrompt([ChatMessage("user", "hi")], chat_template=template,
                                             add_generation_prompt=False))
    assert text == "<<user>>hi"
    with pytest.raises(InvalidRequestError) as err:
        llm_engine.render_chat(ChatPrompt([ChatMessage("user", "hi")], chat_template="{% if %}"))
    assert err.value.parameter == "chat_template"


def test_seed_flag_makes_unseeded_requests_reproducible(tmp_path):
    # two engine starts on a 2-layer model of the embedded one's family: the seeding is the engine's, and
    # its near-flat random logits make an unseeded repeat differ all the more surely
    from tests.tiny_checkpoints import save_tiny_llama

    model = str(save_tiny_llama(tmp_path / "tiny"))

    def sampled(seed):
        engine = LLMEngine(EngineConfig(model=model, dtype="float32", seed=seed, native_kernels=False,
                                        kv_cache_space_gib=0.5))
        reqs = [GenerationRequest(f"s{i}", TextPrompt(TEXT), SamplingParams(max_tokens=8, temperature=1.0))
                for i in range(2)]
        outs = run_all(engine, reqs)
        return [text_of(outs[r.request_id]) for r in reqs]

    assert sampled(7) == sampled(7)


def test_max_logprobs_bounds_what_a_request_may_ask(llm_engine):
    with pytest.raises(InvalidRequestError, match="max-logprobs") as err:
        llm_engine.check_params(SamplingParams(logprobs=True, top_logprobs=21))
    assert err.value.parameter == "top_logprobs"
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        llm_engine.check_params(SamplingParams(allowed_token_ids=[10**9]))


def test_the_models_recommended_sampling_is_read_from_its_directory(tmp_path):
    """The served model's generation_config.json recommendation reaches ModelInfo (the server applies it to
    the OpenAI-compatible endpoints: tests/protocol/test_generation_config.py); a file it cannot read leaves
    the model served, without a recommendation."""
    import json

    from tests.tiny_checkpoints import save_tiny_llama

    model = save_tiny_llama(tmp_path / "tiny")
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.6, "top_p": 0.9,
                                                              "top_k": 50}))
    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", kv_cache_space_gib=0.25))
    assert dict(engine.model_info.recommended_sampling) == {"temperature": 0.6, "top_p": 0.9, "top_k": 50}
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": "warm"}))
    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", kv_cache_space_gib=0.25))
    assert engine.model_info.recommended_sampling == ()
