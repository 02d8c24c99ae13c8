"""The engine's own module tree of each family (engine/models/layout.py) against transformers' model of the same
config: the same parameter names and shapes, the same tied head, the same RoPE tables, and a start that
imports none of transformers' model code."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.models import layout
from engine.models.skeleton import empty_model

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def _families():
    # imported by the tests that run: transformers' model classes bring torch's compiler stack with them
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config


def _config(name):
    LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config = _families()
    return {
        "llama": lambda: LlamaConfig(**SMALL),
        "llama-tied": lambda: LlamaConfig(**SMALL, tie_word_embeddings=True),
        "llama-biases": lambda: LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True),
        "llama3-rope": lambda: LlamaConfig(**SMALL, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
        "llama-linear-rope": lambda: LlamaConfig(**SMALL, rope_scaling={"type": "linear", "factor": 2.0}),
        "qwen2-yarn": lambda: Qwen2Config(**SMALL, rope_scaling=YARN, tie_word_embeddings=True),
        "qwen3": lambda: Qwen3Config(**SMALL, head_dim=32),
        "qwen3-biases": lambda: Qwen3Config(**SMALL, head_dim=32, attention_bias=True),
        "mistral": lambda: MistralConfig(**SMALL, sliding_window=None, head_dim=24),
    }[name]()


CONFIGS = ("llama", "llama-tied", "llama-biases", "llama3-rope", "llama-linear-rope", "qwen2-yarn", "qwen3",
           "qwen3-biases", "mistral")


def _transformers_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_tree_has_transformers_parameters_and_rope_tables(name):
    config = _config(name)
    assert layout.lays_out(config)
    ours, theirs = layout.empty_causal_lm(config, torch.bfloat16), _transformers_model(config)

    def shapes(model):
        return {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters(remove_duplicate=False)}

    assert shapes(ours) == shapes(theirs)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == bool(config.tie_word_embeddings)
    assert all(p.is_meta for p in ours.parameters())

    rotary = type(theirs.model.rotary_emb)(config=config, device="cpu")
    positions = torch.arange(config.max_position_embeddings)[None]
    for dtype in (torch.float32, torch.bfloat16):
        probe = torch.zeros(1, dtype=dtype)
        for a, b in zip(ours.model.rotary_emb(probe, positions), rotary(probe, positions)):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_sequence_dependent_rope_keeps_transformers_model():
    config = _families()[0](**SMALL, rope_scaling={"type": "dynamic", "factor": 2.0})
    assert not layout.lays_out(config)
    with pytest.raises(ValueError, match="dynamic"):
        layout.empty_causal_lm(config, torch.float32)
    model = empty_model(config, torch.float32)  # transformers' class, whose forward rescales per length
    assert type(model).__module__.startswith("transformers.")


def test_serving_a_model_imports_no_model_code_of_transformers(tmp_path):
    """Starting the engine on the embedded model leaves transformers' generation utilities (and with them
    torch's compiler stack) unimported."""
    script = (
        "import sys\n"
        "from engine.config import EngineConfig\n"
        "from engine.llm_engine import LLMEngine\n"
        "engine = LLMEngine(EngineConfig(kv_cache_space_gib=0.05, kv_cache_prefault=False))\n"
        "engine.warm_grammars()\n"
        "loaded = [m for m in ('transformers.generation.utils', 'torch._dynamo', 'transformers.modeling_utils')"
        " if m in sys.modules]\n"
        "engine.close_grammars()\n"
        "print('LOADED', loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "LOADED []" in out.stdout, out.stdout
