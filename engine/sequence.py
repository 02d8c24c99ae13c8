"""Per-request state inside the engine core."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

import torch

from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.request import GenerationRequest, RequestTimings, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.speculation import AcceptanceTally

if TYPE_CHECKING:
    from engine.lora import LoraAdapter
    from engine.pooling import PoolingState
    from engine.speculation import NgramIndex


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request: GenerationRequest, prompt_token_ids: list[int],
                 detokenizer: IncrementalDetokenizer, max_model_len: int, cache_salt: str = "",
                 index: int = 0, seed: int | None = None, stop_matcher: StopStringMatcher | None = None,
                 wait_for: Sequence | None = None, lora_adapter: LoraAdapter | None = None,
                 matcher: Any = None) -> None:
        self.request_id = request.request_id
        self.index = index  # which of the request's n samples
        self.wait_for = wait_for  # a sibling whose prompt KV this one reuses once cached
        self.params: SamplingParams = request.params
        self.priority = request.priority
        self.deadline = request.deadline
        self.arrival_time = request.arrival_time
        self.client = request.client  # fair share between clients while waiting (engine/scheduler.py)
        self.fair_tag = 0  # the scheduler's place for it in the wait queue, among its priority's
        self.cache_salt = cache_salt  # separates prefix-cache entries (e.g. per LoRA adapter)
        self.lora_name = request.lora.name if request.lora is not None else None
        self.lora_adapter = lora_adapter  # loaded before admission: scheduling does no disk I/O
        self.lora_key = lora_adapter.key if lora_adapter is not None else None  # its identity: slots go by it
        self.matcher = matcher  # structured output: the grammar's state after this sequence's output so far
        # a leading section (SamplingParams.leading_section) is open from the first output token: the
        # grammar waits in ``pending_matcher`` until it closes, and a capped one has its closing ids
        # forced, one per step, from ``forced_token_ids``
        self.section_open = self.params.leading_section is not None
        self.pending_matcher: Any = None
        if self.section_open:
            self.pending_matcher, self.matcher = matcher, None
        self.forced_token_ids: list[int] = []
        # logit_bias split once (SamplingParams.bans_and_bias): its bans join banned_token_ids in ``bans``
        # (sampler.banned_ids), the other biases are added to every step's logits (sampler.apply_bias)
        self.bans, bias = self.params.bans_and_bias()
        self.bias_ids = torch.tensor([t for t, _ in bias], dtype=torch.long) if bias else None
        self.bias_values = torch.tensor([b for _, b in bias], dtype=torch.float32) if bias else None
        self.lora_slot = -1  # resident adapter slot while running; -1 = base model
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.max_total_len = min(max_model_len, self.num_prompt_tokens + self.params.max_tokens)
        self.detokenizer = detokenizer
        self.pending_logprobs: list[TokenLogprob] = []
        # prompt_logprobs: one entry per prompt token after the first, filled as the prompt is computed
        # (by the first sample only: they are the request's, and its siblings reuse its prompt KV)
        wants = self.params.prompt_logprobs is not None and index == 0
        self.prompt_logprobs: list[TokenLogprob] | None = [] if wants else None
        self.num_emitted_prompt_logprobs = 0
        self.generator = torch.Generator()
        self.generator.manual_seed(seed % (1 << 64) if seed is not None else torch.seed() & 0x7FFF_FFFF_FFFF_FFFF)
        self.stop_matcher = stop_matcher or StopStringMatcher([], False)
        self.timings = RequestTimings(arrival=request.arrival_time)
        self.first_scheduled: float | None = None
        self.last_token_time: float | None = None
        self.num_emitted_tokens = 0
        # the distinct ids seen so far (repetition penalty), brought up to date on demand
        self._seen: set[int] = set()
        self._seen_upto = 0
        self._seen_ids: torch.Tensor | None = None
        # prompt-lookup speculation (engine/speculation.py): tokens proposed to follow token_ids[-1], computed
        # with it in this step's decode rows (the scheduler may shorten them), and the n-gram index behind them
        self.draft_token_ids: list[int] = []
        self.ngram_index: NgramIndex | None = None
        self.draft_tally = AcceptanceTally()  # how often this sequence's drafts held (DraftPolicy)
        # a sampled sequence with a draft: its generator's state before the step drew a uniform per row, so
        # it can be left having drawn only for the tokens kept (LLMEngine._take_picks)
        self.rng_before_draft: torch.Tensor | None = None
        # a pooling request's state (engine/pooling.py): it samples nothing, and ends when its prompt is computed
        self.pooling: PoolingState | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def kv_only_prefix(self) -> int:
        """The leading positions whose rows, computed in a first pass, only write the KV cache (nothing reads
        their output): the prompt less its last token; none where the prompt's logprobs are read."""
        return 0 if self.params.prompt_logprobs is not None else self.num_prompt_tokens - 1

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def decodes_next(self) -> bool:
        """Whether its next step is a decode: one token left to compute, an answer's (past the prompt). A
        prompt's rows always go through the prefill path, its last one included, so a prompt's logits do not
        depend on how much of it the prefix cache held or where its chunks ended (the decode and prefill
        attention kernels round differently)."""
        return self.num_uncomputed_tokens == 1 and self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def is_blocked(self) -> bool:
        """Waiting for a sibling to finish its prompt, so the prompt's KV can be shared."""
        w = self.wait_for
        if w is None:
            return False
        if w.status == SequenceStatus.FINISHED or w.num_computed_tokens >= w.num_prompt_tokens:
            self.wait_for = None
            return False
        return True

    def seen_token_ids(self) -> torch.Tensor:
        """The distinct token ids of prompt and output so far, in first-seen order (the repetition penalty's
        set): only the tokens added since the last call are looked at, so a long prompt is walked once."""
        n = len(self.token_ids)
        if n < self._seen_upto:  # the list was cut back: start again
            self._seen, self._seen_upto, self._seen_ids = set(), 0, None
        fresh: list[int] = []
        for t in self.token_ids[self._seen_upto:]:
            if t not in self._seen:
                self._seen.add(t)
                fresh.append(t)
        self._seen_upto = n
        if fresh or self._seen_ids is None:
            added = torch.tensor(fresh, dtype=torch.long)
            self._seen_ids = added if self._seen_ids is None else torch.cat([self._seen_ids, added])
        return self._seen_ids

    def mark_scheduled(self) -> None:
        if self.first_scheduled is None:
            self.first_scheduled = time.monotonic()
            self.timings.queue_s = self.first_scheduled - self.arrival_time

    def append_token(self, token_id: int) -> None:
        now = time.monotonic()
        self.token_ids.append(token_id)
        if self.last_token_time is None:
            self.timings.first_token_s = now - self.arrival_time
            self.timings.prefill_s = now - (self.first_scheduled or now)
        else:
            self.timings.last_token_gap_s = now - self.last_token_time
            self.timings.decode_s = now - (self.arrival_time + (self.timings.first_token_s or 0.0))
        self.last_token_time = now

    def reset_for_recompute(self) -> None:
        """Preempted: its cache is gone, everything so far (prompt + outputs) is recomputed."""
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table = []
        self.draft_token_ids = []
        self.status = SequenceStatus.WAITING
