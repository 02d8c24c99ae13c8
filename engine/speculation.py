"""Prompt-lookup speculation (vLLM's "ngram" method, llama.cpp's lookup decoding).

A sequence whose last tokens already occurred earlier in its prompt or output proposes the tokens that
followed that occurrence as a draft; the next step computes the last token and the draft together, one
row each, and picks a token at every row exactly as plain decoding would at that position: greedy rows
their argmax, sampled rows their draw with the very uniform plain decoding would take there (the row's
generator is rewound to what the kept tokens consumed). The longest prefix of the draft that those picks
agree with is kept, plus the pick after it. So the answer is the one plain decoding gives, token for token
and for a seeded sample too; a step just yields more than one token when the draft holds. For a sampled
row a draft token survives with its probability under the row's distribution, which is what rejection
sampling against a one-token draft accepts, so no acceptance is lost to the coupling.

Whether drafting pays is decided per sequence and step (``DraftPolicy``): a draft row costs about a decode
row whether kept or not, while a kept token saves its share of a whole step. Where a step is dominated by
its pass over the weights (few streams) almost any draft pays; where it is bound by arithmetic (many
streams) only drafts that mostly hold do, and a sequence whose drafts keep failing stops drafting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sequence import Sequence


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of a token list last ended, kept up to date as the list grows.
    An n-gram ending at the list's last token is indexed only once a later token follows it, so a lookup
    of the list's tail finds an earlier occurrence."""

    __slots__ = ("indexed", "last_end", "max_n", "min_n")

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


@dataclass(slots=True)
class AcceptanceTally:
    """Draft positions a model's picks were checked against, and how many held. A position is checked only
    when every draft token before it held, so ``held / checked`` estimates the chance that a draft token
    holds given its predecessors did (a draft of n tokens then keeps i of them with that chance to the i)."""

    checked: int = 0
    held: int = 0

    def add(self, drafted: int, kept: int) -> None:
        self.checked += kept + (1 if kept < drafted else 0)
        self.held += kept

    def rate(self, prior: float, weight: float) -> float:
        """The estimate with ``weight`` pseudo-checks at ``prior``: a new sequence starts at the prior and
        moves to its own rate as its drafts are checked."""
        return (self.held + weight * prior) / (self.checked + weight)


# Pseudo-checks behind a sequence's estimate (its drafts so far weigh against the server's rate for its
# kind of request), and behind the server's rate until drafts have been checked. Drafts come only from
# matches of prompt_lookup_min or more tokens, whose drafts hold most of the time.
SEQUENCE_PRIOR_WEIGHT = 4.0
SERVER_PRIOR_WEIGHT = 16.0
SERVER_PRIOR = 0.8


class DraftPolicy:
    """How many draft tokens a sequence takes this step. A draft's i-th token adds a row costing
    ``row_cost`` and yields a token with probability ``rate ** i``; the step without drafts costs
    ``step_cost`` for its ``rows`` tokens. The token is worth its row when ``rate ** i * step_cost / rows``
    (what the step pays a token) exceeds ``row_cost``. Without a measured step cost every draft is taken."""

    def __init__(self) -> None:
        # checked draft positions of greedy and of sampled sequences, apart: sampled drafts hold less often
        self.server = {True: AcceptanceTally(), False: AcceptanceTally()}

    def record(self, seq: Sequence, drafted: int, kept: int) -> None:
        self.server[seq.params.is_greedy].add(drafted, kept)
        seq.draft_tally.add(drafted, kept)

    def rate(self, seq: Sequence) -> float:
        prior = self.server[seq.params.is_greedy].rate(SERVER_PRIOR, SERVER_PRIOR_WEIGHT)
        return seq.draft_tally.rate(prior, SEQUENCE_PRIOR_WEIGHT)

    def length(self, seq: Sequence, room: int, step_cost: float, rows: int, row_cost: float) -> int:
        """Draft tokens worth computing for ``seq``, at most ``room``."""
        if step_cost <= 0 or room <= 0:
            return max(room, 0)
        rate, worth = self.rate(seq), step_cost / max(rows, 1)
        n, chance = 0, 1.0
        while n < room:
            chance *= rate
            if chance * worth <= row_cost:
                break
            n += 1
        return n


class NgramProposer:
    """Drafts for the sequences that may take them: rows whose pick reads nothing but the logits and their
    bans (sampler.reads_only_logits), greedy or sampled, with room for more than one token."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        if num_tokens < 0 or min_n < 1 or max_n < min_n:
            raise ValueError(f"speculation needs num_speculative_tokens >= 0 and 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max (got {num_tokens}, {min_n}, {max_n})")
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n
        self.policy = DraftPolicy()
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

    def propose(self, seq: Sequence, step_cost: float = 0.0, rows: int = 1, row_cost: float = 1.0) -> list[int]:
        """A draft for ``seq``, as long as the policy finds worth it in a step of ``rows`` decode rows that
        costs ``step_cost`` (0: unknown, every draft taken) where one more row costs ``row_cost``."""
        room = self.policy.length(seq, self.room(seq), step_cost, rows, row_cost)
        if room <= 0:
            return []
        if seq.ngram_index is None:
            seq.ngram_index = NgramIndex(self.min_n, self.max_n)
        return seq.ngram_index.lookup(seq.token_ids, room)

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        self.num_drafted += drafted
        self.num_accepted += accepted
        self.policy.record(seq, drafted, accepted)


def accepted_prefix(draft: list[int], picks: list[int]) -> int:
    """How many draft tokens the model's picks confirm: picks[i] is its token after the draft's first i."""
    n = 0
    while n < len(draft) and picks[n] == draft[n]:
        n += 1
    return n
