"""Stops, limits, seeds, aborts and cache release in the engine core."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams
from tests.engine.helpers import chat, run_all, text_of, tokens_of


def test_max_tokens_gives_length(llm_engine):
    outs = run_all(llm_engine, [chat("a", "Tell me a long story.", max_tokens=5, temperature=0, ignore_eos=True)])["a"]
    assert len(tokens_of(outs)) == 5 and outs[-1].finish_reason == "length"
    assert outs[-1].num_output_tokens == 5


def test_stop_string_is_cut_and_named(llm_engine):
    # 14 tokens: "1, 2, 3, 4, 5," - the stop ("4,") falls three tokens before the end
    base = text_of(run_all(llm_engine, [chat("b", "Count from 1 to 10, separated by commas.",
                                              max_tokens=14, temperature=0)])["b"])
    assert "4" in base
    stop = base[base.index("4"):base.index("4") + 2]
    assert len(base) > base.index(stop) + len(stop)  # text after the stop, which a cut must drop
    outs = run_all(llm_engine, [chat("c", "Count from 1 to 10, separated by commas.", max_tokens=14,
                                     temperature=0, stop=[stop])])["c"]
    assert text_of(outs) == base[: base.index(stop)]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    incl = run_all(llm_engine, [chat("d", "Count from 1 to 10, separated by commas.", max_tokens=14,
                                     temperature=0, stop=[stop], include_stop_str_in_output=True)])["d"]
    assert text_of(incl) == base[: base.index(stop) + len(stop)]


def test_stop_token_id(llm_engine):
    base = tokens_of(run_all(llm_engine, [chat("e", "Name some animals.", max_tokens=10, temperature=0)])["e"])
    outs = run_all(llm_engine, [chat("f", "Name some animals.", max_tokens=10, temperature=0,
                                     stop_token_ids=[base[3]])])["f"]
    assert tokens_of(outs) == base[: base.index(base[3]) + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == base[3]


def test_seeded_sample_is_the_same_alone_and_in_a_busy_batch(llm_engine):
    params = dict(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234)
    alone = tokens_of(run_all(llm_engine, [chat("s", "Invent a name for a cat.", **params)])["s"])
    busy = [chat(f"n{i}", f"Tell me fact number {i} about space.", max_tokens=14, temperature=1.0)
            for i in range(6)]
    together = run_all(llm_engine, busy[:3] + [chat("s", "Invent a name for a cat.", **params)] + busy[3:])
    assert tokens_of(together["s"]) == alone


def test_abort_frees_blocks_at_once(llm_engine):
    llm_engine.add_request(chat("x", "Write an essay.", max_tokens=200, ignore_eos=True))
    for _ in range(3):
        llm_engine.step()
    assert llm_engine.block_manager.num_used_blocks > 0
    (out,) = llm_engine.abort_request("x")
    assert out.finished and out.finish_reason == "abort"
    assert llm_engine.block_manager.num_used_blocks == 0 and not llm_engine.has_unfinished()
    assert llm_engine.abort_request("x") == []  # idempotent


def test_prompt_over_context_is_refused(llm_engine):
    with pytest.raises(PromptTooLongError):
        llm_engine.encode_prompt(TokensPrompt([5] * llm_engine.max_model_len))


def test_generation_stops_at_context_end(tmp_path):
    # a short context keeps this cheap (prefilling the model's whole 8,192 tokens took ~45 s here), and a
    # 2-layer model of the embedded one's family: where a context ends is the scheduler's, not the weights'
    from tests.tiny_checkpoints import save_tiny_llama

    short = LLMEngine(EngineConfig(model=str(save_tiny_llama(tmp_path / "tiny")), dtype="float32",
                                   max_model_len=160, num_kv_blocks=16))
    n = short.max_model_len - 3
    outs = run_all(short, [GenerationRequest("ctx", TokensPrompt([1] + [28] * (n - 1)),
                                             SamplingParams(max_tokens=50, ignore_eos=True))])["ctx"]
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 3
    with pytest.raises(PromptTooLongError):
        short.encode_prompt(TokensPrompt([1] * short.max_model_len))


def test_bad_token_ids_are_refused(llm_engine):
    with pytest.raises(InvalidRequestError) as err:
        llm_engine.encode_prompt(TokensPrompt([1, 10**9]))
    assert err.value.parameter == "prompt_token_ids"


def test_duplicate_request_id_is_refused(llm_engine):
    llm_engine.add_request(chat("dup", "Hi", max_tokens=2))
    with pytest.raises(InvalidRequestError):
        llm_engine.add_request(chat("dup", "Hi", max_tokens=2))
    llm_engine.abort_request("dup")


def test_n_samples_share_the_prompt_cache(llm_engine):
    from tests.engine.helpers import by_index

    prompt = "Describe a sunrise over the mountains in detail. " * 4
    outs = run_all(llm_engine, [chat("multi", prompt, max_tokens=8, temperature=1.0, seed=7, n=3)])["multi"]
    finals = [o for o in outs if o.finished]
    assert sorted(o.index for o in finals) == [0, 1, 2]
    cached = {o.index: o.num_cached_tokens for o in finals}
    block = llm_engine.block_manager.block_size
    for sibling in (1, 2):  # every full block of the prompt comes from the first sample's KV
        assert cached[sibling] > cached[0]
        assert cached[sibling] >= finals[0].num_prompt_tokens - block
    samples = [tokens_of(by_index(outs, i)) for i in range(3)]
    assert len({tuple(s) for s in samples}) > 1  # different samples
    again = run_all(llm_engine, [chat("multi", prompt, max_tokens=8, temperature=1.0, seed=7, n=3)])["multi"]
    assert [tokens_of(by_index(again, i)) for i in range(3)] == samples  # reproducible per sample
    assert llm_engine.block_manager.num_used_blocks == 0


def test_priority_orders_admission(llm_engine):
    sched = llm_engine.scheduler
    old = sched.max_num_seqs
    sched.max_num_seqs = 1
    try:
        low = chat("low", "Hi", max_tokens=3, temperature=0)
        low.priority = 5
        high = chat("high", "Hi", max_tokens=3, temperature=0)
        high.priority = 1
        order = []
        llm_engine.add_request(low)
        llm_engine.add_request(high)
        while llm_engine.has_unfinished():
            for out in llm_engine.step():
                if out.finished:
                    order.append(out.request_id)
    finally:
        sched.max_num_seqs = old
    assert order == ["high", "low"]  # 1 is the most urgent, whatever the arrival order


def test_the_long_prompt_cap_weighs_attention_by_the_models_sizes(llm_engine):
    """SmolLM2-135M: per key, 2 x 9 heads x 64 dims of attention against 3.54M projection weights a layer."""
    assert llm_engine.scheduler.attention_cost_per_key == pytest.approx(1 / 3072, rel=0.01)


def test_a_decoding_streams_cost_per_key_comes_from_the_rates_measured_at_start(llm_engine):
    """A key of a decoding stream's context costs its K and V bytes (30 layers x 2 x 3 heads x 64 x 2 bytes)
    at a share of the weights' measured stream rate, against a token's 106M multiply-adds at the measured
    batch rate; where the kernels ran, both rates are this machine's, and the cost lands within reason."""
    from engine.models.llama import KV_READ_SHARE, MAX_DECODE_COST_PER_KEY

    model = llm_engine.model
    rates = model.builder.rates
    assert model.decode_costs_measured == (rates is not None)
    k = llm_engine.scheduler.decode_cost_per_key
    if rates is None:  # torch's path: the default figures
        from engine.models.llama import DEFAULT_DECODE_COST_PER_KEY, DEFAULT_DECODE_STEP_COST
        assert k == DEFAULT_DECODE_COST_PER_KEY
        assert llm_engine.scheduler.decode_step_cost == DEFAULT_DECODE_STEP_COST
        return
    assert model.kv_bytes_per_token() == 30 * 2 * 3 * 64 * 2
    macs = 30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576)
    key_seconds = model.kv_bytes_per_token() / (KV_READ_SHARE * rates.stream_bytes_per_s)
    expected = key_seconds / (macs / rates.batch_macs_per_s)
    assert k == pytest.approx(min(expected, MAX_DECODE_COST_PER_KEY))
    assert 1 / 10_000 < k <= MAX_DECODE_COST_PER_KEY
    # and a decode step's pass over the weights: their bytes at the stream rate, in tokens' linears
    step = llm_engine.scheduler.decode_step_cost
    assert step == pytest.approx(rates.weight_bytes / rates.stream_bytes_per_s / (macs / rates.batch_macs_per_s))
    assert rates.weight_bytes == sum(lin.packed.data.numel() for lin in model.builder.built if hasattr(lin, "packed"))
    assert 0.5 < step < 100
