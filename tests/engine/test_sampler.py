"""Each sampling parameter changes the choice the way its definition says (synthetic logits)."""

from __future__ import annotations

import math
from collections import Counter
from typing import cast

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.request import GenerationRequest, TokensPrompt
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

VOCAB = 8
EOS = 7


class _NoDetok:
    pass


def make_seq(prompt=(1, 2), outputs=(), seed=0, **params) -> Sequence:
    req = GenerationRequest("r", TokensPrompt(list(prompt)), SamplingParams(**params))
    seq = Sequence(req, list(prompt), cast(IncrementalDetokenizer, _NoDetok()), 1000, seed=seed)
    seq.token_ids.extend(outputs)
    return seq


def logits_of(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


BASE = (4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0)


def draws(n=400, logits=BASE, **params) -> Counter:
    seq = make_seq(seed=123, **params)
    counts: Counter = Counter()
    for _ in range(n):
        counts[sample(logits_of(*logits), [seq], [EOS])[0]] += 1
    return counts


def test_temperature_zero_is_argmax():
    assert set(draws(50, temperature=0.0)) == {0}


def test_higher_temperature_spreads_choices():
    cold = draws(temperature=0.3)
    hot = draws(temperature=2.0)
    assert cold[0] > hot[0] and len(hot) > len(cold)


def test_top_k_keeps_only_k_tokens():
    assert set(draws(top_k=2, temperature=1.5)) == {0, 1}


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor(BASE).softmax(-1)
    counts = draws(top_p=0.9, temperature=1.0)
    nucleus = {i for i in range(VOCAB) if probs[:i].sum() < 0.9}
    assert set(counts) <= nucleus and len(nucleus) < VOCAB


def test_top_p_applies_to_the_top_k_survivors_renormalised():
    """vLLM / HF order: top-k first, then the nucleus of what is left. Over the full vocabulary token
    1 would start below 0.66 of the mass (at 0.63) and survive; among the top 2 it starts at 0.73."""
    probs = torch.tensor(BASE).softmax(-1)
    assert probs[0] < 0.66 < probs[0] / (probs[0] + probs[1])
    assert set(draws(top_k=2, top_p=0.66, temperature=1.0)) == {0}
    assert set(draws(top_k=3, temperature=1.0)) == {0, 1, 2}  # and top-k alone keeps k


def test_min_p_drops_unlikely_tokens():
    probs = torch.tensor(BASE).softmax(-1)
    counts = draws(min_p=0.2, temperature=1.0)
    assert set(counts) <= {i for i in range(VOCAB) if probs[i] >= 0.2 * probs.max()}


def test_repetition_penalty_discourages_seen_tokens():
    seq = make_seq(prompt=(0,), temperature=0.0, repetition_penalty=3.0)
    assert sample(logits_of(*BASE), [seq], [EOS]) == [1]  # 4/3 < 3
    seq = make_seq(prompt=(0,), temperature=0.0, repetition_penalty=1.2)
    assert sample(logits_of(*BASE), [seq], [EOS]) == [0]  # 4/1.2 > 3


def test_presence_penalty_is_a_flat_cut_on_output_tokens():
    seq = make_seq(outputs=(0,), temperature=0.0, presence_penalty=1.5)
    assert sample(logits_of(*BASE), [seq], [EOS]) == [1]
    seq = make_seq(prompt=(0,), temperature=0.0, presence_penalty=1.5)  # prompt tokens do not count
    assert sample(logits_of(*BASE), [seq], [EOS]) == [0]


def test_frequency_penalty_grows_with_count():
    once = make_seq(outputs=(0,), temperature=0.0, frequency_penalty=0.8)
    assert sample(logits_of(*BASE), [once], [EOS]) == [0]  # 4 - 0.8 > 3
    twice = make_seq(outputs=(0, 0), temperature=0.0, frequency_penalty=0.8)
    assert sample(logits_of(*BASE), [twice], [EOS]) == [1]  # 4 - 1.6 < 3


def test_min_tokens_bans_eos_until_reached():
    eos_first = (0.0,) * 7 + (9.0,)
    early = make_seq(outputs=(1,), temperature=0.0, min_tokens=3, max_tokens=10)
    assert sample(logits_of(*eos_first), [early], [EOS]) != [EOS]
    late = make_seq(outputs=(1, 2, 3), temperature=0.0, min_tokens=3, max_tokens=10)
    assert sample(logits_of(*eos_first), [late], [EOS]) == [EOS]


def test_ignore_eos_never_picks_eos():
    eos_first = (0.0,) * 7 + (9.0,)
    assert sample(logits_of(*eos_first), [make_seq(temperature=0.0, ignore_eos=True)], [EOS]) != [EOS]


def test_banned_token_ids_are_never_chosen():
    assert 0 not in draws(100, banned_token_ids=[0], temperature=0.7)
    assert sample(logits_of(*BASE), [make_seq(temperature=0.0, banned_token_ids=[0, 1])], [EOS]) == [2]


def test_seed_reproduces_and_differs():
    def run(seed):
        seq = make_seq(seed=seed, temperature=1.0)
        return [sample(logits_of(*(0.0,) * VOCAB), [seq], [EOS])[0] for _ in range(30)]
    assert run(5) == run(5)
    assert run(5) != run(6)


def test_rows_sample_independently_of_batch_neighbours():
    def run(with_neighbour):
        seq = make_seq(seed=9, temperature=1.0)
        other = make_seq(seed=1, temperature=1.0, top_k=3)
        rows = [other, seq] if with_neighbour else [seq]
        out = []
        for _ in range(20):
            logits = torch.zeros(len(rows), VOCAB)
            out.append(sample(logits, rows, [EOS])[-1])
        return out
    assert run(False) == run(True)


def test_logprobs_are_log_softmax_of_the_model_logits():
    seq = make_seq(temperature=0.0, logprobs=True, top_logprobs=3)
    token = sample(logits_of(*BASE), [seq], [EOS])[0]
    entry = seq.pending_logprobs[-1]
    expected = torch.tensor(BASE).log_softmax(-1)
    assert entry.token_id == token == 0
    assert math.isclose(entry.logprob, float(expected[0]), rel_tol=1e-5)
    assert [t for t, _ in entry.top] == [0, 1, 2]
    assert all(math.isclose(lp, float(expected[t]), rel_tol=1e-5) for t, lp in entry.top)


def test_penalties_follow_tokens_added_between_steps_row_by_row():
    """The seen set each sequence keeps grows with its tokens; each row gets its own penalty."""
    strong = make_seq(prompt=(5, 5, 6), temperature=0.0, repetition_penalty=2.0)
    mild = make_seq(prompt=(0, 0), temperature=0.0, repetition_penalty=1.1)
    free = make_seq(prompt=(0,), temperature=0.0)
    both = torch.tensor([BASE, BASE, BASE], dtype=torch.float32)
    assert sample(both.clone(), [strong, mild, free], [EOS]) == [0, 0, 0]  # 4 / 1.1 > 3
    strong.token_ids.append(0)
    mild.token_ids.append(1)
    assert sample(both.clone(), [strong, mild, free], [EOS]) == [1, 0, 0]  # 4 / 2 < 3
    counted = make_seq(outputs=(1, 0, 1), temperature=0.0, frequency_penalty=0.6, presence_penalty=0.5)
    out = both[:1].clone()
    sample(out, [counted], [EOS])
    assert torch.allclose(out[0, :3], torch.tensor([4.0 - 1.1, 3.0 - 1.7, 2.0]))


def test_logit_bias_is_added_to_the_model_logits_before_penalties_and_bans():
    """Each row's logits after sampling (they are modified in place) against the definition computed
    directly: bias added to the model's logits, then the repetition penalty, then bans (a -100 bias one)."""
    torch.manual_seed(0)
    model = torch.randn(4, 64) * 3
    rows = [make_seq(prompt=(3, 9), temperature=0.0, logit_bias={5: 2.5, 9: -7.25, 40: 100.0}),
            make_seq(prompt=(3, 9), temperature=0.0),  # no bias: untouched by its neighbours'
            make_seq(prompt=(3, 9), temperature=0.0, repetition_penalty=1.5, logit_bias={3: 4.0, 9: -1.0}),
            make_seq(prompt=(3, 9), temperature=0.7, seed=1, logit_bias={11: -100, 12: 0.5},
                     banned_token_ids=[13])]
    expected = model.clone()
    for row, seq in enumerate(rows):
        for token, bias in seq.params.logit_bias:
            expected[row, token] += bias
    for token in (3, 9):  # seen by row 2: divided if positive, multiplied if not
        v = expected[2, token]
        expected[2, token] = v / 1.5 if v > 0 else v * 1.5
    expected[3, [11, 13]] = float("-inf")
    got = model.clone()
    picks = sample(got, rows, [EOS])
    assert torch.equal(got, expected)
    assert picks[0] == 40 and picks[1] == int(model[1].argmax()) and picks[2] == int(expected[2].argmax())
    assert picks[3] not in (11, 13)


def test_a_bias_other_than_a_ban_takes_the_row_off_the_plain_argmax_paths():
    from engine.sampler import banned_ids, takes_plain_argmax

    banning = make_seq(temperature=0.0, logit_bias={4: -100}, banned_token_ids=[2])
    assert takes_plain_argmax(banning) and banned_ids(banning, [EOS]) == [2, 4]  # the greedy head serves bans
    assert not takes_plain_argmax(make_seq(temperature=0.0, logit_bias={4: -100, 5: 1.0}))
    # +100 all but forces a token, -100 bans the argmax
    assert sample(logits_of(*BASE), [make_seq(temperature=0.0, logit_bias={6: 100})], [EOS]) == [6]
    assert sample(logits_of(*BASE), [make_seq(temperature=0.0, logit_bias={0: -100})], [EOS]) == [1]
    assert set(draws(200, temperature=1.0, logit_bias={5: 100})) == {5}
