"""Batched sampling with per-row parameters.

Every row draws from its own ``torch.Generator`` (one uniform per token), so a seeded request
samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.logprobs import step_logprobs
from engine.request import TokenLogprob
from engine.sequence import Sequence
from engine.structured import PreparedMasks

_NEG_INF = float("-inf")
# (logits, temperature, top_k, top_p, min_p, uniforms) -> token per row: CpuKernels.sample
Draw = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _rows_and_ids(token_lists: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index tensors over every row's listed tokens: one conversion for the whole batch."""
    rows = [row for row, toks in token_lists for _ in range(len(toks))]
    ids = [t for _, toks in token_lists for t in toks]
    return torch.tensor(rows, dtype=torch.long), torch.tensor(ids, dtype=torch.long)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Repetition (HF / vLLM: every token seen in prompt or output is divided, if its logit is positive, or
    multiplied by the penalty), then presence and frequency (output tokens only: a flat cut once seen, and
    one per occurrence). Each is one indexed operation over the whole batch, the seen ids kept by each
    sequence as its tokens come; per row set() and unique() calls took ~0.4 ms a row at 1,200-token
    contexts (14 ms a 32-row step)."""
    repeated = [row for row, seq in enumerate(seqs) if seq.params.repetition_penalty != 1.0]
    if repeated:
        seen = [seqs[row].seen_token_ids() for row in repeated]
        lengths = torch.tensor([len(ids) for ids in seen])
        rows = torch.tensor(repeated, dtype=torch.long).repeat_interleave(lengths)
        ids = torch.cat(seen)
        penalty = torch.tensor([seqs[row].params.repetition_penalty for row in repeated],
                               dtype=logits.dtype).repeat_interleave(lengths)
        vals = logits[rows, ids]
        logits[rows, ids] = torch.where(vals > 0, vals / penalty, vals * penalty)
    counted = [(row, seq.output_token_ids) for row, seq in enumerate(seqs)
               if (seq.params.presence_penalty or seq.params.frequency_penalty) and seq.output_token_ids]
    if counted:
        rows, ids = _rows_and_ids(counted)
        keys, counts = (rows * logits.shape[-1] + ids).unique(return_counts=True)
        key_rows = keys // logits.shape[-1]
        freq = torch.tensor([seq.params.frequency_penalty for seq in seqs], dtype=logits.dtype)[key_rows]
        pres = torch.tensor([seq.params.presence_penalty for seq in seqs], dtype=logits.dtype)[key_rows]
        flat = logits.view(-1)
        flat[keys] -= freq * counts.to(logits.dtype) + pres


def banned_ids(seq: Sequence, eos_token_ids: list[int]) -> list[int]:
    """The ids a row may not pick this step: its banned ids (a -100 logit bias included), its stop ids and
    EOS until min_tokens, and EOS under ignore_eos."""
    p = seq.params
    banned = list(seq.bans)
    if seq.num_output_tokens < p.min_tokens:
        banned += list(p.stop_token_ids)
        if not p.ignore_eos:
            banned += eos_token_ids
    if p.ignore_eos:
        banned += eos_token_ids
    return banned


def reads_only_logits(seq: Sequence) -> bool:
    """Whether the row's pick reads nothing but its model logits, its fixed logit bias, its banned_ids and its
    truncation (no penalty, logprob, allow-list, grammar or forced token reads the tokens before it): rows for
    several positions of one sequence can then be picked in one step, each as a step of its own would."""
    p = seq.params
    return (not p.logprobs and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and not p.allowed_token_ids and seq.matcher is None
            and not seq.forced_token_ids)


def takes_plain_argmax(seq: Sequence) -> bool:
    """Whether the row's token is the argmax of its model logits with only banned_ids left out (no bias moves
    a logit): the greedy head can pick it."""
    return seq.params.is_greedy and seq.bias_ids is None and reads_only_logits(seq)


def apply_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """OpenAI's logit_bias: each row's biases added to its logits (one indexed add for the whole batch; a
    row's ids are distinct). Bans (-100) are not here: ``banned_ids`` holds them."""
    biased = [(row, seq.bias_ids, seq.bias_values) for row, seq in enumerate(seqs)
              if seq.bias_ids is not None and seq.bias_values is not None]
    if not biased:
        return
    rows = torch.tensor([row for row, _, _ in biased], dtype=torch.long).repeat_interleave(
        torch.tensor([len(ids) for _, ids, _ in biased]))
    ids = torch.cat([ids for _, ids, _ in biased])
    values = torch.cat([values for _, _, values in biased]).to(logits.dtype)
    logits.index_put_((rows, ids), values, accumulate=True)


def apply_bans(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int]) -> None:
    # every row's banned ids in one indexed write (one small write per row cost ~10 us a row, a step)
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for row, seq in enumerate(seqs):
        banned = banned_ids(seq, eos_token_ids)
        ban_rows += [row] * len(banned)
        ban_ids += banned
    if ban_ids:
        logits[torch.tensor(ban_rows), torch.tensor(ban_ids)] = _NEG_INF
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.allowed_token_ids:  # vLLM's allowed_token_ids: every other token is out
            keep = logits[row, p.allowed_token_ids].clone()
            logits[row] = _NEG_INF
            logits[row, p.allowed_token_ids] = keep
        if seq.forced_token_ids:  # a capped leading section closing: its next id is the only choice
            forced = seq.forced_token_ids[0]
            logits[row] = _NEG_INF
            logits[row, forced] = 0.0


def _truncate(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Temperature, then top-k, top-p (over the top-k survivors, renormalised, as vLLM and HF do) and
    min-p cuts; logits [B, V] fp32."""
    temps = torch.tensor([s.params.temperature for s in seqs], dtype=logits.dtype).clamp_min(1e-5)
    logits = logits / temps[:, None]
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in (s.params.top_k for s in seqs)]
    top_ps = [s.params.top_p for s in seqs]
    min_ps = [s.params.min_p for s in seqs]
    sorted_logits: torch.Tensor | None
    sorted_idx: torch.Tensor | None
    if max(ks) < vocab:
        # Every row has a top-k: only the best max(k) can survive, and topk is ~60x cheaper than
        # sorting the whole vocabulary (Spark sessions always sample with a top-k).
        sorted_logits, sorted_idx = logits.topk(max(ks), dim=-1)
    elif min(ks) < vocab or min(top_ps) < 1.0:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    else:
        sorted_logits = sorted_idx = None
    if sorted_logits is not None:
        ranks = torch.arange(sorted_logits.shape[-1])[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= torch.tensor(ks)[:, None], _NEG_INF)
        if min(top_ps) < 1.0:
            probs = sorted_logits.softmax(-1)
            cum_before = probs.cumsum(-1) - probs  # mass strictly above each token
            cut = cum_before >= torch.tensor(top_ps, dtype=probs.dtype)[:, None]
            cut[:, 0] = False  # the most likely token always survives
            sorted_logits = sorted_logits.masked_fill(cut, _NEG_INF)
        assert sorted_idx is not None  # made with sorted_logits
        logits = torch.full_like(logits, _NEG_INF).scatter_(-1, sorted_idx, sorted_logits)
    if any(p > 0.0 for p in min_ps):
        probs = logits.softmax(-1)
        floor = probs.max(-1, keepdim=True).values * torch.tensor(min_ps, dtype=probs.dtype)[:, None]
        logits = logits.masked_fill(probs < floor, _NEG_INF)
    return logits


def _draw_torch(logits: torch.Tensor, seqs: list[Sequence], uniforms: torch.Tensor) -> list[int]:
    """The reference draw: truncate, softmax, then the inverse CDF over the vocabulary in id order;
    side="right" never lands on a zero-probability token."""
    probs = _truncate(logits, seqs).softmax(-1)
    cdf = probs.cumsum(-1)
    targets = uniforms[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, targets, right=True).flatten().clamp_max(probs.shape[-1] - 1).tolist()


def apply_constraints(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int],
                      masks: PreparedMasks | None) -> None:
    """Structured output: each constrained row keeps only what its grammar allows next. Bans and
    penalties come on top, unless they would leave the row nothing (a grammar that must end now while
    ignore_eos or min_tokens ban the end): then the grammar wins."""
    rows = masks.apply(logits, seqs) if masks is not None else []
    if rows:
        allowed = logits[rows].clone()
    apply_bans(logits, seqs, eos_token_ids)
    if rows:
        dead = torch.isinf(logits[rows]).all(-1).nonzero().flatten().tolist()
        for j in dead:
            logits[rows[j]] = allowed[j]


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int],
           masks: PreparedMasks | None = None,
           argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
           draw: Draw | None = None) -> list[int]:
    """logits [B, V] fp32 (modified in place); returns one token id per row. ``masks``: the constrained
    sequences' grammar masks for this step (``MaskApplier.prepare``). ``argmax``: torch.argmax(x, -1)'s
    equal, faster (the fused kernels'; torch's own takes ~1 ms over 24 rows of a 49k vocabulary).
    ``draw``: the fused kernels' sampler (CpuKernels.sample), the torch path below without its sorts: at 32
    rows of a 49k vocabulary top-p alone took ~100 ms a step here (a full sort), top-k ~4 ms."""
    raw_logprobs = None
    if any(s.params.logprobs for s in seqs):
        raw_logprobs = step_logprobs(logits, [s.params for s in seqs])
    apply_bias(logits, seqs)  # on the model's logits, before penalties and truncation (OpenAI, vLLM)
    apply_penalties(logits, seqs)
    apply_constraints(logits, seqs, eos_token_ids, masks)
    greedy_rows = [i for i, s in enumerate(seqs) if s.params.is_greedy]
    random_rows = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
    tokens = [0] * len(seqs)
    if greedy_rows:
        rows = logits if len(greedy_rows) == len(seqs) else logits[greedy_rows]  # no copy when all are greedy
        picked = (argmax(rows) if argmax is not None else rows.argmax(-1)).tolist()
        for row, tok in zip(greedy_rows, picked):
            tokens[row] = tok
    if random_rows:
        sub_seqs = [seqs[i] for i in random_rows]
        # One uniform per token from the row's own generator (cheap, and independent of the batch).
        uniforms = torch.cat([torch.rand(1, generator=seq.generator) for seq in sub_seqs])
        rows = logits if len(random_rows) == len(seqs) else logits[random_rows]
        if draw is not None:
            params = [seq.params for seq in sub_seqs]
            picked = draw(rows, torch.tensor([p.temperature for p in params]), torch.tensor([p.top_k for p in params]),
                          torch.tensor([p.top_p for p in params]), torch.tensor([p.min_p for p in params]),
                          uniforms).tolist()
        else:
            picked = _draw_torch(rows, sub_seqs, uniforms)
        for row, tok in zip(random_rows, picked):
            tokens[row] = tok
    if raw_logprobs is not None:  # the picked tokens' and the top candidates' logprobs, gathered at once
        asking = [row for row, seq in enumerate(seqs) if seq.params.logprobs]
        picked_lp = raw_logprobs[asking, [tokens[row] for row in asking]].tolist()
        width = max(seqs[row].params.top_logprobs for row in asking)
        top_vals: list[list[float]] = []
        top_ids: list[list[int]] = []
        if width:
            vals, ids = raw_logprobs[asking].topk(width, dim=-1)
            top_vals, top_ids = vals.tolist(), ids.tolist()
        for j, row in enumerate(asking):
            seq = seqs[row]
            entry = TokenLogprob(token_id=tokens[row], logprob=picked_lp[j])
            k = seq.params.top_logprobs
            if k:
                entry.top = list(zip(top_ids[j][:k], top_vals[j][:k]))
            seq.pending_logprobs.append(entry)
    return tokens
