"""Incremental detokenization that never emits half a UTF-8 character, and stop-string matching."""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded alongside the output, for tokenizers with context-dependent spaces


class IncrementalDetokenizer:
    """Turns the growing token list into text deltas (the vLLM prefix/read-offset method)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # slow tokenizers join special tokens with spaces unless told not to; fast ones never add them
        self.extra = {} if spaces_between_special_tokens else {"spaces_between_special_tokens": False}
        self._backend_decode = _backend_decoder(tokenizer, skip_special_tokens, self.extra)
        context = prompt_token_ids[-_PROMPT_CONTEXT:]
        self.tokens: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False, **self.extra)

    def add_tokens(self, token_ids: list[int]) -> str:
        self.tokens.extend(token_ids)
        prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return full_text[len(prefix_text):]
        return ""  # an incomplete character: wait for the next token


def _backend_decoder(tokenizer: Any, skip_special_tokens: bool,
                     extra: dict[str, Any]) -> Callable[[list[int]], str] | None:
    """The Rust tokenizer's own decode, where transformers' wrapper around it adds nothing (a fast
    tokenizer that overrides neither ``decode`` nor ``_decode``, no clean-up of spaces): the wrapper's
    argument checks cost ~4x the decode itself, twice per token per stream."""
    if extra or not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    cls = type(tokenizer)
    if cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not PreTrainedTokenizerFast._decode:
        return None
    backend = tokenizer._tokenizer
    return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)


class StopAutomaton:
    """One Aho-Corasick automaton over a request's stop strings, shared by its samples.

    Each node is a prefix of some stop string; its fail link leads to the longest proper suffix of that
    prefix that is also a node, ``out`` names the longest stop string ending there (its length and its
    position in the request's list) and ``depth`` is the prefix's length. Fed one character at a time, the
    current node spells the longest tail of the text that could still grow into a stop string: exactly what
    must be held back, and every match is seen at the character that completes it.

    The tables are built at the first feed, not at admission: a request waiting for a slot holds only its
    strings. They take about 100 bytes a character of the stop strings (bounded by --max-stop-chars)."""

    __slots__ = ("depth", "edges", "fail", "max_len", "out", "stops")

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.max_len = max((len(s) for s in stops), default=0)
        self.edges: dict[int, int] | None = None  # node << 21 | ord(char) -> node (21 bits hold any code point)

    def build(self) -> None:
        if self.edges is not None:
            return
        edges: dict[int, int] = {}
        children: list[list[int]] = [[]]  # the breadth-first walk below needs each node's (char, child) keys
        depth = array("i", [0])
        ends: list[int | None] = [None]  # the first stop (in list order) spelled by exactly this node
        for rank, stop in enumerate(self.stops):
            node = 0
            for ch in stop:
                key = node << 21 | ord(ch)
                nxt = edges.get(key)
                if nxt is None:
                    nxt = edges[key] = len(depth)
                    children[node].append(key)
                    children.append([])
                    depth.append(depth[node] + 1)
                    ends.append(None)
                node = nxt
            if ends[node] is None:
                ends[node] = rank
        fail = array("i", bytes(4 * len(depth)))
        out: list[tuple[int, int] | None] = [None] * len(depth)
        queue: deque[int] = deque()
        for key in children[0]:
            child = edges[key]
            end = ends[child]
            out[child] = (1, end) if end is not None else None
            queue.append(child)
        while queue:  # breadth first: a node's fail link is shallower, so already known
            node = queue.popleft()
            for key in children[node]:
                child, code = edges[key], key & 0x1FFFFF
                f = fail[node]
                while f and (f << 21 | code) not in edges:
                    f = fail[f]
                fail[child] = edges.get(f << 21 | code, 0)
                # the longest stop ending here: this node's own, else its fail node's (every stop that is a
                # suffix of this node's text is a suffix of the fail node's)
                end = ends[child]
                out[child] = (depth[child], end) if end is not None else out[fail[child]]
                queue.append(child)
        self.fail, self.out, self.depth = fail, out, depth
        self.edges = edges


class StopStringMatcher:
    """Holds back text that could still be the start of a stop string; reports the first match.

    The first match is the one starting earliest in the text not yet released (among those starting at the
    same place, the first in the request's list), as a ``find`` of every stop string would report. The work
    is linear in the text, whatever the number and length of the stop strings: each character moves the
    automaton once, plus fail links that never outnumber the characters fed (the state is carried between
    calls), and the text held back is at most the longest stop string less one character."""

    def __init__(self, stops: list[str], include_stop: bool, automaton: StopAutomaton | None = None) -> None:
        self.stops = stops
        self.include_stop = include_stop
        self.automaton = automaton if automaton is not None or not stops else StopAutomaton(stops)
        self.buffer = ""  # not released yet: it may be the start of a stop string
        self.node = 0  # the automaton's state after everything fed (it spells the end of ``buffer``)
        self.steps = 0  # automaton moves made so far (transitions and fail links): the matcher's work

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, matched stop string or None)."""
        a = self.automaton
        if a is None:
            return delta, None
        a.build()
        edges, fail, out = a.edges, a.fail, a.out
        assert edges is not None  # build() made it
        node = self.node
        base = len(self.buffer)
        best_start = best_len = best_rank = -1
        steps = 0
        for i, ch in enumerate(delta):
            code = ord(ch)
            while True:
                steps += 1
                nxt = edges.get(node << 21 | code)
                if nxt is not None:
                    node = nxt
                    break
                if node == 0:
                    break
                node = fail[node]
            found = out[node]
            if found is not None:
                length, rank = found
                start = base + i + 1 - length
                if best_start < 0 or start < best_start or (start == best_start and rank < best_rank):
                    best_start, best_len, best_rank = start, length, rank
            # a later match starting as early would be longer than the longest stop string
            if best_start >= 0 and base + i + 2 - best_start > a.max_len:
                break
        self.steps += steps
        text = self.buffer + delta
        if best_start >= 0:
            self.buffer, self.node = "", 0
            end = best_start + best_len if self.include_stop else best_start
            return text[:end], a.stops[best_rank]
        cut = len(text) - a.depth[node]
        self.buffer, self.node = text[cut:], node
        return text[:cut], None

    def flush(self) -> str:
        rest, self.buffer, self.node = self.buffer, "", 0
        return rest
