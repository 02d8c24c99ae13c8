"""Incremental detokenization that never emits half a UTF-8 character, and stop-string matching."""

from __future__ import annotations

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


class StopStringMatcher:
    """Holds back text that could still be the start of a stop string; reports the first match."""

    def __init__(self, stops: list[str], include_stop: bool) -> None:
        self.stops = stops
        self.include_stop = include_stop
        self.buffer = ""

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, matched stop string or None)."""
        if not self.stops:
            return delta, None
        self.buffer += delta
        best: tuple[int, str] | None = None
        for stop in self.stops:
            idx = self.buffer.find(stop)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is not None:
            idx, stop = best
            emit = self.buffer[: idx + len(stop)] if self.include_stop else self.buffer[:idx]
            self.buffer = ""
            return emit, stop
        hold = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.buffer)), hold, -1):
                if self.buffer.endswith(stop[:n]):
                    hold = n
                    break
        emit = self.buffer[: len(self.buffer) - hold]
        self.buffer = self.buffer[len(self.buffer) - hold:]
        return emit, None

    def flush(self) -> str:
        rest, self.buffer = self.buffer, ""
        return rest
