"""The one validated set of generation knobs every protocol lowers onto."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured import Constraint


@dataclass(frozen=True, slots=True)
class LeadingSection:
    """A section the output opens with and closes with ``end_token_ids`` (a model's thinking; what it
    means is the caller's business). While it is open the structured-output ``constraint`` waits: it
    applies to the output after the section. ``max_tokens``: once that many output tokens are generated
    with the section still open, ``end_token_ids`` are forced next, closing it (a thinking budget).
    ``field``: the request field a problem with it names."""

    end_token_ids: tuple[int, ...]
    max_tokens: int | None = None
    field: str = "leading_section"


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: no top-k cut
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    banned_token_ids: list[int] = field(default_factory=list)
    allowed_token_ids: list[int] = field(default_factory=list)  # non-empty: only these may be sampled
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs, each bias added to the token's logit before
    # penalties and truncation; BAN_BIAS itself is a ban (``bans_and_bias``)
    logit_bias: tuple[tuple[int, float], ...] = ()
    spaces_between_special_tokens: bool = True  # for slow tokenizers' decode (fast ones always join as written)
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs, with this many top candidates
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last so many tokens
    # output logprobs of the temperature-scaled / top-p-renormalised distribution (engine/logprobs.py)
    temp_scaled_logprobs: bool = False
    top_p_normalized_logprobs: bool = False
    constraint: Constraint | None = None  # structured output: what the answer must match (engine/structured.py)
    leading_section: LeadingSection | None = None  # a section before the constrained answer, maybe capped

    def __post_init__(self) -> None:
        # JSON Schema's "integer" admits 7.0: whole-number floats are the integers they spell
        for name in _INTEGER_FIELDS:
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():
                setattr(self, name, int(value))
        for name in ("stop_token_ids", "banned_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if any(isinstance(t, float) for t in ids):
                setattr(self, name, [int(t) if isinstance(t, float) and t.is_integer() else t for t in ids])
        self.logit_bias = _bias_pairs(self.logit_bias)
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def bans_and_bias(self) -> tuple[list[int], tuple[tuple[int, float], ...]]:
        """(every id this request bans: ``banned_token_ids`` then the ids biased by BAN_BIAS, each once; the
        other biases, of ids not banned). A bias of -100 is OpenAI's ban: treated as one, the greedy fast
        paths, which know bans but no biases, still serve it."""
        bans = list(dict.fromkeys([*self.banned_token_ids, *(t for t, b in self.logit_bias if b <= BAN_BIAS)]))
        banned = set(bans)
        return bans, tuple((t, b) for t, b in self.logit_bias if t not in banned)

    def validate(self) -> None:
        _require(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)), "seed",
                 "must be an integer")
        _require(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        _require(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
                 "min_tokens", "must be an integer between 0 and max_tokens")
        _require(self.temperature >= 0.0, "temperature", "must be >= 0")
        _require(isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1), "top_k",
                 "must be -1, 0 (disabled) or a positive integer")
        _require(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _require(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _require(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        _require(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _require(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _require(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        _require(isinstance(self.top_logprobs, int) and self.top_logprobs >= 0, "top_logprobs",
                 "must be an integer >= 0")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 "must be non-negative token ids")
        _require(all(isinstance(t, int) and t >= 0 for t in self.banned_token_ids), "banned_token_ids",
                 "must be non-negative token ids")
        _require(all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids), "allowed_token_ids",
                 "must be non-negative token ids")
        _require(all(isinstance(pair, tuple) and len(pair) == 2 for pair in self.logit_bias), "logit_bias",
                 "must map token ids to biases")
        _require(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t, _ in self.logit_bias),
                 "logit_bias", "keys must be non-negative token ids")
        _require(all(isinstance(b, float) and math.isfinite(b) and BAN_BIAS <= b <= MAX_BIAS
                     for _, b in self.logit_bias), "logit_bias",
                 f"values must be numbers in [{BAN_BIAS:g}, {MAX_BIAS:g}]")
        _require(len({t for t, _ in self.logit_bias}) == len(self.logit_bias), "logit_bias",
                 "names a token id more than once")
        _require(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
                 "prompt_logprobs", "must be an integer >= 0")
        _require(self.truncate_prompt_tokens is None or (isinstance(self.truncate_prompt_tokens, int)
                                                         and self.truncate_prompt_tokens >= 1),
                 "truncate_prompt_tokens", "must be an integer >= 1")
        if self.leading_section is not None:
            section = self.leading_section
            _require(bool(section.end_token_ids) and all(isinstance(t, int) and t >= 0
                                                         for t in section.end_token_ids),
                     section.field, "needs the token ids that close the section")
            _require(section.max_tokens is None or (isinstance(section.max_tokens, int) and section.max_tokens >= 1),
                     section.field, "must be an integer >= 1")
        if self.top_k == -1:
            self.top_k = 0


# OpenAI's range for a logit bias: -100 bans the token, 100 all but forces it
BAN_BIAS = -100.0
MAX_BIAS = 100.0

_INTEGER_FIELDS = ("max_tokens", "min_tokens", "top_k", "seed", "n", "top_logprobs", "prompt_logprobs",
                   "truncate_prompt_tokens")


def _bias_pairs(value: object) -> tuple[Any, ...]:
    """logit_bias as (id, float bias) pairs: from pairs or the OpenAI form {id: bias}, whole-number float ids
    and integer biases read as what they spell; anything else is left for ``validate`` to refuse."""
    items = value.items() if isinstance(value, dict) else value
    if not isinstance(items, (tuple, list, type({}.items()))):
        return (value,)
    out: list[Any] = []
    pair: Any
    for pair in items:
        if isinstance(pair, (tuple, list)) and len(pair) == 2:
            t, b = pair
            t = int(t) if isinstance(t, float) and t.is_integer() else t
            b = float(b) if isinstance(b, int) and not isinstance(b, bool) else b
            pair = (t, b)
        out.append(pair)
    return tuple(out)


def _require(ok: bool, parameter: str, rule: str) -> None:
    if not ok:
        raise InvalidRequestError(f"'{parameter}' {rule}", parameter=parameter)
