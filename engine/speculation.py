"""Prompt-lookup speculation (vLLM's "ngram" method, llama.cpp's lookup decoding) for greedy sequences.

A sequence whose last tokens already occurred earlier in its prompt or output proposes the tokens that
followed that occurrence as a draft; the next step computes the last token and the draft together, one
row each, and keeps the longest prefix of the draft that the model's own greedy picks agree with, plus
the model's pick after it. Every kept token is the argmax the model computes at its position, so the
answer is the one plain decoding gives; a step just yields more than one token when the draft holds.

Only long matches are proposed. Measured on the embedded model's greedy answers to compare.py's prompts
(50 to 1,000 tokens, 56 answers of 128 tokens; AMD EPYC, 2026-11-24), the share of drafted tokens the
model agrees with, by the length of the match that proposed them: 1 token 5-17%, 2 tokens 10-38%,
3 tokens 35-51%, 4 tokens 40-71%, 8 or more 84-96%. A draft row costs about a decode row whether kept
or not, and where a step is bound by arithmetic (many streams) only drafts that mostly hold pay.
"""

from __future__ import annotations

from engine.sequence import Sequence


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of a token list last ended, kept up to date as the list grows.
    An n-gram ending at the list's last token is indexed only once a later token follows it, so a lookup
    of the list's tail finds an earlier occurrence."""

    __slots__ = ("min_n", "max_n", "last_end", "indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in last_end

    def _catch_up(self, tokens: list[int]) -> None:
        if len(tokens) - 1 < self.indexed:  # the list was cut back: start again
            self.last_end.clear()
            self.indexed = 0
        for end in range(self.indexed, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.last_end[tuple(tokens[end - n + 1:end + 1])] = end
        self.indexed = max(self.indexed, len(tokens) - 1)

    def lookup(self, tokens: list[int], count: int) -> list[int]:
        """Up to ``count`` tokens that followed the latest earlier occurrence of the longest tail n-gram."""
        self._catch_up(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = self.last_end.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + count]
        return []


class NgramProposer:
    """Drafts for the sequences that may take them: greedy rows whose pick reads nothing but the logits and
    their bans (sampler.takes_plain_argmax), with room for more than one token."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        if num_tokens < 0 or min_n < 1 or max_n < min_n:
            raise ValueError(f"speculation needs num_speculative_tokens >= 0 and 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max (got {num_tokens}, {min_n}, {max_n})")
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n
        self.num_drafted = 0  # draft tokens that went into a step
        self.num_accepted = 0  # of those, the ones the model agreed with

    def room(self, seq: Sequence) -> int:
        """Draft tokens ``seq`` may take now: a draft and the model's pick after it stay within max_tokens, and
        every row of the step has the same bans (all before min_tokens, or all after)."""
        p = seq.params
        room = min(self.num_tokens, seq.max_total_len - len(seq.token_ids) - 1)
        if seq.num_output_tokens < p.min_tokens:
            room = min(room, p.min_tokens - 1 - seq.num_output_tokens)
        return room

    def propose(self, seq: Sequence) -> list[int]:
        room = self.room(seq)
        if room <= 0:
            return []
        if seq.ngram_index is None:
            seq.ngram_index = NgramIndex(self.min_n, self.max_n)
        return seq.ngram_index.lookup(seq.token_ids, room)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafted += drafted
        self.num_accepted += accepted


def accepted_prefix(draft: list[int], picks: list[int]) -> int:
    """How many draft tokens the model's picks confirm: picks[i] is its token after the draft's first i."""
    n = 0
    while n < len(draft) and picks[n] == draft[n]:
        n += 1
    return n
