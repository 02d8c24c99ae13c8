"""Reasoning output: a thinking model's answer split into its reasoning and its content, as vLLM's
``--reasoning-parser`` does. Protocol-side only: the engine sees, at most, the token ids that close the
thinking (``leading_section``: structured output starts after them, a thinking budget forces them).

Public API (for every endpoint that renders reasoning):

- ``get_parser(name)``: the parser a setting names (``PARSERS``), or None for no name.
- ``ReasoningParser.start_state(prompt_tail)``: where the answer begins, from the end of its prompt.
- ``ReasoningParser.splitter(state)``: a ``ReasoningSplitter``: ``feed(text_delta) -> (reasoning_delta,
  content_delta)`` once per output token, ``finish()`` at the end, ``reasoning_tokens`` counted.
- ``ReasoningParser.split(text, state)``: the one-shot form, ``(reasoning | None, content | None)``.
- ``ReasoningParser.end_token_ids(tokenizer)``: the closing tag's ids, for the engine's leading section.
- ``prepare(engine, parser, request, budget)``: at lowering, the answer's start state, and the engine's
  part (structured output after the thinking, a thinking budget); ``feed_output`` for engine outputs.

The rules (vLLM's, made to agree between streamed and whole answers):

- ``deepseek_r1``: the answer begins inside the thinking (the template may already have opened
  ``<think>``): text before ``</think>`` is reasoning even with no opening tag; a leading ``<think>`` is
  dropped; with no ``</think>`` at all the whole answer is reasoning.
- ``qwen3``: the answer thinks only when it opens with ``<think>``, or when the prompt's end opened it
  (thinking-only templates write ``<think>`` into the prompt); then text up to ``</think>`` is reasoning.
  An answer that opens otherwise is all content. (vLLM streams text with no opening tag as reasoning but
  returns it whole as content; one rule for both is this one.)
- ``granite``: "Here's my thought process:" (or "Here is ...") opens the thinking and "Here's my
  response:" (or "Here is ...") ends it; text markers, never read from the prompt.
- For the token-tag parsers, a prompt that ends with the closing tag (``enable_thinking: false`` in
  Qwen3's template writes an empty ``<think></think>``) starts the answer after the thinking: no reasoning.
- After the thinking ends, everything is content, tags included. Tags split across deltas are held back
  until they are known; a partial tag left at the end is text of the part it was in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from bridges.common import BridgeError
from engine.request import ChatPrompt, GenerationRequest
from engine.sampling_params import LeadingSection

State = Literal["thinking", "undecided", "answer"]


@dataclass(frozen=True)
class ReasoningParser:
    """One model family's thinking markers and where its answers begin."""

    name: str
    start_tags: tuple[str, ...]
    end_tags: tuple[str, ...]
    starts_thinking: bool  # with nothing in the prompt: the answer begins inside the thinking
    tags_are_tokens: bool  # the tags are tokens the template writes: the prompt's end is read, ids used

    def start_state(self, prompt_tail: str = "") -> State:
        """Where an answer begins, from the end of its prompt's text (the last few tokens are enough)."""
        if self.tags_are_tokens:
            tail = prompt_tail.rstrip()
            if tail.endswith(self.end_tags):
                return "answer"
            if tail.endswith(self.start_tags):
                return "thinking"
        return "thinking" if self.starts_thinking else "undecided"

    def splitter(self, state: State | None = None) -> ReasoningSplitter:
        """``state``: ``start_state``'s (default: with no prompt read)."""
        return ReasoningSplitter(self, state or self.start_state())

    def split(self, text: str, state: State | None = None) -> tuple[str | None, str | None]:
        """A whole answer as (reasoning or None when it did not think, content or None when empty)."""
        s = self.splitter(state)
        reasoning, content = s.feed(text)
        more_reasoning, more_content = s.finish()
        content += more_content
        return (reasoning + more_reasoning if s.thought else None), (content or None)

    def end_token_ids(self, tokenizer: Any) -> tuple[int, ...] | None:
        """The ids of the (first) closing tag as one token, or None when the tags are text or the vocabulary
        does not hold it as one token (a structured-output gate or budget then cannot be placed)."""
        if not self.tags_are_tokens:
            return None
        ids = tokenizer.convert_tokens_to_ids(self.end_tags[0])
        unk = getattr(tokenizer, "unk_token_id", None)
        return (ids,) if isinstance(ids, int) and ids != unk else None

    def has_tag_tokens(self, tokenizer: Any) -> bool:
        """Whether the vocabulary holds the tags as single tokens (vLLM refuses a parser otherwise)."""
        if not self.tags_are_tokens:
            return True
        unk = getattr(tokenizer, "unk_token_id", None)
        ids = [tokenizer.convert_tokens_to_ids(t) for t in (self.start_tags[0], self.end_tags[0])]
        return all(isinstance(i, int) and i != unk for i in ids)


class ReasoningSplitter:
    """Splits a streamed answer into reasoning and content deltas, holding back only what may still be a
    tag. Feed it once per output token (several tokens' text at once is fine for the text; the token
    count then counts that call as one token)."""

    def __init__(self, parser: ReasoningParser, state: State) -> None:
        self.parser = parser
        self.state: State = state
        self.buffer = ""
        self.fresh = True  # nothing consumed yet: a leading opening tag may still come (and is dropped)
        self.thought = state == "thinking"  # some of the answer was in the thinking
        self.reasoning_tokens = 0
        self._undecided_tokens = 0

    def feed(self, text: str, tokens: int = 1) -> tuple[str, str]:
        """(reasoning delta, content delta) for the next piece of the answer."""
        thinking_before = self.state != "answer"
        undecided_before = self.state == "undecided"
        self.buffer += text
        reasoning, content = self._drain(final=False)
        if undecided_before and self.state == "undecided":
            self._undecided_tokens += tokens
        elif undecided_before and self.state == "thinking":
            self.reasoning_tokens += self._undecided_tokens + tokens
        elif thinking_before and not undecided_before:
            self.reasoning_tokens += tokens  # the token that closes the thinking is the thinking's
        elif undecided_before and self.thought:  # opened and closed within this piece
            self.reasoning_tokens += self._undecided_tokens + tokens
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the answer."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        p = self.parser
        while True:
            if self.state == "answer":
                content += self.buffer
                self.buffer = ""
                return reasoning, content
            if self.fresh:  # an opening tag (after whitespace) may lead; the undecided wait to see it
                lead = self.buffer.lstrip()
                tag = next((t for t in p.start_tags if lead.startswith(t)), None)
                if tag is not None:
                    self.buffer = lead[len(tag):]
                    self.fresh = False
                    self.state = "thinking"
                    self.thought = True
                    continue
                if not final and (not lead or any(t.startswith(lead) for t in p.start_tags)):
                    return reasoning, content  # still possibly an opening tag
                self.fresh = False
                if self.state == "undecided":
                    self.state = "answer"
                    continue
            # thinking: up to the earliest closing tag
            hits = [(i, t) for t in p.end_tags if (i := self.buffer.find(t)) >= 0]
            if hits:
                i, tag = min(hits)
                reasoning += self.buffer[:i]
                self.buffer = self.buffer[i + len(tag):]
                self.state = "answer"
                continue
            keep = 0 if final else max(_partial_suffix(self.buffer, t) for t in p.end_tags)
            reasoning += self.buffer[:len(self.buffer) - keep]
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return reasoning, content


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


_THINK = ("<think>",), ("</think>",)
_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", *_THINK, starts_thinking=True, tags_are_tokens=True),
    "qwen3": ReasoningParser("qwen3", *_THINK, starts_thinking=False, tags_are_tokens=True),
    "granite": ReasoningParser("granite", ("Here's my thought process:", "Here is my thought process:"),
                               ("Here's my response:", "Here is my response:"), starts_thinking=False,
                               tags_are_tokens=False),
}
PARSERS = tuple(_PARSERS)  # --reasoning-parser choices


def get_parser(name: str | None) -> ReasoningParser | None:
    """The parser a setting names; None for none. ValueError naming the choices for an unknown name."""
    if name is None:
        return None
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"reasoning parser {name!r} is not one of {', '.join(PARSERS)}") from None


def check_reasoning_parser(name: str | None, tokenizer: Any) -> None:
    """At start: a token-tag parser needs its tags as single tokens of the served model's vocabulary (vLLM
    refuses the parser otherwise); a model without them does not think in that form."""
    parser = get_parser(name)
    if parser is not None and not parser.has_tag_tokens(tokenizer):
        raise ValueError(f"--reasoning-parser {name}: this model's vocabulary has no {parser.start_tags[0]} / "
                         f"{parser.end_tags[0]} tokens, so it does not think in that form")


def feed_output(splitter: ReasoningSplitter, token_texts: list[str], untokened: str = "",
                final: bool = False) -> tuple[str, str]:
    """(reasoning, content) of one engine output: ``token_texts`` one text per new token (each counted),
    ``untokened`` text released with no token, ``final`` at the answer's end (held text flushed)."""
    reasoning = content = ""
    pieces = [(t, 1) for t in token_texts] + ([(untokened, 0)] if untokened else [])
    for text, tokens in pieces:
        r, c = splitter.feed(text, tokens)
        reasoning, content = reasoning + r, content + c
    if final:
        r, c = splitter.finish()
        reasoning, content = reasoning + r, content + c
    return reasoning, content


PROMPT_TAIL_TOKENS = 8  # how much of a prompt's end is read for an opened or closed thinking tag


async def prepare(engine: Any, parser: ReasoningParser, req: GenerationRequest, budget: int | None = None,
                  budget_field: str = "reasoning_max_tokens") -> State:
    """Where the answer of ``req`` begins, read from its prompt's end (a chat prompt is templated here once,
    and the engine takes those ids), and what the engine must know: while the answer may still be
    thinking, its structured-output constraint waits for the closing tag, and ``budget`` caps the thinking
    (FastDeploy's reasoning_max_tokens: when that many tokens were generated the closing tag is forced, as
    FastDeploy's engine does). A prompt that closed the thinking needs neither."""
    state = parser.start_state()
    # a prompt to be cut (truncate_prompt_tokens) is templated by the engine alone: it may exceed the context
    if parser.tags_are_tokens and req.params.truncate_prompt_tokens is None:
        ids = await engine.encode_prompt(req.prompt)
        if isinstance(req.prompt, ChatPrompt):
            req.prompt.token_ids = ids
        state = parser.start_state(engine.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False))
    p = req.params
    if state == "answer" or (p.constraint is None and budget is None):
        return state
    end = parser.end_token_ids(engine.tokenizer)
    if end is None:
        if budget is not None:
            raise BridgeError(400, f"{budget_field}: the {parser.name} reasoning parser's markers are text, not "
                                   "tokens, so the thinking cannot be capped", param=budget_field)
        return state  # text markers: a constraint applies from the answer's start (as without thinking)
    field = budget_field if budget is not None else p.constraint.field if p.constraint else budget_field
    p.leading_section = LeadingSection(end, budget, field)
    return state
