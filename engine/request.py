"""What goes into the engine (GenerationRequest) and what comes out (RequestOutput)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from engine.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(slots=True)
class ChatMessage:
    role: str
    content: str
    # for chat templates that render tool calls themselves: an assistant's calls
    # ([{"type": "function", "id", "function": {"name", "arguments": {...}}}]) and a tool result's call id
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    # an assistant turn's thinking, for templates that render it (Qwen3's keeps it only for turns after the
    # last user message and drops it otherwise); templates that do not know it leave it out
    reasoning_content: str | None = None


@dataclass(slots=True)
class ChatPrompt:
    messages: list[ChatMessage]
    chat_template_kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool = True  # open an assistant turn after the messages
    continue_final_message: bool = False  # leave the last (assistant) message open, to be continued
    chat_template: str | None = None  # a Jinja template replacing the model's own for this request
    tools: list[dict] | None = None  # function tools, for templates that render them themselves
    add_special_tokens: bool = False  # BOS etc. on top of what the template writes
    # the messages already templated and tokenized by this engine's tokenizer (Spark's history fitting
    # does it once; the engine then takes them as they are)
    token_ids: list[int] | None = None


@dataclass(slots=True)
class TextPrompt:
    text: str
    add_special_tokens: bool = True


@dataclass(slots=True)
class TokensPrompt:
    token_ids: list[int]


Prompt = ChatPrompt | TextPrompt | TokensPrompt


@dataclass(slots=True, frozen=True)
class LoraRef:
    """A LoRA adapter: a pack to fetch (url + md5) or a registered name. Before the engine core sees it,
    the resolver fills ``name`` (what logs and metrics show), ``path`` (the unpacked adapter) and
    ``identity``: what the engine caches the adapter's weights and slot under. A name is chosen by
    people; the identity is the content's (``md5:<pack md5>``) or one fresh per registration of a
    directory (``dir:<uuid>``), so two adapters that share a name never share weights."""

    url: str | None = None
    md5: str | None = None
    name: str | None = None
    path: str | None = None
    identity: str | None = None


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt: Prompt
    params: SamplingParams = field(default_factory=SamplingParams)
    lora: LoraRef | None = None
    priority: int = 5  # 1 (most urgent) .. 5, as Triton / MindIE (their default: 5)
    deadline: float | None = None  # time.monotonic() after which the request is ended
    arrival_time: float = field(default_factory=time.monotonic)
    # who sent it, as an opaque name the serving layer chooses (a credential's name, else the peer's
    # address): when the running slots are full, the scheduler admits waiting requests round-robin across
    # these names within a priority, so one client's queue cannot starve another (None: one anonymous client)
    client: str | None = None


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class RequestTimings:
    arrival: float = 0.0
    queue_s: float = 0.0  # arrival -> first scheduled
    first_token_s: float | None = None  # arrival -> first output token
    prefill_s: float = 0.0  # first scheduled -> first output token
    decode_s: float = 0.0  # first token -> last token
    last_token_gap_s: float = 0.0  # gap before the newest token


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    index: int  # which of the request's n samples (0 when n == 1)
    new_token_ids: list[int]
    text_delta: str  # the text released with these tokens (held back while a stop string may be forming)
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, on a sample's first output
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the matched stop string or stop token id
    error: str | None = None
    # why finish_reason is "error": the deadline, a failed step, or a request the model cannot serve
    # (a constraint needing text its vocabulary cannot spell)
    error_kind: Literal["timeout", "inference", "invalid"] | None = None
    timings: RequestTimings = field(default_factory=RequestTimings)
    # the text each of new_token_ids released (they add up to text_delta, less text released with no
    # token); outputs merged for a slow consumer keep each token's own text
    token_texts: list[str] | None = None
    # a pooling request's answer, on its one (final) output: a vector, or one per token (engine/pooling.py)
    pooled: list | None = None

    def texts_per_token(self) -> list[str]:
        """One text per new token (the last also carries text released without a token)."""
        if self.token_texts is not None and len(self.token_texts) == len(self.new_token_ids):
            texts = list(self.token_texts)
            extra = self.text_delta[len("".join(texts)):] if self.text_delta.startswith("".join(texts)) else ""
            if texts and extra:
                texts[-1] += extra
            return texts
        return [""] * (len(self.new_token_ids) - 1) + [self.text_delta] if self.new_token_ids else []

    def merge(self, later: RequestOutput) -> RequestOutput:
        """Fold a later output of the same sample into this one (for consumers that fall behind)."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        return RequestOutput(
            request_id=self.request_id,
            index=self.index,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            text_delta=self.text_delta + later.text_delta,
            num_prompt_tokens=later.num_prompt_tokens,
            num_output_tokens=later.num_output_tokens,
            num_cached_tokens=later.num_cached_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            finished=later.finished,
            finish_reason=later.finish_reason,
            stop_reason=later.stop_reason,
            error=later.error,
            error_kind=later.error_kind,
            timings=later.timings,
            token_texts=self.texts_per_token() + later.texts_per_token(),
            pooled=later.pooled if later.pooled is not None else self.pooled,
        )
