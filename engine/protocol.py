"""The engine's face as protocol code sees it (vLLM's ``EngineClient``). Everything above the engine
(bridges, the Spark service, health, metrics, the LoRA store) goes through it, so a scripted fake
(tests/fake_engine.py) or a remote engine can stand in for the local one."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from engine.pooling import PoolingOutput, PoolingRequest
from engine.request import GenerationRequest, Prompt, RequestOutput


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    path: str
    model_type: str
    max_model_len: int
    vocab_size: int
    dtype: str
    device: str
    chat_template_tools: bool = False  # the chat template renders function tools itself
    # what the model is for (--task resolved: generate, embed, classify, score, reward), the pooling tasks it
    # answers (engine/pooling.py: embed, classify, score, encode) and its classification head's labels
    task: str = "generate"
    pooling_tasks: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()
    # the sampling its generation_config.json recommends, in the engine's knob names (engine/generation_config.py)
    recommended_sampling: tuple[tuple[str, float | int], ...] = ()


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for /health and /metrics, read at scrape time."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    kv_cache_blocks_used: int = 0
    num_preemptions: int = 0  # for KV space
    num_share_preemptions: int = 0  # to give another client its share of the running slots
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_draft_tokens: int = 0  # prompt-lookup speculation: draft tokens computed
    spec_accepted_tokens: int = 0  # of those, the ones the model's picks confirmed
    max_loras: int = 0  # 0: LoRA disabled
    lora_loads: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    # a remote engine (--engine-url): each backend's URL, whether its last probe passed, and why not
    backends: tuple[tuple[str, bool, str], ...] = ()


@dataclass(slots=True)
class EngineLimits:
    """What the server's settings impose on the engine (set once by the app)."""

    default_timeout_s: float | None = None  # the deadline of requests that set none
    stuck_after_s: float = 60.0  # unhealthy once one step has run this long


class EngineClient(Protocol):
    model_info: ModelInfo
    tokenizer: Any
    limits: EngineLimits
    # Called with each sample's final output (metrics, the request's log line), an abandoned sample's last
    # one included (FinishedNotice); must be cheap and must not raise.
    finished_listeners: list[Callable[[RequestOutput], None]]

    def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs; closing the generator early (``aclose``) aborts it. A LoRA reference must
        already be resolved to a local adapter (``LoraRef.path``)."""
        ...

    async def pool(self, request: PoolingRequest) -> PoolingOutput:
        """A prompt's hidden states pooled as ``request.params`` asks (engine/pooling.py), sampling nothing;
        refused (InvalidRequestError naming the field) where the served model cannot pool that way."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def encode_prompt(self, prompt: Prompt) -> list[int]: ...

    def encode_prompt_sync(self, prompt: Prompt) -> list[int]: ...

    def min_num_tokens(self, texts: list[str]) -> int: ...

    def is_healthy(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    @property
    def num_active_requests(self) -> int: ...

    @property
    def lora_enabled(self) -> bool: ...

    def check_adapter(self, path: str, name: str) -> None:
        """Validate a local adapter against the served model (raises LoraUnavailableError)."""
        ...

    def register_adapter(self, path: str, name: str, identity: str) -> None:
        """An operator's adapter, checked and kept (pinned) under ``identity`` until ``forget_adapter``."""
        ...

    def forget_adapter(self, identity: str) -> None:
        """One registration of ``identity`` ended (requests already admitted keep their adapter)."""
        ...

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def fail_all(self, exc: BaseException) -> None: ...


class FinishedNotice:
    """Tells the finished-listeners about each sample of one request exactly once: at its final output, or,
    for a sample its caller stopped reading (the client left, the deadline passed), at the end with the last
    output the caller saw, as aborted. So an abandoned answer's tokens and first-token time still reach the
    metrics and the request's log line. A sample that produced nothing is not reported."""

    def __init__(self, listeners: list[Callable[[RequestOutput], None]]) -> None:
        self._listeners = listeners
        self._open: dict[int, RequestOutput] = {}  # sample index -> its latest output, not final

    def saw(self, out: RequestOutput) -> None:
        if not out.finished:
            self._open[out.index] = out
            return
        self._open.pop(out.index, None)
        self._notify(out)

    def abandoned(self) -> None:
        """The caller stopped reading: report each sample still open with its last output, as aborted."""
        for out in self._open.values():
            self._notify(replace(out, new_token_ids=[], text_delta="", token_texts=None, logprobs=None,
                                 prompt_logprobs=None, finished=True, finish_reason="abort", stop_reason=None))
        self._open.clear()

    def _notify(self, out: RequestOutput) -> None:
        for listener in self._listeners:
            listener(out)
