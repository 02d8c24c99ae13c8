"""Sampling-parameter validation, incremental detokenization, stop matching, block accounting."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.cost_model import CostModel
from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.errors import InvalidRequestError
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams
from engine.scheduler import LONG_PREFILL_SHARE, Scheduler
from engine.sequence import Sequence


@pytest.mark.parametrize("kwargs, parameter", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
    (dict(top_k=-5), "top_k"), (dict(min_p=2), "min_p"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(n=0), "n"), (dict(stop=[""]), "stop"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"), (dict(top_logprobs=-1), "top_logprobs"),
])
def test_sampling_params_name_the_bad_parameter(kwargs, parameter):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.parameter == parameter and parameter in str(err.value)


def test_incremental_detokenizer_never_splits_a_character(llm_engine):
    tok = llm_engine.tokenizer
    text = "你好，世界！🌏 Ünïcödé ok"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    deltas = [detok.add_tokens([t]) for t in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenizer_backend_decode_equals_the_tokenizers(llm_engine, skip_special_tokens):
    """The Rust decode the detokenizer calls directly gives what transformers' decode gives: special
    tokens kept or skipped, partial UTF-8, leading spaces."""
    tok = llm_engine.tokenizer
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip_special_tokens)
    assert detok._backend_decode is not None  # the embedded model's tokenizer takes the direct path
    chat_ids = tok.apply_chat_template([{"role": "user", "content": " héllo  wörld 你好🌏"}], tokenize=True)
    ids = list(chat_ids["input_ids"] if isinstance(chat_ids, dict) else chat_ids)
    for cut in range(0, len(ids), 3):
        part = ids[cut:cut + 7]
        assert detok._decode(part) == tok.decode(part, skip_special_tokens=skip_special_tokens,
                                                 clean_up_tokenization_spaces=False)
    slow = IncrementalDetokenizer(tok, [], skip_special_tokens=skip_special_tokens,
                                  spaces_between_special_tokens=False)
    assert slow._backend_decode is None  # an option the backend does not take: the wrapper decodes


def test_stop_matcher_holds_back_partial_stops():
    m = StopStringMatcher(["STOP"], include_stop=False)
    assert m.feed("hello S") == ("hello ", None)
    assert m.feed("T") == ("", None)
    assert m.feed("x") == ("STx", None)
    assert m.feed(" ST") == (" ", None)
    assert m.feed("OP and more") == ("", "STOP")


def test_stop_matcher_earliest_stop_wins_and_include():
    m = StopStringMatcher(["b", "abc"], include_stop=True)
    assert m.feed("xxabcd") == ("xxabc", "abc")  # "abc" starts before "b"
    m = StopStringMatcher(["c", "ab"], include_stop=False)
    assert m.feed("xxabcd") == ("xx", "ab")


def _seq(tokens, salt=""):
    class _Detok:
        pass
    return Sequence(GenerationRequest("r", TokensPrompt(tokens), SamplingParams(max_tokens=4)), tokens,
                    _Detok(), 1000, cache_salt=salt)


@pytest.mark.parametrize("by_role", [True, False], ids=["kv-follows-row-role", "default"])
def test_block_manager_keys_an_answers_blocks_by_their_rows_role(by_role):
    """Where a row's KV follows its role (int8-prompt), an answer's blocks serve only a sequence that computes
    those positions the same way (its own recompute), never a later prompt holding the answer's tokens."""
    bm = BlockManager(num_blocks=8, block_size=4, kv_follows_row_role=by_role)
    a = _seq(list(range(6)))  # a 6-token prompt, then 8 tokens of answer
    a.token_ids += list(range(6, 14))
    bm.append_slots(a, 14)
    a.num_computed_tokens = 14
    bm.commit_full_blocks(a, 0)
    next_turn = _seq(list(range(14)) + [99])
    bm.allocate_cached_prefix(next_turn)
    assert next_turn.num_cached_tokens == (4 if by_role else 12)  # by role: the prompt's first block alone
    bm.free(next_turn)
    bm.free(a)
    a.block_table, a.num_computed_tokens = [], 0
    bm.allocate_cached_prefix(a)  # a recompute after a preemption revives its own blocks
    assert a.num_cached_tokens == 12
    first_block_only = _seq(list(range(6)))  # the same prompt: its first block is all prompt rows
    bm.allocate_cached_prefix(first_block_only)
    assert first_block_only.num_cached_tokens == 4


def test_block_manager_prefix_reuse_and_release():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq(list(range(10)))
    bm.allocate_cached_prefix(a)
    assert a.num_cached_tokens == 0
    bm.append_slots(a, 10)
    a.num_computed_tokens = 10
    bm.commit_full_blocks(a, 0)
    assert bm.num_used_blocks == 3
    b = _seq(list(range(9)) + [99])
    bm.allocate_cached_prefix(b)
    assert b.num_cached_tokens == 8 and b.block_table == a.block_table[:2]
    other_adapter = _seq(list(range(10)), salt="lora-x")
    bm.allocate_cached_prefix(other_adapter)
    assert other_adapter.num_cached_tokens == 0  # KV of another adapter is never shared
    bm.free(a)
    bm.free(b)
    bm.free(other_adapter)
    assert bm.num_used_blocks == 0
    c = _seq(list(range(10)))
    bm.allocate_cached_prefix(c)  # revived from the free list
    assert c.num_cached_tokens == 8
    bm.free(c)
    assert bm.num_free_blocks == 8


def _decoding(scheduler: Scheduler, n: int) -> None:
    """``n`` running sequences whose prompts are computed: each decodes one token a step."""
    for i in range(n):
        seq = _seq(list(range(i * 10, i * 10 + 8)))
        scheduler.block_manager.append_slots(seq, 8)
        seq.num_computed_tokens = 8
        seq.append_token(1)
        scheduler.running.append(seq)


def test_the_long_prompt_cap_grows_with_the_square_of_the_long_prompts_waiting():
    """Among 8 decoding streams one long prompt is trickled (LONG_PREFILL_SHARE x 8 rows' worth a step, the
    running streams' gaps stay even); two waiting get four times that and three nine times, and a longer
    queue the whole step beside the decodes, so a queue's wait does not pile up."""
    one = LONG_PREFILL_SHARE * 8
    for waiting, expected in ((1, int(one)), (2, int(4 * one)), (3, int(9 * one)), (6, 256 - 8)):
        scheduler = Scheduler(BlockManager(num_blocks=512, block_size=16), max_num_seqs=64,
                              max_num_batched_tokens=256, long_prefill_token_threshold=4)
        _decoding(scheduler, 8)
        for i in range(waiting):
            scheduler.add(_seq(list(range(1000 + 300 * i, 1000 + 300 * i + 200))))  # long: over 256 / 2
        batch = scheduler.schedule()
        assert len(batch.decodes) == 8
        assert sum(n for _, n in batch.prefills) == expected


def test_a_short_prompt_arriving_during_a_long_prefill_starts_at_the_next_step():
    """With nothing decoding, a long prompt's prefill takes the whole step budget. A short prompt arriving
    meanwhile does not wait for all its chunks: the cap comes on for it as for a stream, the step prefills it
    whole beside the long prompt's capped chunk, and the long prompt goes on (at full chunks again once
    nothing short waits and nothing decodes). Where it could not start (no free slot, no room in the cache,
    or a long prompt queued ahead of it), nothing changes: the long prompt's chunk is what the budget and
    the cache allow."""
    for slots, blocks, starts, whole, ahead in ((4, 512, True, 256, 0), (1, 512, False, 256, 0),
                                               (4, 18, False, 32, 0), (4, 512, False, 256, 1)):
        scheduler = Scheduler(BlockManager(num_blocks=blocks, block_size=16), max_num_seqs=slots,
                              max_num_batched_tokens=256, long_prefill_token_threshold=4,
                              cost_model=CostModel(decode_step_cost=7.0))
        long = _seq(list(range(1000, 3000)))  # 2,000 tokens: eight steps' budget
        scheduler.add(long)
        batch = scheduler.schedule()
        assert batch.prefills == [(long, 256)]
        long.num_computed_tokens += 256
        if ahead:  # a long prompt queued before the short one: the queue waits for it whatever the cap
            scheduler.add(_seq(list(range(8000, 9000))))
        short = _seq(list(range(5000, 5040)))
        scheduler.add(short)
        batch = scheduler.schedule()
        chunks = dict((id(seq), n) for seq, n in batch.prefills)
        if starts:
            assert chunks == {id(short): 40, id(long): int(LONG_PREFILL_SHARE * 7.0)}
        else:
            # 18 blocks: 2 left after the long prompt's first chunk, and the short one needs 3
            assert chunks == {id(long): whole} and short in scheduler.waiting, (slots, blocks, ahead)


def test_the_long_prompt_cap_counts_each_decoding_streams_context():
    """A decode step costs its pass over the weights (decode_step_cost), and each decoding stream its row and
    its attention over its context (decode_cost_per_key of a token's linears per key), so beside streams
    deep into long contexts a long prompt gets a larger share: a step with it still costs about
    LONG_PREFILL_SHARE more than a decode-only one. Draft rows do not count; with no cost per key, every
    stream counts as one row wherever it is."""
    for per_key, context, drafts, step in ((0.0, 400, 0, 0.0), (1 / 100, 8, 0, 0.0), (1 / 100, 400, 0, 0.0),
                                           (1 / 100, 400, 3, 0.0), (1 / 100, 400, 0, 7.0)):
        scheduler = Scheduler(BlockManager(num_blocks=512, block_size=16), max_num_seqs=64,
                              max_num_batched_tokens=256, long_prefill_token_threshold=4,
                              cost_model=CostModel(decode_cost_per_key=per_key, decode_step_cost=step))
        _decoding(scheduler, 8)
        for seq in scheduler.running:
            seq.num_computed_tokens = context  # only the count is read; the token list stays short
            seq.token_ids[:] = list(range(context)) + [1]
            seq.draft_token_ids = list(range(drafts))
        scheduler.add(_seq(list(range(5000, 5200))))  # long: over 256 / 2
        batch = scheduler.schedule()
        assert len(batch.decodes) == 8
        assert sum(n for _, n in batch.prefills) == int(LONG_PREFILL_SHARE * (step + 8 * (1 + per_key * context)))


def test_the_long_prompt_cap_counts_each_decoding_row_at_its_own_cost():
    """Where decode rows run exact and prompt rows int8 (--linear-activations int8-prompt), a decoding row
    costs decode_row_cost prompt tokens, and the cap beside the streams grows with it."""
    for row in (1.0, 1.4):
        scheduler = Scheduler(BlockManager(num_blocks=512, block_size=16), max_num_seqs=64,
                              max_num_batched_tokens=256, long_prefill_token_threshold=4,
                              cost_model=CostModel(decode_step_cost=7.0, decode_row_cost=row))
        _decoding(scheduler, 8)
        scheduler.add(_seq(list(range(5000, 5200))))  # long: over 256 / 2
        batch = scheduler.schedule()
        assert len(batch.decodes) == 8
        assert sum(n for _, n in batch.prefills) == int(LONG_PREFILL_SHARE * (7.0 + 8 * row))


def test_the_long_prompt_cap_counts_each_chunks_attention():
    """Under the cap a chunk costs its tokens plus their attention over the keys before them (per key, a
    fraction of a token's linears, from the model's sizes): a long prompt's chunks shrink as its context
    grows, each the most that fits the cap, so a step costs about the same at the prompt's end as at its
    start. With no weight on attention every chunk is the cap's size."""
    cap = LONG_PREFILL_SHARE * 10  # 10 decoding streams, a row each
    for per_key in (0.0, 1 / 500):
        scheduler = Scheduler(BlockManager(num_blocks=512, block_size=16), max_num_seqs=64,
                              max_num_batched_tokens=256, long_prefill_token_threshold=4,
                              cost_model=CostModel(attention_cost_per_key=per_key))
        _decoding(scheduler, 10)
        long = _seq(list(range(1000, 1600)))  # 600 tokens: long (over 256 / 2)
        scheduler.add(long)
        chunks = []
        while long.num_computed_tokens < len(long.token_ids):
            batch = scheduler.schedule()
            streams = [seq for seq in batch.decodes if seq is not long]  # a 1-token last chunk runs as a decode
            assert len(streams) == 10
            for seq, n in batch.prefills + [(long, 1)] * (long in batch.decodes):
                chunks.append((seq.num_computed_tokens, n))
                seq.num_computed_tokens += n
            for seq in streams:
                seq.num_computed_tokens += 1
                seq.append_token(1)

        def cost(keys: int, n: int, per_key: float = per_key) -> float:
            return n * (1 + (keys + n) * per_key)

        sizes = [n for _, n in chunks]
        assert sum(sizes) == 600
        if per_key == 0:
            assert sizes[:-1] == [int(cap)] * (len(sizes) - 1)
        else:
            assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-2] > 0  # shrinking, never stalled
            for keys, n in chunks[:-1]:  # each the largest that fits (the last takes what is left)
                assert cost(keys, n) <= cap < cost(keys, n + 1)


def test_a_prompt_deep_into_a_long_context_still_moves_under_the_cap():
    """Where one token's attention alone costs more than the cap (40,000 keys at 1/500 a key), the chunk
    is the threshold's tokens, not none: the prompt is not starved while streams decode."""
    scheduler = Scheduler(BlockManager(num_blocks=512, block_size=16), max_num_seqs=64, max_num_batched_tokens=256,
                          long_prefill_token_threshold=4, cost_model=CostModel(attention_cost_per_key=1 / 500))
    seq = _seq(list(range(300)))
    seq.num_computed_tokens = 40_000  # as if deep into a long cached context (only the count is read)
    assert scheduler._prefill_limit(seq, 256, 16.0, capped=True) == 4
    assert scheduler._prefill_limit(seq, 256, 0.0, capped=True) == 0  # the step's cap is spent


def _cached_history(bm: BlockManager, tokens: list[int]) -> None:
    """An earlier turn of ``tokens``, computed and finished: its full blocks stay in the prefix cache."""
    earlier = _seq(tokens)
    bm.allocate_cached_prefix(earlier)
    bm.append_slots(earlier, len(tokens))
    earlier.num_computed_tokens = len(tokens)
    bm.commit_full_blocks(earlier, 0)
    bm.free(earlier)


@pytest.mark.parametrize("new_tokens, per_key, whole", [(40, 0.0, True), (40, 1 / 500, True), (120, 1 / 50, False),
                                                        (200, 0.0, False)],
                         ids=["short-tail", "short-tail-attention", "tail-dear-over-context", "long-tail"])
def test_a_next_turn_over_a_cached_history_does_not_wait_for_a_long_prompts_chunks(new_tokens, per_key, whole):
    """While streams decode, a long prompt's chunks take the step's prefill cap, and a waiting long prompt
    waits for them. A conversation's next turn is long by its length but its history is cached: where what
    it computes (its new tokens, attending over the whole context) costs no more than the longest short
    prompt, it is prefilled whole in the next step. A new message long in itself, or one whose attention
    over the context is dear, still waits; looking at the cache takes none of its blocks."""
    bm = BlockManager(num_blocks=512, block_size=16)
    scheduler = Scheduler(bm, max_num_seqs=64, max_num_batched_tokens=256, long_prefill_token_threshold=4,
                          cost_model=CostModel(attention_cost_per_key=per_key))
    history = list(range(20_000, 20_600))  # 600 tokens: long (over 256 / 2)
    _cached_history(bm, history)
    _decoding(scheduler, 8)
    scheduler.add(_seq(list(range(1000, 1600))))  # a long prompt, nothing of it cached
    first = scheduler.schedule()
    assert len(first.prefills) == 1 and first.prefills[0][1] < 600  # chunked under the cap
    turn = _seq(history + list(range(30_000, 30_000 + new_tokens)))
    scheduler.add(turn)
    history_blocks = list(bm._cached_blocks(turn))
    batch = scheduler.schedule()
    chunks = {id(seq): n for seq, n in batch.prefills}
    if whole:
        assert turn.num_cached_tokens == 592  # the history's 37 full blocks
        assert chunks.get(id(turn)) == len(turn.token_ids) - 592
        if per_key == 0:  # nor does it count as a second long prompt pending: the long one's share stays
            assert chunks[id(first.prefills[0][0])] == first.prefills[0][1]
    else:
        assert id(turn) not in chunks and turn in scheduler.waiting
        assert not turn.block_table and all(bm.ref_counts[b] == 0 for b in history_blocks)


async def test_a_failure_behind_unread_outputs_keeps_them():
    """A consumer that fell behind gets its pending outputs merged; a failure that arrives meanwhile must come
    after them, not swallow them (the bridges would then answer 500 instead of the text and an error event)."""
    import asyncio

    from engine.async_engine import RequestStream
    from engine.request import RequestOutput

    stream = RequestStream("client-id", asyncio.get_running_loop())
    stream.put(RequestOutput("r1", 0, [11], "Once", num_prompt_tokens=5, num_output_tokens=1, token_texts=["Once"]))
    stream.put(RequestOutput("r1", 0, [12], " upon", num_prompt_tokens=5, num_output_tokens=2, token_texts=[" upon"]))
    stream.put(RequestOutput("r1", 0, [], "", num_prompt_tokens=5, num_output_tokens=2, finished=True,
                             finish_reason="error", error="inference failed: boom", error_kind="inference"))
    stream.put(RequestOutput("r1", 1, [21], "A", num_prompt_tokens=5, num_output_tokens=1))  # another sample
    outs = await stream.get()
    assert [(o.index, o.new_token_ids, o.text_delta, o.finish_reason) for o in outs] == [
        (0, [11, 12], "Once upon", None), (0, [], "", "error"), (1, [21], "A", None)]
    assert outs[0].texts_per_token() == ["Once", " upon"]
    assert not stream.pending and not stream.event.is_set()
