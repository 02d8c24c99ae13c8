"""FastDeploy's logprob options in the sampler, against a direct computation of what they define:
temp_scaled_logprobs (the logits divided by the temperature first) and top_p_normalized_logprobs (the
probabilities renormalised over the top-p set); neither changes the token drawn."""

from __future__ import annotations

import math
from typing import cast

import pytest
import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.logprobs import LOWEST_LOGPROB
from engine.request import GenerationRequest, TokensPrompt
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

LOGITS = (2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -2.0, -3.0)
EOS = 7


class _NoDetok:
    pass


def entry_for(seed: int = 0, logits: tuple[float, ...] = LOGITS, **params):
    req = GenerationRequest("r", TokensPrompt([1, 2]), SamplingParams(logprobs=True, top_logprobs=4, **params))
    seq = Sequence(req, [1, 2], cast(IncrementalDetokenizer, _NoDetok()), 1000, seed=seed)
    token = sample(torch.tensor([logits]), [seq], [EOS])[0]
    return token, seq.pending_logprobs[0]


def direct(temperature: float | None = None, top_p: float | None = None) -> torch.Tensor:
    """The definition, written out token by token."""
    x = [v / temperature for v in LOGITS] if temperature else list(LOGITS)
    z = sum(math.exp(v) for v in x)
    probs = [math.exp(v) / z for v in x]
    if top_p is not None:
        order = sorted(range(len(probs)), key=lambda i: -probs[i])
        kept: set[int] = set()
        mass = 0.0
        for i in order:
            if mass < top_p or not kept:
                kept.add(i)
            mass += probs[i]
        total = sum(probs[i] for i in kept)
        probs = [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]
    return torch.tensor([math.log(p) if p > 0 else LOWEST_LOGPROB for p in probs])


def assert_entry(token: int, entry, expected: torch.Tensor) -> None:
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(expected[token].item(), abs=1e-5)
    top = expected.topk(4)
    assert [t for t, _ in entry.top] == top.indices.tolist()
    assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_default_logprobs_are_the_models_own_distribution():
    assert_entry(*entry_for(temperature=0.5, top_p=0.5), direct())


def test_temp_scaled_logprobs_divide_the_logits_by_the_temperature():
    for temperature in (0.5, 1.7):
        assert_entry(*entry_for(temperature=temperature, temp_scaled_logprobs=True), direct(temperature=temperature))


def test_temp_scaled_logprobs_of_a_greedy_request_are_unscaled():
    token, entry = entry_for(temperature=0.0, temp_scaled_logprobs=True)
    assert token == 0
    assert_entry(token, entry, direct())


def test_top_p_normalized_logprobs_renormalise_over_the_top_p_set():
    for top_p in (0.4, 0.7, 0.95):
        for seed in range(3):
            token, entry = entry_for(seed=seed, temperature=1.0, top_p=top_p, top_p_normalized_logprobs=True)
            assert_entry(token, entry, direct(top_p=top_p))
    # outside the set: the lowest finite logprob (JSON has no -Infinity)
    _, entry = entry_for(temperature=1.0, top_p=0.4, top_p_normalized_logprobs=True)
    assert entry.top[0][1] == pytest.approx(0.0, abs=1e-6)  # 0.4 keeps only the most likely token
    assert all(lp == LOWEST_LOGPROB for _, lp in entry.top[1:])


def test_both_options_together_scale_then_renormalise():
    token, entry = entry_for(seed=4, temperature=2.0, top_p=0.8, temp_scaled_logprobs=True,
                             top_p_normalized_logprobs=True)
    assert_entry(token, entry, direct(temperature=2.0, top_p=0.8))


def test_options_change_the_reported_logprobs_not_the_tokens_and_stay_per_row():
    plain = [entry_for(seed=s, temperature=0.8, top_p=0.9)[0] for s in range(8)]
    scaled = [entry_for(seed=s, temperature=0.8, top_p=0.9, temp_scaled_logprobs=True,
                        top_p_normalized_logprobs=True)[0] for s in range(8)]
    assert plain == scaled
    # one batch: the row that asks is adjusted, its neighbour keeps the model's distribution
    rows = []
    for asks in (True, False):
        req = GenerationRequest("r", TokensPrompt([1]), SamplingParams(logprobs=True, temperature=0.5,
                                                                       temp_scaled_logprobs=asks))
        rows.append(Sequence(req, [1], cast(IncrementalDetokenizer, _NoDetok()), 1000, seed=1))
    tokens = sample(torch.tensor([LOGITS, LOGITS]), rows, [EOS])
    assert rows[0].pending_logprobs[0].logprob == pytest.approx(direct(temperature=0.5)[tokens[0]].item(), abs=1e-5)
    assert rows[1].pending_logprobs[0].logprob == pytest.approx(direct()[tokens[1]].item(), abs=1e-5)
