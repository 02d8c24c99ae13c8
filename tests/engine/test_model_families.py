"""The engine's own forward for each supported family equals transformers (fp32, greedy) on small
random models saved as local HF directories; other architectures are refused at start."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader import embedded_gguf_path, resolve_model_dir
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams
from tests.engine.helpers import run_all, tokens_of

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, vocab_size=49152, tie_word_embeddings=False)


def _save_tiny(tmp_path, llm_engine, config) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    out = tmp_path / f"{config.model_type}-{id(config)}"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = f"{llm_engine.model_info.path}/{name}"
        shutil.copy(src, out / name)
    return str(out)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama": LlamaConfig(**TINY),
        # Llama 3.x: rope_scaling of type llama3 (the RoPE tables come from the model's own rotary module)
        "llama3-rope": LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
        "qwen2": Qwen2Config(**TINY),  # q/k/v projections carry biases
        "qwen3": Qwen3Config(**TINY, head_dim=32),  # q/k RMSNorm per head; head_dim != hidden / heads
        "mistral": MistralConfig(**TINY, sliding_window=None),
    }


@pytest.mark.parametrize("family", ["llama", "llama3-rope", "qwen2", "qwen3", "mistral"])
def test_family_matches_transformers(tmp_path, llm_engine, family):
    from transformers import AutoModelForCausalLM

    config = _configs()[family]
    path = _save_tiny(tmp_path, llm_engine, config)
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", kv_cache_space_gib=0.5))
    assert engine.model_info.model_type == config.model_type
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[1, 5, 900, 3000, 42], [1] + list(range(100, 160)), [7] * 3]
    reqs = [GenerationRequest(f"{family}{i}", TokensPrompt(p), SamplingParams(max_tokens=12, temperature=0,
                                                                              ignore_eos=True))
            for i, p in enumerate(prompts)]
    results = run_all(engine, reqs)
    for req, p in zip(reqs, prompts):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
        assert tokens_of(results[req.request_id]) == ref[0, len(p):].tolist()


def test_other_architectures_are_refused_at_start(tmp_path, llm_engine):
    from transformers import GPT2Config

    path = _save_tiny(tmp_path, llm_engine, GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=49152))
    with pytest.raises(ValueError, match=r"gpt2.*not supported"):
        LLMEngine(EngineConfig(model=path, kv_cache_space_gib=0.5))


def test_a_gguf_path_and_a_missing_path():
    gguf = embedded_gguf_path()
    assert (resolve_model_dir(str(gguf)) / "model.safetensors").exists()  # converted (or cached) directory
    with pytest.raises(FileNotFoundError, match="no model hub"):
        resolve_model_dir("/nonexistent/model")
