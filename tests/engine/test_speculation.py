"""Prompt-lookup speculation: drafts from earlier n-gram matches, verified in one step, the same answer.

The real model answers: a greedy answer that copies from its prompt comes in fewer steps than tokens, and it
equals the answer without speculation token for token (past a genuine near-tie the two may part: both are
then equally right, as in test_quantized_forward). Stops, max_tokens and min_tokens hold inside a step's
several tokens; requests whose pick reads more than the argmax get no draft.
"""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams
from engine.speculation import NgramIndex, NgramProposer, accepted_prefix
from tests.engine.helpers import chat, run_all, text_of, tokens_of

COPY = ("Copy this text exactly, word for word:\n\nThe old lighthouse keeper climbed the spiral stairs every evening "
        "to polish the brass lamp. A sudden storm forced the fishing boats back to the harbor before noon. Bees "
        "communicate the direction of flowers to their hive mates with a waggle dance.")
PROMPTS = [
    COPY,
    "Here is a list: apples, pears, plums, cherries, apricots, peaches. Repeat the list three times.",
    "def add(a, b):\n    return a + b\n\nRewrite this Python function with type hints and a docstring.",
    "What is the capital of France?",
]


# --- the proposer ---------------------------------------------------------------------------------------

def test_the_index_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_tail():
    index = NgramIndex(2, 4)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # the tail (2, 3) last occurred at 5-6 (then 7, 8, ...); (5, 2, 3) never did before
    assert index.lookup(tokens, 3) == [7, 8, 5]
    tokens += [7]  # tail (2, 3, 7): occurred at 5-7
    assert index.lookup(tokens, 2) == [8, 5]
    # the longest match wins over a later shorter one
    index = NgramIndex(1, 3)
    assert index.lookup([4, 5, 6, 1, 9, 6, 2, 4, 5, 6], 1) == [1]  # (4, 5, 6) at 0-2, not (6) at 5
    assert index.lookup([1, 2, 3, 4], 2) == []  # nothing repeats
    assert NgramIndex(2, 4).lookup([5, 5], 4) == []  # a tail never matches itself


def test_the_index_catches_up_as_the_list_grows_and_restarts_when_it_is_cut_back():
    index = NgramIndex(2, 2)
    tokens = [1, 2, 3]
    assert index.lookup(tokens, 2) == []
    tokens += [1, 2]
    assert index.lookup(tokens, 2) == [3, 1]
    assert index.lookup([7, 8, 7, 8], 1) == [7]  # a shorter, different list: indexed afresh


def test_a_draft_leaves_room_for_the_models_own_pick_and_never_straddles_min_tokens(llm_engine):
    proposer = NgramProposer(5, 2, 4)
    ids = [11, 12, 13, 14, 11, 12]

    def seq_with(max_tokens: int, min_tokens: int, outputs: int):
        request = GenerationRequest("r", TokensPrompt(ids), SamplingParams(max_tokens=max_tokens,
                                                                             min_tokens=min_tokens, temperature=0))
        llm_engine.add_request(request)
        seq = llm_engine.requests["r"][0]
        llm_engine.abort_request("r")
        seq.token_ids += [13] * outputs
        return seq

    assert proposer.room(seq_with(100, 0, 0)) == 5
    assert proposer.room(seq_with(3, 0, 0)) == 2  # 2 drafts + the pick after them = max_tokens
    assert proposer.room(seq_with(3, 0, 2)) == 0  # one token left: no draft
    assert proposer.room(seq_with(100, 4, 1)) == 2  # outputs 2 and 3 still before min_tokens; 4 may stop
    assert proposer.room(seq_with(100, 4, 4)) == 5
    assert accepted_prefix([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accepted_prefix([5, 6], [1, 6, 7]) == 0
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 4, 2)


# --- the real model ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    """The engine's defaults (the embedded GGUF's blocks on the fused kernels where the CPU has them)."""
    return LLMEngine(EngineConfig(max_num_seqs=8, kv_cache_space_gib=0.5))


def _answers(engine: LLMEngine, speculate: bool, **params) -> dict:
    proposer = engine.speculator
    assert proposer is not None  # on by default
    if not speculate:
        engine.speculator = None
    try:
        return {i: run_all(engine, [chat("p", p, temperature=0, **params)])["p"] for i, p in enumerate(PROMPTS)}
    finally:
        engine.speculator = proposer


def _top_logprobs_after(engine: LLMEngine, prompt: str, answer: list[int]) -> dict[int, float]:
    ids = engine.encode_prompt(chat("x", prompt).prompt) + answer
    request = GenerationRequest("gap", TokensPrompt(ids), SamplingParams(max_tokens=1, temperature=0, logprobs=True,
                                                                         top_logprobs=5))
    out = run_all(engine, [request])["gap"]
    assert out[0].logprobs is not None  # asked for
    return dict(out[0].logprobs[0].top)


def test_copied_answers_come_in_fewer_steps_and_equal_the_answers_without_speculation(engine):
    before = engine.speculator.num_accepted
    fast = _answers(engine, True, max_tokens=48)
    accepted = engine.speculator.num_accepted - before
    slow = _answers(engine, False, max_tokens=48)
    copy = fast[0]
    assert len(tokens_of(copy)) > 2 * len(copy)  # several tokens a step where the answer copies its prompt
    assert accepted >= len(tokens_of(copy)) // 2
    assert all(len(o.new_token_ids) == 1 for o in slow[0])
    identical = 0
    for i, prompt in enumerate(PROMPTS):
        a, b = tokens_of(fast[i]), tokens_of(slow[i])
        if a == b:
            assert text_of(fast[i]) == text_of(slow[i])
            identical += 1
            continue
        # parted: only at a near-tie, each path's token among the top candidates and < 0.25 nat apart
        at = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        top = _top_logprobs_after(engine, prompt, a[:at])
        assert a[at] in top and b[at] in top, (prompt, at, top)
        assert abs(top[a[at]] - top[b[at]]) < 0.25, (prompt, at, top)
    assert identical >= len(PROMPTS) // 2  # near-ties are rare; which prompts meet one moves with the CPU


def test_confirmed_draft_positions_count_as_computed_and_their_blocks_reach_the_prefix_cache(engine):
    """After every step a speculating sequence has exactly its newest token left to compute (nothing is
    computed twice), and its full blocks, draft positions included, are registered for reuse."""
    engine.add_request(chat("c", COPY, max_tokens=40, temperature=0))
    seq = engine.requests["c"][0]
    steps = tokens = 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        tokens += sum(len(o.new_token_ids) for o in outs)
        if seq.num_output_tokens and not any(o.finished for o in outs):
            assert seq.num_computed_tokens == len(seq.token_ids) - 1
            full = seq.num_computed_tokens // engine.block_manager.block_size
            assert all(engine.block_manager.block_hash[b] is not None for b in seq.block_table[:full])
    assert tokens == 40 and steps < 30


def test_a_stop_string_inside_a_steps_tokens_ends_the_answer_where_it_does_without_speculation(engine):
    stop = "brass lamp"
    fast = _answers(engine, True, max_tokens=48, stop=[stop])[0]
    slow = _answers(engine, False, max_tokens=48, stop=[stop])[0]
    assert text_of(fast) == text_of(slow)
    assert text_of(fast).endswith("polish the ") and fast[-1].finish_reason == "stop" and fast[-1].stop_reason == stop
    assert len(fast) < len(slow)


@pytest.mark.parametrize("max_tokens", [7, 20, 33])
def test_max_tokens_and_min_tokens_hold_exactly(engine, max_tokens):
    outs = _answers(engine, True, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)[0]
    assert len(tokens_of(outs)) == max_tokens == outs[-1].num_output_tokens
    assert outs[-1].finish_reason == "length"


def test_requests_whose_pick_reads_more_than_the_logits_get_no_draft(engine):
    before = engine.speculator.num_drafted
    for params in ({"temperature": 0, "logprobs": True}, {"temperature": 0, "repetition_penalty": 1.2},
                   {"temperature": 0.7, "seed": 1, "logprobs": True}, {"temperature": 0, "frequency_penalty": 0.5},
                   {"temperature": 0.7, "seed": 1, "presence_penalty": 0.5}):
        run_all(engine, [chat("p", COPY, max_tokens=24, **params)])
    assert engine.speculator.num_drafted == before
    run_all(engine, [chat("p", COPY, max_tokens=24, temperature=0)])
    assert engine.speculator.num_drafted > before


def test_the_batch_shares_steps_with_speculating_sequences(engine):
    """Drafting and plain rows in one batch: each answer equals the one it gets alone (same engine)."""
    alone = {i: tokens_of(run_all(engine, [chat("p", p, max_tokens=32, temperature=0)])["p"])
             for i, p in enumerate(PROMPTS)}
    together = run_all(engine, [chat(f"p{i}", p, max_tokens=32, temperature=0 if i % 2 == 0 else 0.8, seed=i)
                                for i, p in enumerate(PROMPTS)])
    for i in (0, 2):  # the greedy ones
        a, b = tokens_of(together[f"p{i}"]), alone[i]
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is not None:  # a near-tie only (see the test above)
            top = _top_logprobs_after(engine, PROMPTS[i], a[:at])
            assert a[at] in top and b[at] in top and abs(top[a[at]] - top[b[at]]) < 0.25, (i, at, top)
    assert all(len(tokens_of(together[f"p{i}"])) > 0 for i in (1, 3))


# --- sampled requests ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exact_engine() -> LLMEngine:
    """fp32 weights on torch's path: a row computes the same logits in a one-row step and beside draft rows,
    so speculation must leave a seeded sample exactly as it is (the fused kernels' bf16 rows differ by
    rounding with the step's row count, as for greedy answers above)."""
    return LLMEngine(EngineConfig(max_num_seqs=8, kv_cache_space_gib=0.5, native_kernels=False, dtype="float32",
                                  quantization="none", enable_prefix_caching=False))


SAMPLINGS = {"t0.7": {"temperature": 0.7}, "t1-p0.9-k40": {"temperature": 1.0, "top_p": 0.9, "top_k": 40}}


def test_a_seeded_sample_is_the_same_with_and_without_speculation(exact_engine):
    """Each row of a draft draws with the uniform plain decoding would take at its position, and the
    generator is left having drawn only for the tokens kept: the answer is plain sampling's, token for
    token, in fewer steps where drafts hold, for each sampling mode."""
    proposer = exact_engine.speculator
    # four seeds of each mode in one batch (the rows of this path compute alike in any step, which the test
    # relies on already): an eighth of the steps of one answer at a time. 16 tokens each: fp32 steps on
    # torch's path cost a full read of the weights whatever their rows, and the copied text is accepted
    # from its first tokens
    def requests() -> list[GenerationRequest]:
        return [chat(f"{mode}/s{seed}", COPY, max_tokens=16, seed=seed, **sampling)
                for mode, sampling in SAMPLINGS.items() for seed in range(4)]

    before = proposer.num_accepted
    fast = run_all(exact_engine, requests())
    accepted = proposer.num_accepted - before
    exact_engine.speculator = None
    try:
        slow = run_all(exact_engine, requests())
    finally:
        exact_engine.speculator = proposer
    assert accepted > 0
    for mode in SAMPLINGS:
        names = [f"{mode}/s{seed}" for seed in range(4)]
        for name in names:
            assert tokens_of(fast[name]) == tokens_of(slow[name]), name
        steps_fast, steps_slow = sum(len(fast[n]) for n in names), sum(len(slow[n]) for n in names)
        assert steps_fast < steps_slow, (mode, steps_fast, steps_slow)


def test_the_draft_policy_drafts_less_as_steps_fill_and_drafts_fail():
    """A draft token is worth its row while its chance of holding times what the step pays a token exceeds
    the row's cost: few streams (the weights' pass dominates) take whole drafts, many streams only drafts
    that mostly hold, and a sequence whose drafts keep failing stops drafting."""
    from types import SimpleNamespace

    from engine.speculation import AcceptanceTally, DraftPolicy

    policy = DraftPolicy()
    seq = SimpleNamespace(params=SamplingParams(temperature=0.7), draft_tally=AcceptanceTally())
    assert policy.length(seq, 5, step_cost=0.0, rows=32, row_cost=1.0) == 5  # no cost model: every draft
    alone = policy.length(seq, 5, step_cost=8.0, rows=1, row_cost=1.0)
    crowded = policy.length(seq, 5, step_cost=40.0, rows=32, row_cost=1.0)
    assert alone == 5 and crowded < alone
    for _ in range(20):  # drafts that held
        policy.record(seq, 5, 5)
    assert policy.length(seq, 5, step_cost=40.0, rows=32, row_cost=1.0) > crowded
    assert policy.length(seq, 5, step_cost=12.0, rows=4, row_cost=1.0) > 0
    for _ in range(500):  # then drafts that fail at once
        policy.record(seq, 5, 0)
    assert policy.length(seq, 5, step_cost=12.0, rows=4, row_cost=1.0) == 0
    fresh = SimpleNamespace(params=SamplingParams(temperature=0.7), draft_tally=AcceptanceTally())
    greedy = SimpleNamespace(params=SamplingParams(temperature=0), draft_tally=AcceptanceTally())
    # the server's sampled drafts failed: a new sampled sequence starts from that, a greedy one does not
    assert policy.length(fresh, 5, 12.0, 4, 1.0) < policy.length(greedy, 5, 12.0, 4, 1.0)


def _chi_square_p(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square test that two lists of tokens come from one distribution (categories with
    fewer than 10 draws in both lists pooled into one): the p-value."""
    from collections import Counter

    import torch

    ca, cb = Counter(a), Counter(b)
    common = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= 10]
    rows = [[ca[t], cb[t]] for t in common]
    rest = [len(a) - sum(r[0] for r in rows), len(b) - sum(r[1] for r in rows)]
    if sum(rest):
        rows.append(rest)
    table = torch.tensor(rows, dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    dof = max(len(rows) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


@pytest.mark.slow
def test_sampled_speculation_draws_from_plain_samplings_distribution(monkeypatch):
    """Thousands of sampled answers with and without speculation, on the fused kernels (where a draft row's
    logits differ from a lone row's by rounding): each position's token has the same distribution (a
    chi-square test per position), and drafts held often enough to matter. Every draft is taken (the
    policy would drop most of them in steps this crowded)."""
    engine = LLMEngine(EngineConfig(max_num_seqs=64, kv_cache_space_gib=1.0))
    proposer = engine.speculator
    monkeypatch.setattr(proposer.policy, "length", lambda seq, room, *costs: room)
    draws, positions = 1500, (6, 9, 12)

    def answers(speculate: bool) -> list[list[int]]:
        engine.speculator = proposer if speculate else None
        outs: dict = {}
        for first in range(0, draws, 500):  # within the engine's wait queue
            outs |= run_all(engine, [chat(f"r{i}", COPY, max_tokens=positions[-1] + 1, temperature=1.0, seed=i,
                                          ignore_eos=True) for i in range(first, min(first + 500, draws))])
        return [tokens_of(outs[f"r{i}"]) for i in range(draws)]

    before = proposer.num_accepted
    fast = answers(True)
    assert proposer.num_accepted - before > draws  # drafts held: the check compares speculating answers
    slow = answers(False)
    for pos in positions:
        p = _chi_square_p([t[pos] for t in fast], [t[pos] for t in slow])
        assert p > 1e-3, (pos, p)
