"""A scripted engine behind the same ``EngineClient`` face as the real one, for protocol tests that
need no model: lowering (what reached the engine), rendering (what the client saw) and error mapping
(an engine failure before or after the first token), in milliseconds per request.

It answers with the real tokenizer of the embedded model, so token ids, texts and counts are real."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

import torch

from engine.errors import InvalidRequestError
from engine.model_loader import resolve_model_dir
from engine.pooling import PoolingOutput, PoolingRequest, activate, check_dimensions, finish_embedding, served_tasks
from engine.protocol import EngineLimits, EngineStats, FinishedNotice, ModelInfo
from engine.request import (
    FinishReason,
    GenerationRequest,
    Prompt,
    RequestOutput,
    RequestTimings,
    TextPrompt,
    TokenLogprob,
    TokensPrompt,
)

FAKE_MODEL = "fake-model"
FAKE_HIDDEN = 16  # the fake's embedding size


def fake_vector(token_ids: list[int]) -> list[float]:
    """The fake engine's hidden state of a prompt: a fixed function of its token ids (not normalised)."""
    return [sum(math.cos(0.37 * (t + 1) * (j + 1) + 0.11 * k) for k, t in enumerate(token_ids))
            for j in range(FAKE_HIDDEN)]
DEFAULT_ANSWER = "Hello from the scripted engine."


def fake_prompt_logprobs(prompt_ids: list[int], top: int | None) -> list[TokenLogprob | None] | None:
    """The engine's prompt_logprobs form: None for the first token, then position p's logprob -p / 10 (a
    value each position can be told by) with ``top`` candidates."""
    if top is None:
        return None
    return [None] + [TokenLogprob(t, -p / 10, [(t, -p / 10)] * top) for p, t in enumerate(prompt_ids[1:], 1)]


@dataclass
class Script:
    """What the next requests get. ``fail_before``: raised before the first output; ``fail_after``:
    raised after that many tokens were streamed (an error mid-stream)."""

    answer: str = DEFAULT_ANSWER
    finish_reason: FinishReason = "stop"  # "stop" (end of answer), or "length" when max_tokens cuts it
    fail_before: BaseException | None = None
    fail_after: tuple[int, BaseException] | None = None
    token_delay_s: float = 0.0
    burst: int = 1  # tokens per output: >1 is what a consumer that fell behind receives (merged outputs)


_TOKENIZER = None


def shared_tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        from transformers import AutoTokenizer

        _TOKENIZER = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    return _TOKENIZER


@dataclass
class FakeEngine:
    script: Script = field(default_factory=Script)
    max_model_len: int = 8192
    lora_enabled: bool = False
    requests: list[GenerationRequest] = field(default_factory=list)  # every request that reached the engine
    finished_listeners: list[Callable[[RequestOutput], None]] = field(default_factory=list)
    limits: EngineLimits = field(default_factory=EngineLimits)
    healthy: bool = True
    active: int = 0
    # pooling: the server's task, its head's labels (a classify / score model), whether it is Matryoshka,
    # and every pooling request that reached the engine
    task: str = "generate"
    labels: tuple[str, ...] = ()
    matryoshka: bool = False
    pooling_requests: list[PoolingRequest] = field(default_factory=list)
    recommended_sampling: tuple[tuple[str, float | int], ...] = ()  # the model's generation_config.json's

    def __post_init__(self) -> None:
        self.tokenizer = shared_tokenizer()
        self.model_info = ModelInfo(name=FAKE_MODEL, path="/fake/model", model_type="llama",
                                    max_model_len=self.max_model_len, vocab_size=len(self.tokenizer),
                                    dtype="bfloat16", device="cpu", task=self.task,
                                    pooling_tasks=served_tasks(self.task, len(self.labels)), labels=self.labels,
                                    recommended_sampling=self.recommended_sampling)

    # ---- lifecycle and introspection -----------------------------------------------------------

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def fail_all(self, exc: BaseException) -> None: ...

    def is_healthy(self) -> bool:
        return self.healthy

    def stats(self) -> EngineStats:
        return EngineStats(num_requests_running=self.active)

    @property
    def num_active_requests(self) -> int:
        return self.active

    def check_adapter(self, path: str, name: str) -> None: ...

    def register_adapter(self, path: str, name: str, identity: str) -> None: ...

    def forget_adapter(self, identity: str) -> None: ...

    # ---- tokens --------------------------------------------------------------------------------

    def encode_prompt_sync(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, TokensPrompt):
            return list(prompt.token_ids)
        if isinstance(prompt, TextPrompt):
            return self.tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        messages = [{"role": m.role, "content": m.content} for m in prompt.messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                  **prompt.chat_template_kwargs)

    async def encode_prompt(self, prompt: Prompt) -> list[int]:
        return self.encode_prompt_sync(prompt)

    def min_num_tokens(self, texts: list[str]) -> int:
        return sum(len(t.encode()) for t in texts) // 32

    async def abort(self, request_id: str) -> None: ...

    # ---- pooling -------------------------------------------------------------------------------

    async def pool(self, request: PoolingRequest) -> PoolingOutput:
        """Deterministic answers from the prompt's token ids (fake_vector): an embedding of FAKE_HIDDEN values,
        or the first len(labels) of them as a head's logits; refused as the real engine refuses."""
        self.pooling_requests.append(request)
        if self.script.fail_before is not None:
            raise self.script.fail_before
        p = request.params
        if p.task not in self.model_info.pooling_tasks:
            raise InvalidRequestError(f"the served model does not support the '{p.task}' pooling task",
                                      parameter="task")
        embeds = p.task == "embed" or (p.task == "encode" and not self.labels)
        if embeds:
            check_dimensions(p.dimensions, FAKE_MODEL, self.matryoshka, None, FAKE_HIDDEN)
        elif p.dimensions is not None:
            raise InvalidRequestError("dimensions applies to embeddings only", parameter="dimensions")
        ids = self.encode_prompt_sync(request.prompt)
        if p.truncate_prompt_tokens:
            ids = ids[-p.truncate_prompt_tokens:]
        vector = torch.tensor(fake_vector(ids))
        if embeds:
            data = finish_embedding(vector, p.dimensions, p.normalize is not False).tolist()
        else:
            logits = vector[:len(self.labels)] * 3
            data = (activate(logits) if p.activation is not False else logits).tolist()
        return PoolingOutput(request.request_id, data, len(ids))

    # ---- generation ----------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        script = self.script
        self.requests.append(request)
        if script.fail_before is not None:
            raise script.fail_before
        prompt_ids = self.encode_prompt_sync(request.prompt)
        p = request.params
        # a stop string ends the scripted answer where it first occurs (kept only when asked), as the
        # real engine's stop strings do: finish "stop" with the string as the stop reason
        text, matched = script.answer, None
        hits = [(text.find(s), s) for s in p.stop if s in text]
        if hits:
            at, matched = min(hits)
            text = text[:at + (len(matched) if p.include_stop_str_in_output else 0)]
        answer = self.tokenizer.encode(text, add_special_tokens=False)
        ids = answer[:p.max_tokens]
        reason = "length" if len(answer) > p.max_tokens else ("stop" if matched else script.finish_reason)
        stop_reason = matched if reason == "stop" else None
        self.active += 1
        started = time.monotonic()
        notice = FinishedNotice(self.finished_listeners)
        try:
            for index in range(p.n):
                text = ""
                pending: RequestOutput | None = None
                if not ids:  # nothing left before the stop string: one finished output without text, as the
                    # real engine ends such an answer (never a stream with no output at all)
                    empty = RequestOutput(request_id=request.request_id, index=index, new_token_ids=[], text_delta="",
                                          num_prompt_tokens=len(prompt_ids), num_output_tokens=0, finished=True,
                                          finish_reason=reason, stop_reason=stop_reason,
                                          timings=RequestTimings(arrival=request.arrival_time, queue_s=0.001,
                                                                 first_token_s=None, prefill_s=0.001, decode_s=0.0,
                                                                 last_token_gap_s=0.0))
                    notice.saw(empty)
                    yield empty
                for k, tid in enumerate(ids):
                    if script.fail_after is not None and k == script.fail_after[0]:
                        raise script.fail_after[1]
                    if script.token_delay_s:
                        await asyncio.sleep(script.token_delay_s)
                    full = self.tokenizer.decode(ids[:k + 1])
                    delta, text = full[len(text):], full
                    last = k == len(ids) - 1
                    out = RequestOutput(
                        request_id=request.request_id, index=index, new_token_ids=[tid], text_delta=delta,
                        num_prompt_tokens=len(prompt_ids), num_output_tokens=k + 1,
                        logprobs=[TokenLogprob(tid, -0.5, [(tid, -0.5)] * p.top_logprobs)] if p.logprobs else None,
                        prompt_logprobs=(fake_prompt_logprobs(prompt_ids, p.prompt_logprobs)
                                         if k == index == 0 else None),
                        finished=last, finish_reason=reason if last else None,
                        stop_reason=stop_reason if last else None,
                        timings=RequestTimings(arrival=request.arrival_time, queue_s=0.001, first_token_s=0.002,
                                               prefill_s=0.001, decode_s=time.monotonic() - started,
                                               last_token_gap_s=0.001))
                    pending = out if pending is None else pending.merge(out)
                    if last or len(pending.new_token_ids) >= script.burst:
                        notice.saw(pending)
                        yield pending
                        pending = None
        finally:
            self.active -= 1
            notice.abandoned()
