"""Async face of the engine: one background thread runs the core loop; callers await outputs.

Each request gets a ``RequestStream``. The engine thread never blocks on a consumer: when a
client falls behind, its pending outputs are merged into one (a failure stays apart, after the
text before it), so memory per request stays bounded by its own text and a slow socket cannot stall
the batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable

from engine.config import EngineConfig
from engine.cpu_contention import ThreadQueueing
from engine.errors import (
    EngineOverloadedError,
    EngineShutdownError,
    InferenceError,
    InvalidRequestError,
    LoraUnavailableError,
    RequestTimeoutError,
)
from engine.llm_engine import LLMEngine
from engine.pooling import PoolingOutput, PoolingRequest
from engine.protocol import EngineLimits, EngineStats, FinishedNotice
from engine.request import GenerationRequest, Prompt, RequestOutput

logger = logging.getLogger(__name__)


class RequestStream:
    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id  # the caller's id (echoed back), not the engine's
        self.loop = loop
        # sample index -> outputs not yet taken: the generated ones merged, an error kept apart after them
        self.pending: dict[int, list[RequestOutput]] = {}
        self.failure: BaseException | None = None
        self.event = asyncio.Event()

    def put(self, output: RequestOutput) -> None:  # runs on the event loop
        queued = self.pending.setdefault(output.index, [])
        # Folding a failure into the tokens before it would drop them, and a consumer that fell behind by
        # a few steps would answer 500 where a prompt one got its text and then the protocol's error event.
        if queued and queued[-1].finish_reason != "error" and output.finish_reason != "error":
            queued[-1] = queued[-1].merge(output)
        else:
            queued.append(output)
        self.event.set()

    def fail(self, exc: BaseException) -> None:
        self.failure = exc
        self.event.set()

    async def get(self) -> list[RequestOutput]:
        # Outputs first, then a failure; only wait when there is neither (a failure that arrives
        # together with outputs must not be lost when the event is cleared).
        while True:
            if self.pending:
                outs = [out for i in sorted(self.pending) for out in self.pending[i]]
                self.pending = {}
                self.event.clear()
                return outs
            if self.failure is not None:
                raise self.failure
            self.event.clear()
            await self.event.wait()


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_info = engine.model_info
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # by the engine's own request id
        self._internal_ids = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._go: threading.Event | None = None  # set by start() when from_config's thread waits for it
        self.last_step_end = time.monotonic()
        self.step_in_progress_since: float | None = None
        self.num_steps = 0
        self.cpu_queueing = ThreadQueueing()  # warns from the loop where the threads keep queueing for a CPU
        self.limits = EngineLimits()
        # Called with each sample's final output (metrics); must be cheap and must not raise.
        self.finished_listeners: list[Callable[[RequestOutput], None]] = []

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Build the engine on the thread that will run its steps.

        OpenMP keeps a thread team for every thread that has entered a parallel region. Building on
        one thread and stepping on another leaves two teams, so libgomp counts more threads than cores
        and its barrier spin-waits turn into futex sleeps at every kernel: a decode step takes about twice
        as long, with hundreds of context switches a step instead of none.
        """
        built: concurrent.futures.Future[AsyncEngine] = concurrent.futures.Future()
        go = threading.Event()

        def own_thread() -> None:
            try:
                engine = cls(LLMEngine(config))
            except BaseException as exc:
                built.set_exception(exc)
                return
            engine._thread, engine._go = threading.current_thread(), go
            built.set_result(engine)
            go.wait()
            engine._run()

        threading.Thread(target=own_thread, name="engine-loop", daemon=True).start()
        return built.result()

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._go is not None:  # built by from_config: its own thread waits for the go
            if self._go.is_set():
                return
            self._go.set()
        elif self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()
        else:
            return
        # Before the first request, not beside it: built on a thread meanwhile (~0.4 s of the GIL, seconds on a
        # busy machine) it made the first request after "ready" ~10x slower than the next ones.
        self.engine.warm_grammars()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._go is not None:
            self._go.set()  # a thread still waiting for start() runs straight to its end
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.engine.close_grammars()

    def is_healthy(self) -> bool:
        """Alive, and no single model step has been running for longer than ``stuck_after_s``."""
        if self._thread is None or not self._thread.is_alive():
            return False
        since = self.step_in_progress_since
        return since is None or time.monotonic() - since < self.limits.stuck_after_s

    # ---- requests ------------------------------------------------------------------------------

    def encode_prompt_sync(self, prompt: Prompt) -> list[int]:
        """Template and tokenize (thread-safe: the tokenizer is only read)."""
        return self.engine.encode_prompt(prompt)

    def min_num_tokens(self, texts: list[str]) -> int:
        """A floor on the tokens ``texts`` need, from their sizes alone (no tokenizing)."""
        return self.engine.min_num_tokens(texts)

    async def encode_prompt(self, prompt: Prompt) -> list[int]:
        return await asyncio.to_thread(self.engine.encode_prompt, prompt)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        """Stream outputs; leaving the iterator before the final output aborts the request."""
        if self._stop.is_set():
            raise EngineShutdownError("the engine is shutting down")
        if self.model_info.task != "generate":
            raise InvalidRequestError(f"the served model runs --task {self.model_info.task}: it pools (embeddings, "
                                      "scores, classes) and does not generate text; start it with --task generate "
                                      "to generate", parameter="model")
        adapter = None
        if request.lora is not None:
            ref = request.lora
            if not self.lora_enabled:
                raise LoraUnavailableError(f"adapter {ref.name or ref.url!r}: LoRA adapters are not enabled on this "
                                           "server", code="disabled")
            if not ref.name or not ref.path:
                raise LoraUnavailableError(f"adapter {ref.name or ref.url!r} was not resolved to a local adapter",
                                           code="unresolved")
            adapter = await asyncio.to_thread(self.engine.load_adapter, ref.name, ref.path, ref.identity)
        self.engine.check_params(request.params)  # the cheap checks first
        grammar = None
        if request.params.constraint is not None:  # compiled off the engine thread, once per grammar text
            grammar = await self.engine.grammars().compile_async(request.params.constraint)
        if request.deadline is None and self.limits.default_timeout_s:
            request.deadline = request.arrival_time + self.limits.default_timeout_s
        ids = await asyncio.to_thread(self.engine.encode_prompt, request.prompt, request.params.truncate_prompt_tokens)
        if self.engine.is_full():  # a cheap early refusal; the engine thread checks again on add
            raise EngineOverloadedError("the wait queue is full; retry later")
        # The engine's request ids are its own: a client's id (Triton `id`, SGLang `rid`) is only echoed,
        # so two clients choosing the same one cannot collide.
        internal = dataclasses.replace(request, request_id=f"r{next(self._internal_ids)}")
        stream = RequestStream(request.request_id, asyncio.get_running_loop())
        self._streams[internal.request_id] = stream
        self._commands.put(("add", internal, (ids, adapter, grammar)))
        self._wake.set()
        unfinished = request.params.n
        notice = FinishedNotice(self.finished_listeners)
        try:
            while unfinished:
                for out in await stream.get():
                    out.request_id = request.request_id
                    if out.finish_reason == "error" and out.error_kind == "timeout":
                        raise RequestTimeoutError(out.error or "request timed out")
                    if out.finish_reason == "error" and out.error_kind == "invalid":
                        constraint = request.params.constraint
                        raise InvalidRequestError(out.error or "invalid request",
                                                  parameter=constraint.field if constraint else None)
                    if out.finish_reason == "error":
                        raise InferenceError(out.error or "inference failed")
                    unfinished -= out.finished
                    notice.saw(out)
                    yield out
        finally:
            self._streams.pop(internal.request_id, None)
            if unfinished:
                self._commands.put(("abort", internal.request_id, None))
                self._wake.set()
                notice.abandoned()

    async def pool(self, request: PoolingRequest) -> PoolingOutput:
        """A prompt pooled as ``request.params`` asks: queued and prefilled beside the generating requests
        (engine/pooling.py); cancelling the call aborts it and frees its cache."""
        if self._stop.is_set():
            raise EngineShutdownError("the engine is shutting down")
        self.engine.check_pooling(request.params)
        if request.deadline is None and self.limits.default_timeout_s:
            request.deadline = request.arrival_time + self.limits.default_timeout_s
        ids = await asyncio.to_thread(self.engine.encode_prompt, request.prompt, request.params.truncate_prompt_tokens)
        if self.engine.is_full():
            raise EngineOverloadedError("the wait queue is full; retry later")
        internal = dataclasses.replace(request, request_id=f"p{next(self._internal_ids)}")
        stream = RequestStream(request.request_id, asyncio.get_running_loop())
        self._streams[internal.request_id] = stream
        self._commands.put(("pool", internal, ids))
        self._wake.set()
        done = False
        try:
            while True:
                for out in await stream.get():
                    done = out.finished
                    if out.finish_reason == "error" and out.error_kind == "timeout":
                        raise RequestTimeoutError(out.error or "request timed out")
                    if out.finish_reason == "error":
                        raise InferenceError(out.error or "pooling failed")
                    if out.finish_reason == "length":  # alone in the KV cache and still no room
                        raise InferenceError("the prompt does not fit the KV cache beside the running requests")
                    if out.finished and out.pooled is not None:
                        return PoolingOutput(request.request_id, out.pooled, out.num_prompt_tokens)
                    if out.finished:
                        raise InferenceError(f"pooling ended without an answer ({out.finish_reason})")
        finally:
            self._streams.pop(internal.request_id, None)
            if not done:
                self._commands.put(("abort", internal.request_id, None))
                self._wake.set()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def lora_enabled(self) -> bool:
        return self.engine.lora_manager is not None

    def check_adapter(self, path: str, name: str) -> None:
        self.engine.check_adapter(path, name)

    def register_adapter(self, path: str, name: str, identity: str) -> None:
        self.engine.register_adapter(path, name, identity)

    def forget_adapter(self, identity: str) -> None:
        self.engine.forget_adapter(identity)

    @property
    def num_active_requests(self) -> int:
        """Requests whose caller is still waiting for outputs."""
        return len(self._streams)

    def fail_all(self, exc: BaseException) -> None:
        """End every request with ``exc`` (shutdown after the grace period); thread-safe."""
        self._commands.put(("fail_all", exc, None))
        self._wake.set()

    async def abort(self, request_id: str) -> None:
        """Abort every running request the caller named ``request_id``."""
        for internal, stream in list(self._streams.items()):
            if stream.request_id == request_id:
                self._commands.put(("abort", internal, None))
        self._wake.set()

    # ---- the engine thread ---------------------------------------------------------------------

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.put, output)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.fail, exc)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, a, b = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.add_request(a, *b)
                except Exception as exc:  # refused at admission: tell only that caller
                    self._fail(a.request_id, exc)
            elif kind == "pool":
                try:
                    self.engine.add_pooling_request(a, b)
                except Exception as exc:  # refused at admission: tell only that caller
                    self._fail(a.request_id, exc)
            elif kind == "abort":
                for out in self.engine.abort_request(a):
                    self._deliver(out)
            elif kind == "fail_all":
                for request_id in list(self._streams):
                    self._fail(request_id, a)
                    self.engine.abort_request(request_id)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_commands()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            self.step_in_progress_since = time.monotonic()
            try:
                outputs = self.engine.step()
            except Exception:  # defensive: the core already contains step faults
                logger.exception("engine step crashed")
                outputs = []
            self.step_in_progress_since = None
            self.last_step_end = time.monotonic()
            self.num_steps += 1
            if (queueing := self.cpu_queueing.check(self.last_step_end)) is not None:
                logger.warning("%s", queueing)
            for out in outputs:
                self._deliver(out)
        # shutting down: end whatever is left
        for request_id in list(self.engine.requests):
            self._fail(request_id, EngineShutdownError("the server is shutting down"))
            self.engine.abort_request(request_id)
