"""The fused sampling kernel (csrc/sampling.c) draws as engine/sampler.py's torch path defines it.

Each draw is checked against the reference's own inverse CDF: the picked token must have probability in
the reference (temperature, top-k, top-p over the top-k survivors, min-p) and u must fall in its interval of
the cumulative distribution, within float rounding. The sums run in another order, so only a u within
rounding of a boundary may land on the neighbour.
"""

from __future__ import annotations

import types
from typing import cast

import pytest
import torch

from engine.kernels import load_cpu_kernels
from engine.sampler import _truncate, sample
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler: the fused kernels are not built")

SLACK = 2e-5  # of the total mass: summation order


def _rows(params: list[SamplingParams]) -> list[Sequence]:
    # stand-ins for sequences: _truncate reads only their params
    return cast("list[Sequence]", [types.SimpleNamespace(params=p) for p in params])


def _reference_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    return _truncate(logits.clone(), _rows(params)).softmax(-1).double()


def _check_draws(logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor) -> None:
    """Every row drawn once per column of uniforms [rows, n]."""
    probs = _reference_probs(logits, params)
    cdf = probs.cumsum(-1)
    n = len(params)
    for j in range(uniforms.shape[1]):
        u = uniforms[:, j].contiguous()
        picked = kernels.sample(logits, torch.tensor([p.temperature for p in params]),
                                torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params]),
                                torch.tensor([p.min_p for p in params]), u)
        for r in range(n):
            t = int(picked[r])
            assert probs[r, t] > 0, (r, t, params[r])
            target = float(u[r]) * float(cdf[r, -1])
            assert float(cdf[r, t] - probs[r, t]) - SLACK <= target <= float(cdf[r, t]) + SLACK, (r, t, params[r])


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5, top_k=4),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
    SamplingParams(temperature=1.3, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=0.3, top_p=0.5, min_p=0.2),
    SamplingParams(temperature=2.0, top_k=3000, top_p=0.99),
    SamplingParams(temperature=1.0, top_p=0.999999),
]


@pytest.mark.parametrize("vocab", [8, 1000, 49152])
@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])
def test_draws_fall_in_the_reference_distribution(vocab: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(vocab + int(scale * 10))
    logits = torch.randn(len(CASES), vocab, generator=gen) * scale
    _check_draws(logits, CASES, torch.rand(len(CASES), 60, generator=gen))


def test_banned_tokens_and_degenerate_rows() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 300, generator=gen)
    logits[0, :290] = float("-inf")  # ten live tokens, top-k wider than them
    logits[1, ::2] = float("-inf")
    logits[2, 1:] = float("-inf")  # one live token
    params = [SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=1.0)] * 2
    _check_draws(logits[:3], params[:3], torch.rand(3, 200, generator=gen))
    # a NaN, or nothing finite: the row's argmax (torch's softmax would give NaNs)
    logits[3, 17] = float("nan")
    logits[4] = float("-inf")
    logits[5, 40] = float("inf")
    picked = kernels.sample(logits[3:], torch.ones(3), torch.zeros(3, dtype=torch.int64), torch.ones(3),
                            torch.zeros(3), torch.full((3,), 0.5))
    assert picked.tolist() == [17, 0, 40]


def test_u_at_the_ends_of_the_range() -> None:
    """u = 0 takes the first live survivor in id order, u just under 1 the last; -inf never."""
    logits = torch.tensor([[float("-inf"), 1.0, float("-inf"), 2.0, 0.5, float("-inf")]])
    one = torch.ones(1)
    for u, k, p, want in ((0.0, 0, 1.0, 1), (0.0, 2, 1.0, 1), (0.0, 0, 0.99, 1),
                          (1.0 - 2 ** -24, 0, 1.0, 4), (1.0 - 2 ** -24, 2, 1.0, 3), (1.0 - 2 ** -24, 0, 0.99, 4),
                          (1.0 - 2 ** -24, 0, 0.6, 3)):
        got = kernels.sample(logits, one, torch.tensor([k]), torch.tensor([p]), torch.zeros(1), torch.tensor([u]))
        assert int(got) == want, (u, k, p, int(got))


def test_sample_uses_the_kernel_with_the_same_seeded_reproducibility() -> None:
    """Through engine.sampler.sample: a seeded row repeats itself and ignores its batch neighbours."""
    from engine.detokenizer import IncrementalDetokenizer
    from engine.request import GenerationRequest, TokensPrompt

    def seq(seed: int, **params) -> Sequence:
        req = GenerationRequest("r", TokensPrompt([1, 2]), SamplingParams(**params))
        return Sequence(req, [1, 2], cast(IncrementalDetokenizer, object()), 1000, seed=seed)  # never decodes

    def run(with_neighbour: bool) -> list[int]:
        row = seq(9, temperature=0.9, top_p=0.8)
        rows = [seq(1, temperature=1.0, top_k=3), row] if with_neighbour else [row]
        gen = torch.Generator().manual_seed(3)
        out = []
        for _ in range(40):
            logits = torch.randn(1, 5000, generator=gen).repeat(len(rows), 1) * 4
            out.append(sample(logits, rows, [0], draw=kernels.sample)[-1])
        return out

    assert run(False) == run(True)
    assert len(set(run(False))) > 1
