"""Under a KV budget far below demand, every request still finishes (queued or preempted and
recomputed), with the same greedy output as without pressure, and no block stays in use."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams
from tests.engine.helpers import run_all, tokens_of

NUM_REQUESTS = 6
PROMPT_LEN = 60
OUTPUT_LEN = 12


def _requests() -> list[GenerationRequest]:
    return [GenerationRequest(f"m{i}",
                              TokensPrompt([1] + [300 + (i * 31 + j * 17) % 20000 for j in range(PROMPT_LEN - 1)]),
                              SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True))
            for i in range(NUM_REQUESTS)]


def test_requests_over_the_kv_budget_all_finish(llm_engine):
    context = PROMPT_LEN + OUTPUT_LEN
    blocks_for_three = 3 * -(-context // 16)  # room for 3 of the contexts at once
    tight = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=blocks_for_three, max_num_seqs=NUM_REQUESTS,
                                   max_num_batched_tokens=512, long_prefill_token_threshold=0))
    results = run_all(tight, _requests())
    assert tight.scheduler.num_preemptions > 0  # the budget really was exceeded
    for outs in results.values():
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == OUTPUT_LEN
    assert tight.block_manager.num_used_blocks == 0 and not tight.has_unfinished()
    # recomputation after preemption changes nothing: same tokens as an engine with room to spare
    roomy = run_all(llm_engine, _requests())
    for rid, outs in results.items():
        assert tokens_of(outs) == tokens_of(roomy[rid]), rid


@pytest.fixture(scope="module")
def tiny() -> LLMEngine:
    """A cache of 4 blocks: 64 tokens in all."""
    return LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=4))


def test_prompt_larger_than_the_whole_cache_is_refused(tiny):
    from engine.errors import PromptTooLongError

    with pytest.raises(PromptTooLongError):
        tiny.add_request(GenerationRequest("big", TokensPrompt([1] * 100), SamplingParams(max_tokens=4)))
    assert not tiny.has_unfinished() and tiny.block_manager.num_used_blocks == 0  # refused before taking room


def test_a_sequence_that_outgrows_the_whole_cache_ends_with_length(tiny):
    outs = run_all(tiny, [GenerationRequest("grow", TokensPrompt([1] + [500] * 39),
                                            SamplingParams(max_tokens=100, ignore_eos=True))])["grow"]
    assert outs[-1].finish_reason == "length"
    assert 40 + outs[-1].num_output_tokens <= 64 + 1
    assert tiny.block_manager.num_used_blocks == 0
