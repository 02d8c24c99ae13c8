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

    model = AutoModelForCausalLM.from_pretrained(llm_engine.model_info.path, dtype="float32")
    model.eval()
    return model
