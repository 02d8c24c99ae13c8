"""The synchronous engine core: add_request / step / abort, driven by one loop (loading: engine/loader.py)."""

from __future__ import annotations

import copy
import logging
import os
import random
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, StopAutomaton, StopStringMatcher
from engine.errors import EngineOverloadedError, InvalidRequestError, LoraUnavailableError, PromptTooLongError
from engine.grammar_worker import first_line
from engine.loader import Loaded, load
from engine.lora import LoraAdapter, LoraManager, read_adapter
from engine.model_runner import ModelRunner, PromptLogits
from engine.pooling import PoolingParams, PoolingRequest
from engine.prompts import PromptEncoder
from engine.protocol import EngineStats
from engine.request import ChatPrompt, GenerationRequest, Prompt, RequestOutput, TokenLogprob
from engine.sampler import reads_only_logits, sample
from engine.sampling_params import SamplingParams
from engine.scheduler import LONG_PREFILL_SHARE, Scheduler
from engine.sequence import Sequence
from engine.speculation import NgramProposer, accepted_prefix
from engine.structured import CompiledGrammar, Constraint, GrammarCompiler, MaskApplier, PreparedMasks

logger = logging.getLogger(__name__)


_GRAMMAR_LIMITS = ("LexerTooComplex", "ParserTooComplex")  # llguidance's stop reasons for its own limits


def _path_identity(path: str) -> str:
    """An adapter directory's identity for callers that bring none (the engine used directly): the
    directory with its files' sizes and modification times, so rewritten weights are read again."""
    parts = [os.path.realpath(path)]
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        try:
            st = os.stat(os.path.join(path, file))
            parts.append(f"{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            parts.append("-")
    return "path:" + "|".join(parts)


def record_prompt_logprobs(chunk: PromptLogits) -> None:
    """The logprob of each prompt token after ``chunk.start`` (and the top candidates, if asked)."""
    seq = chunk.seq
    recorded = seq.prompt_logprobs
    assert recorded is not None  # the model returns prompt logits only for a sequence that asked for them
    logprobs = chunk.logits.log_softmax(-1)
    targets = torch.tensor(seq.prompt_token_ids[chunk.start + 1:chunk.start + 1 + logprobs.shape[0]])
    chosen = logprobs.gather(-1, targets[:, None]).squeeze(-1).tolist()
    k = seq.params.prompt_logprobs or 0
    tops = logprobs.topk(k, dim=-1) if k else None
    for i, (tid, lp) in enumerate(zip(targets.tolist(), chosen)):
        if chunk.start + i < len(recorded):  # recomputed after a preemption: already known
            continue
        top = list(zip(tops.indices[i].tolist(), tops.values[i].tolist())) if tops is not None else []
        recorded.append(TokenLogprob(tid, lp, top))


class EngineCore:
    """The serving core over a loaded model (engine/loader.py): add_request / step / abort, driven by one
    loop. Building it loads nothing: scheduler, runner, speculator, adapters and the prompt encoder only."""

    def __init__(self, config: EngineConfig, loaded: Loaded) -> None:
        self.config = config
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.device, self.dtype = loaded.device, loaded.dtype
        self.quantization, self.max_model_len, self.pooler = loaded.quantization, loaded.max_model_len, loaded.pooler
        self.model_info, self.eos_token_ids = loaded.model_info, list(loaded.eos_token_ids)
        self.kv_prefault = loaded.kv_prefault
        self.packed_cache = loaded.packed_cache  # its copy on disk is finished on a thread (engine/packed_cache.py)
        if self.kv_prefault is not None:  # the pass pauses while requests run or wait (engine/resident.py)
            self.kv_prefault.busy = self._has_work
        self._unseeded = random.Random(config.seed)  # seeds samples that bring none (--seed: reproducible)
        self._build_step(loaded)
        self._grammars: GrammarCompiler | None = None  # structured output, made at its first use
        self._masks: MaskApplier | None = None
        self._grammars_lock = threading.Lock()
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its n sequences still running
        # Read and checked adapters, by identity (LoraRef.identity), never by name: names are chosen by
        # people, so a cache by name would hand one tenant's weights to the next request naming them.
        # Session packs share a bounded LRU among themselves; the operator's registered adapters are
        # pinned (register_adapter) and never evicted by them.
        self._adapters: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._pinned: dict[str, tuple[LoraAdapter, int]] = {}  # identity -> (adapter, registrations)
        self._adapters_lock = threading.Lock()
        self.prompts = PromptEncoder(self.tokenizer, self.max_model_len, self.model_info.vocab_size)
        self.num_aborted = 0
        self.fault_hook: Any = None  # test hook: called before every model step
        self._log_ready(loaded.started)

    def _build_step(self, loaded: Loaded) -> None:
        """Block manager, LoRA slots, scheduler, runner and speculator: what a step runs on."""
        config = self.config
        # An answer's rows run through the decode attention kernel, which rounds otherwise than the prefill
        # path a later prompt holding those tokens would take: where answers must not follow what ran
        # before (--batch-invariant), an answer's blocks serve only its own sequence, as int8-prompt's do.
        by_role = self.model.kv_follows_row_role() or config.batch_invariant
        self.block_manager = BlockManager(loaded.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching,
                                          kv_follows_row_role=by_role)
        self.lora_manager = (LoraManager(loaded.hf_config, config.max_loras, config.max_lora_rank, self.dtype,
                                         self.device, self.model.projections(), self.model.kernels)
                             if config.max_loras > 0 else None)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.long_prefill_token_threshold, self.lora_manager, loaded.cost_model)
        self.runner = ModelRunner(self.model, loaded.kv_cache, self.lora_manager)
        self._argmax = self.model.kernels.argmax if self.model.kernels is not None else None  # greedy picks
        self._draw = self.model.kernels.sample if self.model.kernels is not None else None  # random draws
        self.runner.greedy_eos_token_ids = self.eos_token_ids  # plain-argmax steps may pick in the model
        self.speculator = (NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                         config.prompt_lookup_max) if config.num_speculative_tokens else None)

    def _log_ready(self, started: float) -> None:
        config, costs = self.config, self.scheduler.cost_model
        logger.info("engine ready in %.1fs: %s on %s/%s, %d KV blocks of %d tokens, fused CPU kernels %s",
                    time.monotonic() - started, self.model_info.name, self.device, self.model_info.dtype,
                    self.block_manager.num_blocks, config.block_size,
                    "on" if self.model.kernels is not None else "off")
        if config.long_prefill_token_threshold and self.scheduler.decode_cost_per_key:
            logger.info("long prompts beside decoding streams: up to %.1fx what those streams cost a step, in "
                        "tokens' linears: the weights' pass %.1f, a row each and 1/%.0f of one per key of its "
                        "context (%s: %s)", LONG_PREFILL_SHARE, self.scheduler.decode_step_cost,
                        1 / self.scheduler.decode_cost_per_key, costs.source, costs.describe())
        if self.speculator is not None:
            logger.info("requests speculate: up to %d tokens a step from earlier %d-%d-token matches in "
                        "prompt or answer (--num-speculative-tokens 0: off)", config.num_speculative_tokens,
                        config.prompt_lookup_min, config.prompt_lookup_max)
        if self.model.greedy_head is not None:
            logger.info("greedy steps pick through the int8 head's bounded logits (AVX512-VNNI), the few "
                        "candidates recomputed in fp32")

    # ---- preprocessing -------------------------------------------------------------------------

    def min_num_tokens(self, texts: list[str]) -> int:
        """A floor on the tokens ``texts`` need, from their sizes alone."""
        return self.prompts.min_num_tokens(texts)

    def encode_prompt(self, prompt: Prompt, truncate: int | None = None) -> list[int]:
        """Template and tokenize; ``truncate``: keep only the prompt's last so many tokens."""
        return self.prompts.encode(prompt, truncate)

    def render_chat(self, prompt: ChatPrompt) -> str:
        return self.prompts.render_chat(prompt)

    def compile_constraint(self, constraint: Constraint) -> CompiledGrammar:
        """Compile (or find cached) a request's constraint; thread-safe, meant to run off the engine thread.
        Raises InvalidRequestError naming the constraint's field and the grammar library's reason."""
        return self.grammars().compile(constraint)

    def warm_grammars(self) -> None:
        """Build the grammar library's view of the tokenizer (~0.4 s) ahead of the first structured-output
        request, which then waits only for its own grammar."""
        try:
            self.grammars()
        except Exception:  # structured output then fails at its first request, with the reason
            logger.warning("structured output is unavailable", exc_info=True)

    def close_grammars(self) -> None:
        """End the grammar compile threads and their worker processes."""
        with self._grammars_lock:
            if self._grammars is not None:
                self._grammars.close()

    def grammars(self) -> GrammarCompiler:
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.model_info.vocab_size, self.eos_token_ids,
                                                 self.config.constraint_budget)
                self._masks = MaskApplier(self._grammars, self.config.num_threads, self.model.kernels)
            return self._grammars

    def check_params(self, params: SamplingParams) -> None:
        """What a request names must fit this engine: token ids in the vocabulary (one bad id must fail its
        own request at the door, not a model step shared with others), logprobs within --max-logprobs, stop
        strings within --max-stop-strings and --max-stop-chars."""
        for name in ("stop_token_ids", "banned_token_ids", "allowed_token_ids"):
            self.prompts.check_in_vocab(getattr(params, name), name)
        # distinct ids, each in the vocabulary: a bias has at most one entry per token
        self.prompts.check_in_vocab([t for t, _ in params.logit_bias], "logit_bias")
        limit = self.config.max_logprobs
        for name in ("top_logprobs", "prompt_logprobs"):
            value = getattr(params, name) or 0
            if value > limit:
                raise InvalidRequestError(f"'{name}' is {value}; this server returns at most {limit} "
                                          "(--max-logprobs)", parameter=name)
        # Stop strings are matched on the engine thread, for every token of every sample: their number and
        # size are bounded before admission, so no request can make that work (or its tables) large.
        stops, chars = len(params.stop), sum(len(s) for s in params.stop)
        if stops > self.config.max_stop_strings:
            raise InvalidRequestError(f"'stop' has {stops} strings; this server takes at most "
                                      f"{self.config.max_stop_strings} (--max-stop-strings)", parameter="stop")
        if chars > self.config.max_stop_chars:
            raise InvalidRequestError(f"'stop' has {chars} characters in all; this server takes at most "
                                      f"{self.config.max_stop_chars} (--max-stop-chars)", parameter="stop")

    # ---- the core loop -------------------------------------------------------------------------

    def add_request(self, request: GenerationRequest, prompt_token_ids: list[int] | None = None,
                    adapter: LoraAdapter | None = None, grammar: CompiledGrammar | None = None) -> None:
        """``adapter``: the loaded adapter of ``request.lora`` (``load_adapter``), ``grammar``: the compiled
        ``params.constraint`` (``compile_constraint``); each is made here if omitted."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running",
                                      parameter="request_id")
        if self.is_full():
            raise EngineOverloadedError("the wait queue is full; retry later")
        if request.lora is not None:
            if self.lora_manager is None:
                raise LoraUnavailableError("LoRA adapters are not enabled on this server", code="disabled")
            if not request.lora.name or not request.lora.path:
                raise LoraUnavailableError("the LoRA reference was not resolved to a local adapter", code="unresolved")
            if adapter is None:
                adapter = self.load_adapter(request.lora.name, request.lora.path, request.lora.identity)
            elif not adapter.key:  # read by the caller itself: keyed by its files, as load_adapter does
                adapter.key = request.lora.identity or _path_identity(request.lora.path)
        ids = (prompt_token_ids if prompt_token_ids is not None
               else self.encode_prompt(request.prompt, request.params.truncate_prompt_tokens))
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if len(ids) + 1 > capacity:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens; the KV cache holds {capacity}",
                                     len(ids), capacity - 1)
        if request.params.constraint is not None and grammar is None:
            grammar = self.compile_constraint(request.params.constraint)
        # the prefix cache is per adapter identity: KV computed under one adapter's weights is never
        # reused under another's that happens to carry the same name
        salt = f"lora:{adapter.key}" if request.lora is not None and adapter is not None else ""
        if request.params.prompt_logprobs is not None:  # every prompt position must be computed: no cached prefix
            salt += f"|prompt-logprobs:{request.request_id}"
        p = request.params
        stops = StopAutomaton(p.stop) if p.stop else None  # one automaton for the n samples
        seqs: list[Sequence] = []
        for index in range(p.n):
            # The n samples share the prompt's KV: siblings wait until the first one's prompt blocks
            # are in the prefix cache, then reuse them. Seeded requests stay reproducible per sample.
            seed = self._unseeded.getrandbits(63) if p.seed is None else p.seed + index
            seq = Sequence(request, ids, IncrementalDetokenizer(self.tokenizer, ids, p.skip_special_tokens,
                                                            p.spaces_between_special_tokens),
                           self.max_model_len, cache_salt=salt, index=index, seed=seed,
                           stop_matcher=StopStringMatcher(p.stop, p.include_stop_str_in_output, stops),
                           wait_for=seqs[0] if seqs else None, lora_adapter=adapter,
                           matcher=grammar.new_matcher() if grammar is not None else None)
            seqs.append(seq)
        self.requests[request.request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """End every sequence of the request at once and free its cache; idempotent."""
        seqs = self.requests.get(request_id)
        if not seqs:
            return []
        self.num_aborted += 1
        return [self._finish(seq, "abort") for seq in list(seqs)]

    def _has_work(self) -> bool:
        """Requests running or waiting (False until the scheduler exists)."""
        scheduler = getattr(self, "scheduler", None)
        return scheduler is not None and scheduler.has_work()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        outputs = self._expire_deadlines()
        self._propose_drafts()
        batch = self.scheduler.schedule()
        outputs += [self._finish(s, "length", text=s.stop_matcher.flush()) for s in batch.out_of_cache]
        if batch.is_empty:
            return outputs
        seqs = batch.decodes + [s for s, _ in batch.prefills]
        try:
            if self.fault_hook is not None:
                self.fault_hook(seqs)
            masks = self._prepare_masks(batch)  # filled while the forward runs
            with torch.inference_mode():
                out = self.runner.run(batch)
                samplers = out.samplers
                if out.picked is not None:  # the model's greedy head picked every row already
                    tokens = out.picked
                else:
                    tokens = (sample(out.logits, samplers, self.eos_token_ids, masks, self._argmax, self._draw)
                              if samplers else [])
                for chunk in out.prompt_logits:
                    record_prompt_logprobs(chunk)
            for seq in batch.decodes:
                self._advance(seq, 1)
            for seq, n in batch.prefills:
                self._advance(seq, n)
            for seq, first, rows in out.hidden:
                assert seq.pooling is not None  # the model keeps hidden states only for pooling sequences
                seq.pooling.take(first, rows)
        except Exception as exc:  # a failed step fails only the sequences in it
            logger.exception("model step failed for %d sequences", len(seqs))
            return outputs + [self._finish(s, "error", error=f"inference failed: {exc}",
                                                    error_kind="inference") for s in seqs]
        row = 0
        costly = masks.too_costly if masks is not None else {}
        while row < len(samplers):
            seq = samplers[row]
            rows = 1 + len(seq.draft_token_ids)  # only a scheduled decode keeps a draft (Scheduler.schedule)
            if id(seq) in costly:  # its grammar's masks hold every stream in the step: this answer ends here
                assert seq.params.constraint is not None  # only constrained sequences have masks
                outputs.append(self._finish(seq, "error", error_kind="invalid", error=(
                    f"'{seq.params.constraint.field}' costs too much to match: this client's grammar masks took "
                    f"{costly[id(seq)] * 1000:.0f} ms of one step (--max-constraint-step-ms "
                    f"{self.config.constraint_budget.max_step_ms:g})")))
            else:
                outputs.append(self._take_picks(seq, tokens[row:row + rows]))
            row += rows
        return outputs + [self._finish_pooling(s) for s in seqs
                          if s.pooling is not None and s.num_computed_tokens == len(s.token_ids)]

    def _finish_pooling(self, seq: Sequence) -> RequestOutput:
        """A pooling sequence whose prompt is computed: its answer, and its blocks freed."""
        assert seq.pooling is not None  # called only for pooling sequences
        try:
            pooled = self.pooler.finish(seq.pooling)
        except Exception as exc:
            logger.exception("pooling failed")
            return self._finish(seq, "error", error=f"pooling failed: {exc}", error_kind="inference")
        out = self._finish(seq, "stop")
        out.pooled = pooled
        return out

    def check_pooling(self, params: PoolingParams) -> None:
        """What a pooling request asks must be what this server pools (the cheap checks, before tokenizing)."""
        self.pooler.check(params)

    def add_pooling_request(self, request: PoolingRequest, prompt_token_ids: list[int] | None = None) -> None:
        """A prompt to pool: one sequence that is prefilled like any prompt (chunked, batched beside the
        generating ones, within the step's token budget) and ends when its last token is computed."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running",
                                      parameter="request_id")
        if self.is_full():
            raise EngineOverloadedError("the wait queue is full; retry later")
        self.pooler.check(request.params)
        ids = (prompt_token_ids if prompt_token_ids is not None
               else self.encode_prompt(request.prompt, request.params.truncate_prompt_tokens))
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if len(ids) > capacity:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens; the KV cache holds {capacity}",
                                     len(ids), capacity)
        state = self.pooler.new_state(request.params)
        # LAST reads only the final position, which a cached prefix never covers; the other kinds read
        # positions a cached prefix would skip, so their blocks are their own
        salt = f"pooling:{request.request_id}" if state.needs_every_position else ""
        as_generation = GenerationRequest(request.request_id, request.prompt, SamplingParams(max_tokens=1),
                                          priority=request.priority, deadline=request.deadline,
                                          arrival_time=request.arrival_time, client=request.client)
        # no detokenizer (it writes no text); a fixed seed (it draws nothing, and none leaves torch's global seed)
        seq = Sequence(as_generation, ids, None, self.max_model_len, cache_salt=salt, seed=0)  # type: ignore[arg-type]
        seq.pooling = state
        self.requests[request.request_id] = [seq]
        self.scheduler.add(seq)

    def _propose_drafts(self) -> None:
        """Prompt-lookup drafts for the running sequences about to decode whose picks are plain argmaxes."""
        if self.speculator is None:
            return
        decoding = [seq for seq in self.scheduler.running if seq.decodes_next]
        measured = self.scheduler.cost_model.measured
        step_cost = self.scheduler.decode_cost() if measured else 0.0
        per_key = self.scheduler.decode_cost_per_key
        for seq in self.scheduler.running:
            # not while a leading section is open: closing it changes how the tokens after it are picked
            seq.draft_token_ids = (self.speculator.propose(seq, step_cost, len(decoding),
                                                           1 + per_key * seq.num_computed_tokens)
                                   if seq.decodes_next and reads_only_logits(seq)
                                   and not seq.section_open else [])
            if seq.draft_token_ids and not seq.params.is_greedy:
                seq.rng_before_draft = seq.generator.get_state()

    def _take_picks(self, seq: Sequence, picks: list[int]) -> RequestOutput:
        """The step's tokens for ``seq``: its one pick, or (with a draft) the draft tokens the picks confirm
        and the pick after them, in one output; each token goes through the stop checks in turn, and the
        computed draft positions are committed as they are taken."""
        draft, seq.draft_token_ids = seq.draft_token_ids, []
        if not draft:  # none proposed, or the scheduler left none: one row, one uniform drawn
            seq.rng_before_draft = None
            return self._process_token(seq, picks[0])
        kept = accepted_prefix(draft, picks)
        assert self.speculator is not None  # drafts are proposed only by the speculator
        self.speculator.record(seq, len(draft), kept)
        if seq.rng_before_draft is not None:
            # the step drew a uniform per row; plain decoding draws one per token: only the kept ones count
            seq.generator.set_state(seq.rng_before_draft)
            seq.rng_before_draft = None
            for _ in range(kept + 1):
                torch.rand(1, generator=seq.generator)
        merged: RequestOutput | None = None
        for i, token in enumerate(picks[:kept + 1]):
            out = self._process_token(seq, token)
            merged = out if merged is None else merged.merge(out)
            if out.finished:
                break
            if i < kept:  # a confirmed draft token: its row computed its KV, so its position is done
                self._advance(seq, 1)
        assert merged is not None
        return merged

    def _prepare_masks(self, batch) -> PreparedMasks | None:
        """Structured output: start filling the grammar masks of the constrained sequences that sample a
        token this step (every decode; a prefill whose chunk ends its prompt)."""
        if self._masks is None:
            return None
        sampling = [s for s in batch.decodes if s.matcher is not None]
        sampling += [s for s, n in batch.prefills
                     if s.matcher is not None and s.num_computed_tokens + n == len(s.token_ids)]
        return self._masks.prepare(sampling) if sampling else None

    def _advance(self, seq: Sequence, n: int) -> None:
        old = seq.num_computed_tokens
        seq.num_computed_tokens += n
        self.block_manager.commit_full_blocks(seq, old)

    def _process_token(self, seq: Sequence, token: int) -> RequestOutput:
        p = seq.params
        seq.append_token(token)
        matcher = seq.matcher  # the grammar this token was picked under (one a section's end starts is not yet)
        if seq.section_open:
            self._track_section(seq)
        if matcher is not None and matcher.stop_reason() in _GRAMMAR_LIMITS:
            # A limit of the grammar library hit while filling this token's mask (the mask then allows only
            # the end, which must not pass for a complete answer): this answer cannot go on, and the cached
            # grammar is dropped so no later request gets a copy in a failed state.
            assert p.constraint is not None  # a matcher is made only from the request's constraint
            self.grammars().evict(p.constraint)
            return self._finish(seq, "error", error_kind="invalid", error=f"'{p.constraint.field}' cannot be "
                                f"used: {first_line(matcher.get_error())}")
        if matcher is not None and not matcher.consume_token(token):
            # The token was masked, so the grammar had no real way on: it needs bytes this vocabulary
            # cannot spell (a regex naming a character with no byte token), and llguidance's mask fell
            # back to token 0. The request is what cannot be served, not the engine.
            assert p.constraint is not None  # a matcher is made only from the request's constraint
            return self._finish(seq, "error", error_kind="invalid", error=f"{p.constraint.field}: the constraint "
                                "needs text this model's vocabulary cannot produce (no token fits the grammar "
                                f"after {seq.num_output_tokens - 1} output tokens)")
        stops = seq.stop_matcher
        can_stop = seq.num_output_tokens >= p.min_tokens
        if can_stop and not p.ignore_eos and token in self.eos_token_ids:
            return self._finish(seq, "stop", new_tokens=[token], text=stops.flush())
        if can_stop and token in p.stop_token_ids:
            return self._finish(seq, "stop", new_tokens=[token], text=stops.flush(), stop_reason=token)
        delta = seq.detokenizer.add_tokens([token])
        text, matched = stops.feed(delta) if can_stop else (delta, None)
        if matched is not None:
            return self._finish(seq, "stop", new_tokens=[token], text=text, stop_reason=matched)
        if matcher is not None and matcher.is_stopped():  # the grammar is complete: nothing may follow
            return self._finish(seq, "stop", new_tokens=[token], text=text + stops.flush())
        if len(seq.token_ids) >= seq.max_total_len:
            return self._finish(seq, "length", new_tokens=[token], text=text + stops.flush())
        return self._output(seq, [token], text)

    @staticmethod
    def _track_section(seq: Sequence) -> None:
        """After a token of an open leading section: close it when its end ids end the output (the grammar
        then starts, with the next token), or start forcing them once its budget is spent."""
        section = seq.params.leading_section
        assert section is not None
        if seq.forced_token_ids:
            seq.forced_token_ids.pop(0)
        end = list(section.end_token_ids)
        if seq.num_output_tokens >= len(end) and seq.token_ids[-len(end):] == end:
            seq.section_open = False
            seq.forced_token_ids = []
            seq.matcher, seq.pending_matcher = seq.pending_matcher, None
        elif (section.max_tokens is not None and not seq.forced_token_ids
              and seq.num_output_tokens >= section.max_tokens):
            # the end ids the output already ends with (a closing tag begun) are not forced again
            output = seq.token_ids[seq.num_prompt_tokens:]
            begun = next((k for k in range(min(len(end) - 1, len(output)), 0, -1) if output[-k:] == end[:k]), 0)
            seq.forced_token_ids = end[begun:]

    def _output(self, seq: Sequence, new_tokens: list[int], text: str) -> RequestOutput:
        logprobs = None
        if seq.params.logprobs:
            logprobs, seq.pending_logprobs = seq.pending_logprobs, []
        prompt_logprobs = None
        if seq.prompt_logprobs is not None and not seq.num_emitted_prompt_logprobs:  # once, with the first output
            prompt_logprobs = [None] + seq.prompt_logprobs  # the first prompt token has no logprob (vLLM's form)
            seq.num_emitted_prompt_logprobs = len(prompt_logprobs)
        return RequestOutput(
            request_id=seq.request_id, index=seq.index, new_token_ids=new_tokens, text_delta=text,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            timings=copy.copy(seq.timings))  # a snapshot: the engine thread goes on updating the sequence's

    def _finish(self, seq: Sequence, reason: str, new_tokens: list[int] | None = None, text: str = "",
                stop_reason: str | int | None = None, error: str | None = None,
                error_kind: str | None = None) -> RequestOutput:
        self.scheduler.remove(seq)
        siblings = self.requests.get(seq.request_id)
        if siblings is not None:
            siblings.remove(seq)
            if not siblings:
                del self.requests[seq.request_id]
        out = self._output(seq, new_tokens or [], text)
        out.finished = True
        out.finish_reason = reason  # type: ignore[assignment]
        out.stop_reason = stop_reason
        out.error = error
        out.error_kind = error_kind  # type: ignore[assignment]
        return out

    def _expire_deadlines(self) -> list[RequestOutput]:
        now = time.monotonic()
        expired = [s for seqs in self.requests.values() for s in seqs
                   if s.deadline is not None and s.deadline <= now]
        return [self._finish(s, "error", error="request timed out (deadline passed)",
                             error_kind="timeout") for s in expired]

    def check_adapter(self, path: str, name: str) -> None:
        """Validate an adapter against the served model (nothing is cached: no identity is known yet)."""
        if self.lora_manager is None:
            raise LoraUnavailableError("LoRA adapters are not enabled on this server", code="disabled")
        read_adapter(path, name, self.lora_manager.config, self.lora_manager.max_rank)

    def load_adapter(self, name: str, path: str, identity: str | None = None) -> LoraAdapter:
        """Read and check an adapter, cached by ``identity`` (LoraRef.identity; without one, the
        directory and its files' sizes and times): done before admission, off the engine thread, so the
        scheduler only copies tensors into a slot. Thread-safe."""
        if self.lora_manager is None:
            raise LoraUnavailableError("LoRA adapters are not enabled on this server", code="disabled")
        key = identity or _path_identity(path)
        with self._adapters_lock:
            cached = self._cached_adapter(key)
            if cached is not None:
                return cached
        adapter = read_adapter(path, name, self.lora_manager.config, self.lora_manager.max_rank)
        adapter.key = key
        with self._adapters_lock:
            cached = self._cached_adapter(key)  # read meanwhile by another thread: one copy is kept
            if cached is not None:
                return cached
            self._adapters[key] = adapter
            while len(self._adapters) > 2 * self.lora_manager.max_loras:  # running requests keep theirs
                self._adapters.popitem(last=False)
        return adapter

    def _cached_adapter(self, key: str) -> LoraAdapter | None:
        pinned = self._pinned.get(key)
        if pinned is not None:
            return pinned[0]
        adapter = self._adapters.get(key)
        if adapter is not None:
            self._adapters.move_to_end(key)
        return adapter

    def register_adapter(self, path: str, name: str, identity: str) -> None:
        """An operator's adapter (--lora, /v1/load_lora_adapter): read, checked and pinned in the cache
        until ``forget_adapter`` (session packs never evict it). Registrations of one identity count."""
        adapter = self.load_adapter(name, path, identity)
        with self._adapters_lock:
            held = self._pinned.get(identity)
            self._pinned[identity] = (held[0], held[1] + 1) if held is not None else (adapter, 1)
            self._adapters.pop(identity, None)

    def forget_adapter(self, identity: str) -> None:
        """One registration of ``identity`` ends; with the last, its weights leave the cache (running
        requests keep the adapter they were admitted with, and its slot is reused once they finish)."""
        with self._adapters_lock:
            held = self._pinned.get(identity)
            if held is None:
                return
            if held[1] > 1:
                self._pinned[identity] = (held[0], held[1] - 1)
            else:
                del self._pinned[identity]

    # ---- introspection -------------------------------------------------------------------------

    def is_full(self) -> bool:
        """No room for one more request: every running slot is taken (or promised to a waiting one)
        and the wait queue holds ``max_waiting`` beyond that."""
        free_running = max(0, self.config.max_num_seqs - self.num_running)
        return self.num_waiting >= self.config.max_waiting + free_running

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def kv_cache_usage(self) -> float:
        return self.block_manager.usage()

    def stats(self) -> EngineStats:
        """A snapshot for health and metrics (read from another thread: counters only, no locking)."""
        bm, lm, sched = self.block_manager, self.lora_manager, self.scheduler
        running, waiting = list(sched.running), list(sched.waiting)
        return EngineStats(
            num_requests_running=len(running), num_requests_waiting=len(waiting),
            kv_cache_usage=bm.usage(), kv_cache_blocks_used=bm.num_used_blocks,
            num_preemptions=sched.num_preemptions, num_share_preemptions=sched.num_share_preemptions,
            prefix_cache_queries=bm.num_prefix_queries,
            prefix_cache_hits=bm.num_prefix_hits, max_loras=lm.max_loras if lm else 0,
            spec_draft_tokens=self.speculator.num_drafted if self.speculator else 0,
            spec_accepted_tokens=self.speculator.num_accepted if self.speculator else 0,
            lora_loads=lm.num_loads if lm else 0,
            running_lora_adapters=tuple(sorted({s.lora_name for s in running if s.lora_name})),
            waiting_lora_adapters=tuple(sorted({s.lora_name for s in waiting if s.lora_name})))


class LLMEngine(EngineCore):
    """An engine core over ``loaded``, or over what ``load(config)`` loads when none is given."""

    def __init__(self, config: EngineConfig, loaded: Loaded | None = None) -> None:
        super().__init__(config, loaded if loaded is not None else load(config))
