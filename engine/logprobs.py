"""The logprobs a step reports for its sampled tokens and their top candidates.

By default they are the model's own distribution (log-softmax of the logits before penalties,
temperature and truncation: vLLM's and OpenAI's meaning). Two per-request options change that for the
rows that ask (FastDeploy's names, SGLang computes the same):

- ``temp_scaled_logprobs``: the logits are divided by the request's temperature first, so the logprobs
  are those of the distribution the sampler draws from before truncation. A greedy request
  (temperature 0) has no such distribution; its logits are left as they are (vLLM and SGLang treat
  greedy rows as temperature 1 the same way).
- ``top_p_normalized_logprobs``: the probabilities are renormalised over the top-p set (the most likely
  tokens whose mass strictly above each is below ``top_p``, the most likely always in it, the same rule
  as the sampler's cut); tokens outside the set get the lowest finite float32 logprob (JSON has no
  infinity). With top_p 1 nothing changes.

Both apply to the output tokens' logprobs only; prompt logprobs stay the model's own.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from engine.sampling_params import SamplingParams

LOWEST_LOGPROB = torch.finfo(torch.float32).min  # stands for log(0): finite, so it serialises as JSON


def adjusts(p: SamplingParams) -> bool:
    """Whether a request's logprobs differ from the model's own distribution."""
    return (p.temp_scaled_logprobs and p.temperature > 0.0 and p.temperature != 1.0) or \
        (p.top_p_normalized_logprobs and p.top_p < 1.0)


def adjusted_logprobs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row's logprobs [V] from its raw logits [V] under the request's logprob options."""
    x = logits.float()
    if p.temp_scaled_logprobs and p.temperature > 0.0:
        x = x / p.temperature
    logprobs = x.log_softmax(-1)
    if p.top_p_normalized_logprobs and p.top_p < 1.0:
        probs = logprobs.exp()
        sorted_probs, order = probs.sort(descending=True)
        above = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        keep_sorted = above < p.top_p
        keep_sorted[0] = True  # the most likely token is always in the set
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
        kept = torch.where(keep, probs, torch.zeros_like(probs))
        logprobs = (kept / kept.sum()).log()
    return logprobs.clamp_min(LOWEST_LOGPROB)


def step_logprobs(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """Logprobs [B, V] for a step's rows from their logits [B, V] (read before penalties and bans change
    them): the model's own distribution, each row that asks for an adjustment recomputed on its own."""
    out = logits.log_softmax(-1)
    for row, p in enumerate(params):
        if p.logprobs and adjusts(p):
            out[row] = adjusted_logprobs(logits[row], p)
    return out
