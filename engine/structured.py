"""Structured output: a request's ``Constraint`` (JSON schema, regex, grammar, choice list, structural
tag) compiled once by a grammar library (llguidance), cached by its text, and applied as a token
bitmask per row inside the batched sampler, so constrained and free rows share one step.

A constraint is a client's program for a compiler that recurses: it is checked against its budget
(``engine/constraint_budget.py``) and tried in a worker process (``engine/grammar_worker.py``) before
the server compiles it, off the engine thread and the event loop. The engine thread only creates a
matcher per sequence (a copy of the compiled one), fills masks and advances matchers."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from engine.constraint_budget import ConstraintBudget, ConstraintTooLarge, check_constraint
from engine.errors import InvalidRequestError
from engine.grammar_worker import GrammarWorker, WorkerFailed, first_line, start_compile_thread
from engine.heap import release_freed_memory

logger = logging.getLogger(__name__)

ConstraintKind = Literal["json", "json_object", "regex", "grammar", "choice", "structural_tag"]
BACKENDS = ("llguidance",)  # the choice of --structured-output-backend (and vLLM's --guided-decoding-backend)
CACHE_SIZE = 256  # compiled grammars (and refusals) kept by count, beside the byte budget


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match. ``value``: the schema (JSON text), regex, grammar (Lark, or GBNF /
    EBNF with ``::=``), the choices (a JSON list of strings), or the structural tag (JSON text)."""

    kind: ConstraintKind
    value: str = ""
    whitespace_pattern: str | None = None  # JSON: the whitespace allowed between tokens (None: compact)
    field: str = "constraint"  # the request field it came from, named in errors

    @staticmethod
    def choice(options: list[str], field: str = "guided_choice") -> Constraint:
        return Constraint("choice", json.dumps(list(options)), field=field)


class CompiledGrammar:
    """A validated grammar and a matcher at its start; each sequence gets a copy. ``nbytes``: what it holds
    in memory, as measured where it was first compiled."""

    def __init__(self, matcher: Any, nbytes: int = 0) -> None:
        self._matcher = matcher
        self.nbytes = nbytes

    def new_matcher(self) -> Any:
        return self._matcher.deep_copy()


class ConstraintRefused(Exception):
    """A compile that failed for every request naming the same constraint; ``reason`` completes
    "'<field>' ..." and is turned into each waiter's InvalidRequestError with its own field. ``lasting``:
    the same text would fail again, so later requests are refused at once (not so a missed deadline)."""

    def __init__(self, reason: str, lasting: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.lasting = lasting


@dataclass(eq=False)
class _Job:
    key: Constraint
    future: Future = field(default_factory=Future)
    waiters: int = 1
    worker: GrammarWorker | None = None  # while the job runs in a worker process


class GrammarCompiler:
    """A constraint's compiled grammar, once per text: checked against its budget, tried in a worker
    process, then built here on a compile thread of the same stack. Compiles run on their own bounded
    pool (``budget.workers``), one per distinct text at a time however many requests wait on it, and a
    compile nobody waits for any more is dropped (or its worker ended). Kept compiled grammars are
    bounded in bytes; a refusal is remembered as a refusal."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int],
                 budget: ConstraintBudget | None = None) -> None:
        import llguidance

        self._ll = llguidance
        self.budget = budget or ConstraintBudget()
        spec = tokenizer_spec(tokenizer)
        self.tokenizer = llguidance.LLTokenizer(spec, n_vocab=len(tokenizer), eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self._setup = json.dumps({"tokenizer": spec, "n_vocab": len(tokenizer), "eos": list(eos_token_ids)})
        self._cache: OrderedDict[Constraint, CompiledGrammar] = OrderedDict()
        self._cached_bytes = 0
        self._refused: OrderedDict[Constraint, str] = OrderedDict()
        self._running: dict[Constraint, _Job] = {}
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.num_compiled = 0

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar of a constraint, waiting for it; InvalidRequestError naming its field."""
        job = self._submit(constraint)
        try:
            return job.future.result()
        except ConstraintRefused as exc:
            raise _invalid(constraint, exc.reason) from None

    async def compile_async(self, constraint: Constraint) -> CompiledGrammar:
        """``compile`` for the event loop: a caller that goes away (cancelled) stops waiting, and the
        compile itself stops once nobody waits for it."""
        job = self._submit(constraint)
        try:
            return await asyncio.shield(asyncio.wrap_future(job.future))
        except ConstraintRefused as exc:
            raise _invalid(constraint, exc.reason) from None
        except asyncio.CancelledError:
            self._release(job)
            raise

    def evict(self, constraint: Constraint) -> None:
        """A compiled grammar failed while matching (a lexer or parser limit, which depends on the text
        generated): drop it, so the next request compiles a fresh copy rather than one in a failed state.
        Not a refusal: another request's path through the same grammar may well stay within the limits."""
        key = _without_field(constraint)
        with self._lock:
            hit = self._cache.pop(key, None)
            if hit is not None:
                self._cached_bytes -= hit.nbytes

    def close(self) -> None:
        """Stop the compile threads and their workers (a server shutting down)."""
        with self._lock:
            jobs = list(self._running.values())
            threads, self._threads = self._threads, []
        for job in jobs:
            if job.worker is not None:
                job.worker.stop(job)
        for _ in threads:
            self._queue.put(None)

    # ---- the pool ------------------------------------------------------------------------------

    def _submit(self, constraint: Constraint) -> _Job:
        key = _without_field(constraint)  # the same grammar from another field is the same compiled one
        with self._lock:
            hit = self._cache.get(key)
            refused = self._refused.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            running = self._running.get(key)
            if hit is None and refused is None and running is not None:
                running.waiters += 1
                return running
        job = _Job(key)
        if hit is not None:
            job.future.set_result(hit)
            return job
        if refused is not None:
            job.future.set_exception(ConstraintRefused(refused))
            return job
        try:
            check_constraint(key.kind, key.value, self.budget)
        except ConstraintTooLarge as exc:
            job.future.set_exception(ConstraintRefused(str(exc)))
            return job
        with self._lock:
            running = self._running.get(key)
            if running is not None:  # another request queued the same text meanwhile
                running.waiters += 1
                return running
            self._running[key] = job
            self._start_threads()
        self._queue.put(job)
        return job

    def _release(self, job: _Job) -> None:
        with self._lock:
            job.waiters -= 1
            if job.waiters > 0 or job.future.done():
                return
            self._running.pop(job.key, None)
            worker = job.worker
        job.future.cancel()
        if worker is not None:  # it is compiling for nobody: end it (the next job starts a fresh worker)
            worker.stop(job)

    def _start_threads(self) -> None:
        while len(self._threads) < self.budget.workers:
            worker = GrammarWorker(self._setup)
            thread = start_compile_thread(self._serve, f"grammar-compile-{len(self._threads)}", worker)
            self._threads.append(thread)

    def _serve(self, worker: GrammarWorker) -> None:
        while (job := self._queue.get()) is not None:
            with self._lock:
                if job.future.cancelled() or self._running.get(job.key) is not job:
                    continue
                job.worker = worker
            try:
                outcome: CompiledGrammar | ConstraintRefused = self._build(job, worker)
            except Exception as exc:  # the worker could not start: structured output is down, not the server
                logger.exception("grammar compile failed")
                outcome = ConstraintRefused(f"could not be compiled: {exc}", lasting=False)
            dropped = False
            with self._lock:
                job.worker = None
                if self._running.get(job.key) is job:
                    del self._running[job.key]
                if isinstance(outcome, CompiledGrammar):
                    dropped = self._keep(job.key, outcome)
                elif outcome.lasting and not job.future.cancelled():
                    self._remember_refusal(job.key, outcome.reason)
            if dropped:
                release_freed_memory()
            if job.future.cancelled():
                continue
            if isinstance(outcome, CompiledGrammar):
                job.future.set_result(outcome)
            else:
                job.future.set_exception(outcome)
        worker.close()

    def _build(self, job: _Job, worker: GrammarWorker) -> CompiledGrammar | ConstraintRefused:
        budget, key = self.budget, job.key
        try:
            trial = worker.trial(key.kind, key.value, key.whitespace_pattern, budget.compile_timeout_s, job)
        except ValueError as exc:
            return ConstraintRefused(str(exc))
        except WorkerFailed as exc:
            return ConstraintRefused(str(exc), exc.lasting)
        if trial.nbytes > budget.max_compiled_bytes:
            return ConstraintRefused(f"compiles to {trial.nbytes / (1 << 20):.0f} MiB; at most "
                                     f"{budget.max_compiled_bytes / (1 << 20):.0f} MiB are kept for one constraint "
                                     "(--max-constraint-compiled-mb)")
        matcher = self._ll.LLMatcher(self.tokenizer, trial.grammar, log_level=0)
        if matcher.is_error():
            return ConstraintRefused(f"cannot be used: {first_line(matcher.get_error())}")
        self.num_compiled += 1
        return CompiledGrammar(matcher, max(trial.nbytes, len(trial.grammar)))

    def _keep(self, key: Constraint, compiled: CompiledGrammar) -> bool:  # under the lock
        """Cache ``compiled``, dropping the least recently used past the budget; True when any was dropped."""
        self._cache[key] = compiled
        self._cached_bytes += compiled.nbytes
        dropped = False
        while self._cache and (self._cached_bytes > self.budget.cache_bytes or len(self._cache) > CACHE_SIZE):
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.nbytes
            dropped = True
        return dropped

    def _remember_refusal(self, key: Constraint, reason: str) -> None:  # under the lock
        self._refused[key] = reason
        while len(self._refused) > CACHE_SIZE:
            self._refused.popitem(last=False)


def tokenizer_spec(hf_tokenizer: Any) -> str:
    """The tokenizer as llguidance reads it (its tokenizer.json text).

    A byte-level BPE (GPT-2 style: a ByteLevel pre-tokenizer) is decoded byte-level. Some converted
    tokenizers (transformers' GGUF loader) put SentencePiece-style ByteFallback decoders in front of
    it, which would make llguidance read the byte tokens as literal characters ("Ġ", "Ċ") and let a raw
    newline into a JSON string; the decoder is set to plain ByteLevel for them."""
    spec = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    pres = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if spec.get("model", {}).get("type") == "BPE" and any(p.get("type") == "ByteLevel" for p in pres):
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    return json.dumps(spec)


def grammar_tokenizer(hf_tokenizer: Any, eos_token_ids: list[int]) -> Any:
    """llguidance's view of the tokenizer: each token's bytes, and the tokens that end an answer."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer_spec(hf_tokenizer), n_vocab=len(hf_tokenizer),
                                  eos_token=list(eos_token_ids))


def _without_field(c: Constraint) -> Constraint:
    return Constraint(c.kind, c.value, c.whitespace_pattern)


def _invalid(constraint: Constraint, reason: str) -> InvalidRequestError:
    return InvalidRequestError(f"'{constraint.field}' {reason}", parameter=constraint.field)


class MaskApplier:
    """Fills the constrained sequences' bitmasks (a row per thread, in parallel) and applies them to
    logits. ``prepare`` starts the fill on a helper thread so it runs while the model's forward does
    (both release the GIL); ``apply`` waits for it and masks the sampled rows."""

    def __init__(self, compiler: GrammarCompiler, num_threads: int | None = None, kernels: Any = None) -> None:
        self.compiler = compiler
        self.step_budget_s = compiler.budget.max_step_ms / 1000
        self._rows = ThreadPoolExecutor(num_threads or os.cpu_count() or 1, thread_name_prefix="grammar-rows")
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._bits = torch.arange(32, dtype=torch.int32)
        self.kernels = kernels  # the fused CPU kernels' apply_token_bitmask, when built

    def prepare(self, seqs: list[Any]) -> PreparedMasks:
        """Start filling the masks of ``seqs`` (each with a matcher) for the tokens they sample next."""
        # llguidance's bitmask layout: a row of ceil(V / 32) int32 words per sequence, bit t of the row = token
        # t allowed. Built here rather than through llguidance.torch, whose import compiles a function with
        # torch.compile (dynamo and inductor: seconds of every start) that the engine never calls.
        mask = torch.full((len(seqs), (self.compiler.tokenizer.vocab_size + 31) // 32), -1, dtype=torch.int32)
        future = self._helper.submit(self._fill, seqs, mask)
        return PreparedMasks(self, {id(s): i for i, s in enumerate(seqs)}, mask, future)

    def _fill(self, seqs: list[Any], mask: torch.Tensor) -> dict[int, float]:
        """Fill every row (in parallel; the library releases the GIL), timing each: a grammar's mask may grow
        costlier token by token (an ambiguous grammar), and every other stream waits for it in the same
        step. Returns the sequences whose client's rows together took longer than the step budget:
        id(sequence) -> those rows' seconds.

        A row's time is its thread's CPU time, not the wall clock's: the budget bounds what a grammar costs,
        and on a busy machine a cheap mask's thread waits for a core for longer than the budget, which
        ended ordinary constrained answers."""
        def fill(row: int) -> float:
            start = time.thread_time()
            words = mask[row]  # a contiguous row of the contiguous mask
            seqs[row].matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
            return time.thread_time() - start

        seconds = list(self._rows.map(fill, range(len(seqs)))) if len(seqs) > 1 else [fill(0)]
        spent: dict[Any, float] = {}
        for s, took in zip(seqs, seconds):
            spent[s.client or s.request_id] = spent.get(s.client or s.request_id, 0.0) + took
        return {id(s): spent[s.client or s.request_id] for s in seqs
                if spent[s.client or s.request_id] > self.step_budget_s}

    def apply(self, logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> None:
        """logits [B, V] in place: row rows[i] keeps only the tokens mask[i] allows."""
        if self.kernels is not None and logits.dtype == torch.float32 and logits.is_contiguous():
            self.kernels.apply_token_bitmask(logits, mask, torch.tensor(rows, dtype=torch.int64))
            return
        allowed = ((mask.unsqueeze(-1) >> self._bits) & 1).view(len(rows), -1).bool()  # [R, 32 * words]
        vocab = logits.shape[1]
        width = min(vocab, allowed.shape[1])
        index = torch.tensor(rows)
        sub = logits[index]
        sub[:, :width].masked_fill_(~allowed[:, :width], float("-inf"))
        if vocab > width:  # ids beyond the tokenizer's: never part of a grammar
            sub[:, width:] = float("-inf")
        logits[index] = sub


@dataclass
class PreparedMasks:
    """The masks of one step's constrained sequences, being filled; ``apply`` waits for them."""

    applier: MaskApplier
    row_of: dict[int, int]  # id(sequence) -> its row in ``mask``
    mask: torch.Tensor
    future: Future
    too_costly: dict[int, float] = field(default_factory=dict)  # id(sequence) -> its client's mask seconds

    def apply(self, logits: torch.Tensor, seqs: list[Any]) -> list[int]:
        """Mask the logits rows of the constrained ``seqs``; returns those rows."""
        self.too_costly = self.future.result()
        rows = [i for i, s in enumerate(seqs) if id(s) in self.row_of]
        if rows:
            picked = self.mask[torch.tensor([self.row_of[id(seqs[i])] for i in rows])].contiguous()
            self.applier.apply(logits, rows, picked)
        return rows
