"""The answer-volume budget: how many logprob entries one request may make the server compute and render.

One entry is one (token, logprob) pair in an answer: a prompt position's own token or one of its top
candidates (``prompt_logprobs``), or a generated token or one of its top candidates (``logprobs`` /
``top_logprobs``). A request fans out into several engine requests (a list of prompts, an SGLang batch)
and each into ``n`` samples; its entries are summed over all of them, using each one's upper bound:

    per sample  prompt tokens x (prompt_logprobs + 1)                    when prompt_logprobs is set
              + min(max_tokens, context - prompt tokens) x (top_logprobs + 1)   when logprobs are asked for

and must stay within ``--max-logprob-entries``, checked after lowering and before any engine work. The
rendered JSON costs 32-120 bytes per entry (measured in the OpenAI renderers: a completion's
``top_logprobs`` map ~32, ``prompt_logprobs`` ~82, a chat ``content`` item with its ``bytes`` ~97-116),
and up to ~800 bytes of memory per entry at the peak (the collected logprobs, the answer's objects and
its text together), so the default of 1,000,000 entries bounds one answer at ~100 MB of JSON and
~0.8 GB of memory while it is rendered.

Prompt tokens are known exactly only after tokenizing, which the engine does later. A first pass uses
bounds that need no tokenizer (token ids: their count; text: its UTF-8 bytes, every token covering one
byte at least; chat: the context); only a request over the budget by those bounds has its prompts
tokenized (off the event loop) for the exact count before it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from bridges.common import BridgeError, Completion
from bridges.context import ServingContext
from engine.request import GenerationRequest, TextPrompt, TokensPrompt

# Special tokens a tokenizer may add to a text prompt on top of one token per byte (BOS, EOS, a
# sentencepiece prefix): a safe margin for the first, tokenizer-free pass.
_SPECIAL_TOKEN_MARGIN = 8

# A non-streaming answer whose entries are at most this many is rendered on the event loop (a few
# milliseconds); a larger one is rendered in a worker thread, so other clients keep being served.
RENDER_IN_THREAD_ENTRIES = 20_000


@dataclass(slots=True)
class Volume:
    prompt: int = 0  # entries of prompt_logprobs
    output: int = 0  # entries of the generated tokens' logprobs

    @property
    def total(self) -> int:
        return self.prompt + self.output

    def __iadd__(self, other: Volume) -> Volume:
        self.prompt += other.prompt
        self.output += other.output
        return self


def _wants_logprobs(req: GenerationRequest) -> bool:
    return req.params.logprobs or req.params.prompt_logprobs is not None


def _prompt_bound(req: GenerationRequest, context: int) -> int:
    """The most tokens the prompt can have, without tokenizing it."""
    prompt = req.prompt
    if isinstance(prompt, TokensPrompt):
        bound = len(prompt.token_ids)
    elif isinstance(prompt, TextPrompt):
        bound = len(prompt.text.encode("utf-8", "surrogatepass")) + _SPECIAL_TOKEN_MARGIN
    else:  # chat: the template's own text is not known here
        bound = context
    truncate = req.params.truncate_prompt_tokens
    return min(bound, context, truncate) if truncate else min(bound, context)


def entries(req: GenerationRequest, prompt_tokens: int, context: int, exact: bool) -> Volume:
    """The request's logprob entries, all samples together. ``exact``: ``prompt_tokens`` is the prompt's
    real length (then the answer's room is the context less the prompt), else an upper bound."""
    p = req.params
    volume = Volume()
    if p.prompt_logprobs is not None:
        volume.prompt = p.n * prompt_tokens * (p.prompt_logprobs + 1)
    if p.logprobs:
        room = max(context - prompt_tokens, 0) if exact else context
        volume.output = p.n * min(p.max_tokens, room) * (p.top_logprobs + 1)
    return volume


async def check_answer_volume(ctx: ServingContext, reqs: list[GenerationRequest],
                              fields: tuple[str, str, str]) -> Volume:
    """Refuse (400 naming the field) a request whose answers could hold more logprob entries than
    ``--max-logprob-entries``; returns the bound it passed with. ``fields``: the protocol's names of
    (prompt logprobs, top candidates of the output, output logprobs), for the refusal."""
    limit = ctx.options.max_logprob_entries
    if not any(_wants_logprobs(r) for r in reqs):
        return Volume()
    context = ctx.model.max_model_len
    volume = Volume()
    for r in reqs:
        volume += entries(r, _prompt_bound(r, context), context, exact=False)
    if volume.total <= limit:
        return volume
    # over by the bounds: count the prompts' real tokens before refusing
    volume = Volume()
    for r in reqs:
        if not _wants_logprobs(r):
            continue
        ids = await ctx.tokenizer.prompt_ids(r.prompt)
        n = len(ids) if not r.params.truncate_prompt_tokens else min(len(ids), r.params.truncate_prompt_tokens)
        volume += entries(r, min(n, context), context, exact=True)
    if volume.total <= limit:
        return volume
    prompt_field, top_field, output_field = fields
    top = any(r.params.top_logprobs for r in reqs)
    field = prompt_field if volume.prompt >= volume.output else (top_field if top else output_field)
    samples = sum(r.params.n for r in reqs)
    raise BridgeError(400, f"{field}: the answer could hold {volume.total:,} logprob entries ({samples} sample(s); "
                           f"prompt logprobs {volume.prompt:,}, output logprobs {volume.output:,}); at most "
                           f"{limit:,} per request (--max-logprob-entries). Ask for fewer top candidates, "
                           "fewer tokens (max_tokens), fewer samples or fewer prompts per request", param=field)


def collected_entries(reqs: list[GenerationRequest], results: list[list[Completion]]) -> int:
    """The logprob entries a collected answer holds (what rendering it will walk)."""
    total = 0
    for req, comps in zip(reqs, results):
        p = req.params
        for c in comps:
            total += len(c.logprobs) * (p.top_logprobs + 1)
            if c.prompt_logprobs is not None:
                total += len(c.prompt_logprobs) * ((p.prompt_logprobs or 0) + 1)
    return total
