"""In bf16 (the CPU default where it is fast) greedy output tracks transformers' own bf16 forward.

Exact equality is not expected in bf16 (kernels round differently), but systematic drift is a bug:
a norm computed with other rounding than LlamaRMSNorm once turned 'Paris' into nonsense.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.engine.helpers import chat, run_all, text_of, tokens_of
from tests.engine.test_greedy_matches_transformers import PROMPTS

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def bf16_engine():
    return LLMEngine(EngineConfig(dtype="bfloat16"))


def test_bf16_greedy_tracks_transformers_bf16(bf16_engine):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(bf16_engine.model_info.path, dtype=torch.bfloat16).eval()
    prompts = PROMPTS + ["What is the capital of France?"]
    exact = agreed = total = 0
    for p in prompts:
        ids = bf16_engine.encode_prompt(chat("x", p).prompt)
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=2)[0, len(ids):].tolist()
        mine = tokens_of(run_all(bf16_engine, [chat("a", p, max_tokens=MAX_TOKENS, temperature=0)])["a"])
        same = next((i for i, (a, b) in enumerate(zip(ref, mine)) if a != b), min(len(ref), len(mine)))
        exact += ref[: len(mine)] == mine
        agreed += same
        total += len(mine)
    assert exact >= len(prompts) - 2, f"only {exact}/{len(prompts)} prompts equal transformers bf16"
    assert agreed / total >= 0.85, f"{agreed}/{total} tokens before divergence"


def test_bf16_answers_a_factual_question(bf16_engine):
    out = run_all(bf16_engine, [chat("f", "What is the capital of France?", max_tokens=12, temperature=0)])["f"]
    assert "Paris" in text_of(out)
