"""Greedy decoding equals transformers' generate token for token (fp32): alone, batched, prefix-cached."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import chat, run_all, tokens_of

PROMPTS = [
    "What is the capital of France?",
    "你是谁？",
    "Write a short poem about autumn leaves falling in a quiet park, with rhymes.",
    "请解释一下什么是机器学习，以及它在日常生活中的应用。",
    "2+2=",
    "Summarize the plot of Romeo and Juliet in two sentences. Mention the families, the secret marriage, "
    "the banishment, and the tragic ending in the tomb.",
    "北京和上海哪个城市人口更多？",
    "List three uses of copper.",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def references(llm_engine, hf_model):
    """transformers' greedy `generate` of every prompt, in one left-padded batch (the padding masked out and
    positions counted from each prompt's start): a batch-1 decode streams all the fp32 weights once per
    token, so one prompt at a time cost 8x the passes. fp32 rows agree across batch shapes (the batched
    tests below rely on that of the engine too), and answers cut at EOS, past which the batch pads."""
    prompts = [llm_engine.encode_prompt(chat("x", prompt).prompt) for prompt in PROMPTS]
    width = max(map(len, prompts))
    pad = 2
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=MAX_TOKENS, do_sample=False,
                                pad_token_id=pad)
    return {i: out[i, width:].tolist() for i in range(len(PROMPTS))}


def _strip_eos(tokens, eos):
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def _check(engine, results, references, count: int | None = None):
    for i in range(len(PROMPTS) if count is None else count):
        ref = _strip_eos(references[i], engine.eos_token_ids[0])
        assert tokens_of(results[f"p{i}"]) == ref, f"prompt {i}: {PROMPTS[i]!r}"


ALONE = 4  # two English and two Chinese prompts alone (batch size 1); the batched tests take all eight


def test_each_prompt_alone(llm_engine, references):
    llm_engine.block_manager.enable_prefix_caching = False
    try:
        results = {}
        for i, p in enumerate(PROMPTS[:ALONE]):
            results.update(run_all(llm_engine, [chat(f"p{i}", p, max_tokens=MAX_TOKENS, temperature=0)]))
    finally:
        llm_engine.block_manager.enable_prefix_caching = True
    _check(llm_engine, results, references, ALONE)


def test_all_prompts_in_one_batch(llm_engine, references):
    results = run_all(llm_engine, [chat(f"p{i}", p, max_tokens=MAX_TOKENS, temperature=0)
                                   for i, p in enumerate(PROMPTS)])
    _check(llm_engine, results, references)


def test_with_prefix_cache_warm(llm_engine, references):
    run_all(llm_engine, [chat(f"p{i}", p, max_tokens=2, temperature=0) for i, p in enumerate(PROMPTS)])
    results = run_all(llm_engine, [chat(f"p{i}", p, max_tokens=MAX_TOKENS, temperature=0)
                                   for i, p in enumerate(PROMPTS)])
    assert any(outs[-1].num_cached_tokens > 0 for outs in results.values())
    _check(llm_engine, results, references)
    assert llm_engine.block_manager.num_used_blocks == 0


def test_chunked_prefill_matches(llm_engine, references):
    sched = llm_engine.scheduler
    old = sched.max_num_batched_tokens
    sched.max_num_batched_tokens = 7  # forces every prompt through several chunks
    try:
        results = run_all(llm_engine, [chat(f"p{i}", p, max_tokens=MAX_TOKENS, temperature=0)
                                       for i, p in enumerate(PROMPTS)])
    finally:
        sched.max_num_batched_tokens = old
    _check(llm_engine, results, references)
