from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


@pytest.fixture(scope="session")
def llm_engine() -> LLMEngine:
    """A synchronous engine core (fp32) the tests drive step by step."""
    return LLMEngine(EngineConfig(dtype="float32", max_num_seqs=32, max_num_batched_tokens=256, kv_cache_space_gib=0.5))


@pytest.fixture(scope="session")
def hf_model(llm_engine):
    from transformers import AutoModelForCausalLM

    from engine.model_loader import resolve_model_dir

    # the engine reads the GGUF file in place; the reference is transformers' own conversion of it
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(llm_engine.config.model), dtype="float32")
    model.eval()
    return model
