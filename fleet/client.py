"""An engine that is somewhere else: the same ``EngineClient`` face, over a fleet's OpenAI API.

``spark-server serve --engine-url URL[,URL...]`` runs the Spark WebSocket, Spark HTTP and every bridge
with no local model. Prompts are templated and tokenized here (so Spark's token limits, history fitting
and usage stay exact) and go to the backends' ``/v1/completions``, streamed: as the exact text of those
ids when it tokenizes back to them (what a router routes on), as the ids otherwise; vLLM, SGLang and
this server take both. One URL is usually a router (``smg``) that picks the replica; several are tried
in turn when one refuses a request it never took (nothing listening, a 503): a request a backend
accepted and then failed on is never sent to another, since the request itself may be what failed it.

The sampling fields of each body come from the ``sampling_fields`` function the app hands over
(``bridges.openai_fields.openai_fields``: the sampling table's OpenAI column inverted), so this client
holds no sampling vocabulary of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from engine.errors import (
    EngineOverloadedError,
    EngineShutdownError,
    EngineUnavailableError,
    InferenceError,
    InvalidRequestError,
    LoraUnavailableError,
    RequestTimeoutError,
)
from engine.generation_config import recommended_sampling_or_none
from engine.pooling import PoolingOutput, PoolingRequest
from engine.prompts import PromptEncoder, read_chat_template
from engine.protocol import EngineLimits, EngineStats, FinishedNotice, ModelInfo
from engine.request import GenerationRequest, LoraRef, Prompt, RequestOutput, RequestTimings, TokenLogprob, TokensPrompt
from engine.sampling_params import SamplingParams
from fleet.names import adapter_name, content_named

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 2.0
# Answers that refuse a request before taking it (the body not read in time, too busy, not ready): the
# backend did no work for it, so another may take it. Any other failure status (500, a router's 502 /
# 504 for a replica that failed on the request) came after the request was accepted.
RETRYABLE_STATUS = (408, 429, 503)
# Transport failures before a byte of the request was sent: nothing listening, no connection in time.
NOT_DELIVERED = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


class BackendUnavailable(Exception):
    """A backend refused the request without taking it: the request may go to the next one."""

    def __init__(self, url: str, reason: str, overloaded: bool = False) -> None:
        super().__init__(f"{url}: {reason}")
        self.overloaded = overloaded


class BackendFailed(Exception):
    """A backend took the request and its connection broke before the answer: the backend is probably
    down, perhaps because of this very request, which therefore goes to no other backend."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"backend {url} failed on the request after accepting it: {reason}")


@dataclass
class Backend:
    url: str
    healthy: bool = True
    last_error: str = ""
    # when the URL is a router (smg's GET /workers answers): its replicas, URL -> healthy
    workers: dict[str, bool] = field(default_factory=dict)


# What the client needs back in every stream, whatever the request: each chunk's token ids (the local
# detokenizer and usage stay exact), usage on every chunk, and logprobs keyed by token id.
STREAM_FIELDS: dict[str, Any] = {"stream": True, "return_token_ids": True,
                                 "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def completion_body(model: str, prompt: str | list[int], sampling: dict[str, Any]) -> dict[str, Any]:
    """A /v1/completions body: ``sampling`` (a request's SamplingParams as the backends spell them) and
    what this client needs to read the answer. A text prompt is the exact text of the local token ids."""
    body: dict[str, Any] = {**sampling, "model": model, "prompt": prompt, **STREAM_FIELDS}
    if isinstance(prompt, str):
        body["add_special_tokens"] = False  # the text already holds them, as the template wrote them
    if "logprobs" in sampling:
        body["return_tokens_as_token_ids"] = True  # "token_id:<id>" names: no text to map back
    return body


def _token_id(name: str) -> int:
    return int(name.removeprefix("token_id:"))


def _logprobs(chunk: dict[str, Any], ids: list[int]) -> list[TokenLogprob] | None:
    lp = chunk.get("logprobs")
    if not lp or lp.get("token_logprobs") is None:
        return None
    out = []
    tops = lp.get("top_logprobs") or [None] * len(lp["token_logprobs"])
    for i, value in enumerate(lp["token_logprobs"]):
        tid = ids[i] if i < len(ids) else _token_id(lp["tokens"][i])
        top = [(_token_id(k), v) for k, v in (tops[i] or {}).items()]
        out.append(TokenLogprob(tid, float(value if value is not None else 0.0), top))
    return out


def error_from_status(status: int, text: str, url: str) -> Exception:
    """A backend's refusal as the engine's exception (the bridges map those to each protocol)."""
    try:
        err = json.loads(text)
        err = err.get("error", err) if isinstance(err, dict) else {}
        message = err.get("message") if isinstance(err, dict) else None
        param = err.get("param") if isinstance(err, dict) else None
    except ValueError:
        message, param = None, None
    message = message or text[:300] or f"HTTP {status}"
    if status in (400, 422):
        return InvalidRequestError(message, parameter=param)
    if status == 404:
        return LoraUnavailableError(message, code="unknown_adapter")
    if status in RETRYABLE_STATUS:
        return BackendUnavailable(url, f"HTTP {status}: {message}", overloaded=status in (429, 503))
    return InferenceError(f"backend {url}: HTTP {status}: {message}")  # it took the request: not retried


SamplingFields = Callable[[SamplingParams], dict[str, Any]]


class RemoteEngine:
    """``EngineClient`` over OpenAI-compatible backends (a router, or replicas tried in turn).
    ``sampling_fields``: a request's SamplingParams as /v1/completions fields; it raises the engine's
    ``InvalidRequestError`` for a parameter the backends' API cannot carry (the request is refused)."""

    def __init__(self, urls: list[str], sampling_fields: SamplingFields, tokenizer_source: str | None = None,
                 served_model_name: str | None = None, api_key: str | None = None, max_model_len: int | None = None,
                 chat_template: str | None = None, connect_timeout_s: float = 5.0) -> None:
        from engine.model_loader import EMBEDDED_MODEL_NAME, resolve_model_dir
        from engine.tokenizer_files import load_tokenizer

        if not urls:
            raise ValueError("--engine-url names no backend")
        self.backends = [Backend(u.rstrip("/")) for u in urls]
        self.sampling_fields = sampling_fields
        self._next = itertools.count()
        self.tokenizer_dir = resolve_model_dir(tokenizer_source)
        self.tokenizer = load_tokenizer(self.tokenizer_dir)
        if chat_template:
            self.tokenizer.chat_template = read_chat_template(chat_template)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.connect_timeout_s = connect_timeout_s
        self._client: httpx.AsyncClient | None = None
        backend_name, backend_len = self._probe_model()
        name = served_model_name or backend_name or (EMBEDDED_MODEL_NAME if tokenizer_source in (None, "", "embedded")
                                                     else self.tokenizer_dir.name)
        self.backend_model = backend_name or name  # what the backends call the base model
        max_len = max_model_len or backend_len or getattr(self.tokenizer, "model_max_length", None) or 8192
        max_len = min(int(max_len), 1 << 20)
        self.model_info = ModelInfo(name=name, path=f"remote:{','.join(b.url for b in self.backends)}",
                                    model_type="remote", max_model_len=max_len, vocab_size=len(self.tokenizer),
                                    dtype="remote", device="remote",
                                    chat_template_tools="tools" in (self.tokenizer.chat_template or ""),
                                    recommended_sampling=tuple(recommended_sampling_or_none(self.tokenizer_dir).items()))
        self.prompts = PromptEncoder(self.tokenizer, max_len, len(self.tokenizer))
        self.limits = EngineLimits()
        self.finished_listeners: list[Callable[[RequestOutput], None]] = []
        self._active = 0  # requests whose caller is still reading
        self._stopping = False
        self._health_task: asyncio.Task | None = None
        # replica URL -> {adapter name: identity} of what this front end loaded there
        self._loaded: dict[str, dict[str, str]] = {}

    # ---- start-up ------------------------------------------------------------------------------

    def _probe_model(self) -> tuple[str | None, int | None]:
        """The backends' model name and context length from /v1/models (the first that answers)."""
        for b in self.backends:
            try:
                r = httpx.get(f"{b.url}/v1/models", headers=self.headers, timeout=self.connect_timeout_s)
                r.raise_for_status()
                models = r.json().get("data") or []
            except (httpx.HTTPError, ValueError) as exc:
                b.healthy, b.last_error = False, str(exc)
                continue
            base = next((m for m in models if not m.get("parent")), models[0] if models else None)
            if base:
                return base.get("id"), base.get("max_model_len")
        logger.warning("no backend answered /v1/models at start; the model name and context come from the "
                       "tokenizer until one does")
        return None, None

    def start(self) -> None:
        if logging.getLogger("httpx").level == logging.NOTSET:  # one line per health probe otherwise
            logging.getLogger("httpx").setLevel(logging.WARNING)
        if self._client is None:
            self._client = httpx.AsyncClient(headers=self.headers,
                                             timeout=httpx.Timeout(None, connect=self.connect_timeout_s),
                                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._health_task is None:
            self._health_task = loop.create_task(self._watch_health())

    def shutdown(self) -> None:
        self._stopping = True
        if self._health_task is not None:
            self._health_task.cancel()
            self._health_task = None

    async def _watch_health(self) -> None:
        while True:
            await self.check_backends()
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def check_backends(self) -> None:
        """Probe every backend's /health (a router's own /health answers for its fleet)."""
        client = self._client
        assert client is not None

        async def probe(b: Backend) -> None:
            try:
                r = await client.get(f"{b.url}/health", timeout=self.connect_timeout_s)
                b.healthy, b.last_error = r.status_code == 200, "" if r.status_code == 200 else f"HTTP {r.status_code}"
                b.workers = await self._router_workers(b) if b.healthy else {}
            except httpx.HTTPError as exc:
                b.healthy, b.last_error, b.workers = False, f"{type(exc).__name__}: {exc}", {}

        await asyncio.gather(*(probe(b) for b in self.backends))

    async def _router_workers(self, b: Backend) -> dict[str, bool]:
        """A router's replicas and their health (smg's GET /workers); {} for a plain backend."""
        assert self._client is not None
        try:
            r = await self._client.get(f"{b.url}/workers", timeout=self.connect_timeout_s)
            listed = r.json().get("workers") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return {}
        if not isinstance(listed, list):
            return {}
        return {str(w.get("url")): bool(w.get("is_healthy", w.get("healthy", True)))
                for w in listed if isinstance(w, dict) and w.get("url")}

    # ---- EngineClient --------------------------------------------------------------------------

    def is_healthy(self) -> bool:
        return not self._stopping and any(b.healthy for b in self.backends)

    def stats(self) -> EngineStats:
        backends: list[tuple[str, bool, str]] = []
        for b in self.backends:
            backends.append((b.url, b.healthy, b.last_error))
            backends += [(url, ok, f"behind {b.url}") for url, ok in sorted(b.workers.items())]
        return EngineStats(num_requests_running=self._active, backends=tuple(backends))

    @property
    def num_active_requests(self) -> int:
        return self._active

    @property
    def lora_enabled(self) -> bool:
        return True  # the backends say whether they take adapters; a refusal is a LoraUnavailableError

    def check_adapter(self, path: str, name: str) -> None:
        """A pack is checked against the tokenizer's model config when it is a local HF directory;
        the backend checks it again when it loads it."""
        from transformers import AutoConfig

        from engine.lora import read_adapter

        try:
            config = AutoConfig.from_pretrained(self.tokenizer_dir)
        except (OSError, ValueError):
            return
        read_adapter(path, name, config, max_rank=1 << 16)

    def register_adapter(self, path: str, name: str, identity: str) -> None:
        """Nothing is kept here: the backends load (and keep) what requests name."""
        self.check_adapter(path, name)

    def forget_adapter(self, identity: str) -> None:
        """A name registered again gets another identity, and ``_ensure_adapter`` then replaces the
        backends' copy; nothing to do now."""

    def encode_prompt_sync(self, prompt: Prompt) -> list[int]:
        return self.prompts.encode(prompt)

    async def encode_prompt(self, prompt: Prompt) -> list[int]:
        return await asyncio.to_thread(self.prompts.encode, prompt)

    def min_num_tokens(self, texts: list[str]) -> int:
        return self.prompts.min_num_tokens(texts)

    async def abort(self, request_id: str) -> None:
        """Requests end when their caller leaves the stream (the backend sees the connection close)."""

    async def pool(self, request: PoolingRequest) -> PoolingOutput:
        """Pooling is refused: the backends' answers cannot be routed by the completions path a front end
        speaks, and a front end holds no model of its own."""
        raise InvalidRequestError("embeddings, scores and classes are not served through --engine-url: this front "
                                  "end speaks completions to its backends; send pooling requests to a backend "
                                  "directly", parameter="model")

    def fail_all(self, exc: BaseException) -> None:
        self._stopping = True

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        if self._stopping:
            raise EngineShutdownError("the server is shutting down")
        if self._client is None:
            self.start()
        if request.deadline is None and self.limits.default_timeout_s:
            request.deadline = request.arrival_time + self.limits.default_timeout_s
        sampling = self.sampling_fields(request.params)  # a parameter it cannot carry is refused before any work
        ids, wire = await asyncio.to_thread(self._encode, request.prompt, request.params.truncate_prompt_tokens)
        body = completion_body(self.backend_model, wire, sampling)
        if request.lora is not None:
            self._name_adapter(body, adapter_name(request.lora))
        self._active += 1
        notice = FinishedNotice(self.finished_listeners)
        try:
            async for out in self._stream_with_retry(request, body, len(ids)):
                notice.saw(out)
                yield out
        finally:
            self._active -= 1
            notice.abandoned()

    def _name_adapter(self, body: dict[str, Any], name: str) -> None:
        """vLLM names an adapter as the model; a router that routes by model name (smg) knows only the base
        model, so behind one the adapter goes in SGLang's ``lora_path`` (SGLang and this server read it)."""
        if any(b.workers for b in self.backends):
            body["lora_path"] = name
        else:
            body["model"] = name

    def _encode(self, prompt: Prompt, truncate: int | None) -> tuple[list[int], str | list[int]]:
        """(the prompt's token ids, what goes on the wire). Text whenever it tokenizes back to exactly
        these ids: routers route on text (smg's cache-aware tree is built from it, and smg refuses
        token-id prompts on /v1/completions); the ids themselves otherwise (a client's own ids)."""
        ids = self.prompts.encode(prompt, truncate)
        if isinstance(prompt, TokensPrompt):
            return ids, ids
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if self.tokenizer.encode(text, add_special_tokens=False) == ids:
            return ids, text
        return ids, ids

    # ---- streaming -----------------------------------------------------------------------------

    def _order(self) -> list[Backend]:
        """Healthy backends first, starting from the next in turn."""
        start = next(self._next) % len(self.backends)
        turn = self.backends[start:] + self.backends[:start]
        return [b for b in turn if b.healthy] + [b for b in turn if not b.healthy]

    async def _stream_with_retry(self, request: GenerationRequest, body: dict[str, Any],
                                 num_prompt: int) -> AsyncIterator[RequestOutput]:
        """A backend that refuses the request without taking it (``BackendUnavailable``) is followed by
        the next, once (with one URL: the same router, which picks another replica). A backend that took
        it and then failed ends the request, first token or not: a request that crashes a backend must
        not go on to crash the next."""
        order = self._order()
        attempts = order[:2] if len(order) > 1 else order * 2
        last: BackendUnavailable | None = None
        for attempt, backend in enumerate(attempts):
            started = False
            try:
                if request.lora is not None:
                    await self._ensure_adapter(backend, request.lora)
                async for out in self._stream(backend, request, body, num_prompt):
                    started = True
                    yield out
                return
            except BackendFailed as exc:
                backend.healthy, backend.last_error = False, str(exc)  # until its health probe passes again
                raise InferenceError(str(exc)) from None
            except BackendUnavailable as exc:
                if started:
                    raise InferenceError(str(exc)) from None
                backend.healthy, backend.last_error = False, str(exc)
                last = exc
                if attempt + 1 < len(attempts):
                    logger.warning("backend failed before the first token, retrying: %s", exc)
        assert last is not None
        if last.overloaded:
            raise EngineOverloadedError(f"every backend is busy: {last}")
        raise EngineUnavailableError(f"no backend could take the request: {last}")

    async def _ensure_adapter(self, backend: Backend, ref: LoraRef) -> None:
        """vLLM's POST /v1/load_lora_adapter on every replica that may serve the request (a router's
        replicas, as its GET /workers lists them; else the backend itself), once per replica and
        identity: a name registered again here (other weights) is unloaded there and loaded anew."""
        name = adapter_name(ref)
        identity = ref.identity or f"path:{ref.path}"
        targets = sorted(backend.workers) or [backend.url]
        missing = [t for t in targets if self._loaded.setdefault(t, {}).get(name) != identity]
        if not missing:
            return
        assert self._client is not None and ref.path
        client = self._client
        body = {"lora_name": name, "lora_path": ref.path}

        async def load(target: str) -> None:
            try:
                if name in self._loaded[target]:  # loaded there before with other weights: replaced
                    await client.post(f"{target}/v1/unload_lora_adapter", json={"lora_name": name})
                r = await client.post(f"{target}/v1/load_lora_adapter", json=body)
                if r.status_code != 200 and "already been loaded" in r.text and not content_named(name):
                    # "Already loaded" is believed only for a name that states its content: this server's
                    # backends register `lora-<md5>` only for a pack whose bytes have that md5
                    # (spark_server/fleet.py checks it), so whatever one holds under it has these weights.
                    # Any other name is this front end's operator's: what a backend holds under it cannot
                    # be checked from here, so it is replaced with ours. (vLLM backends take any name:
                    # their runtime adapter loading must stay closed to tenants for the same guarantee.)
                    await client.post(f"{target}/v1/unload_lora_adapter", json={"lora_name": name})
                    r = await client.post(f"{target}/v1/load_lora_adapter", json=body)
            except httpx.HTTPError as exc:
                if target == backend.url:
                    raise BackendUnavailable(backend.url, f"loading adapter {name}: {exc}") from None
                return  # a replica that is down gets it when it is back
            if r.status_code == 200 or ("already been loaded" in r.text and content_named(name)):
                self._loaded[target][name] = identity
                return
            raise LoraUnavailableError(f"{target} refused adapter {name}: HTTP {r.status_code} {r.text[:300]}",
                                       code="incompatible" if r.status_code == 400 else "load_failed")

        await asyncio.gather(*(load(t) for t in missing))

    async def _stream(self, backend: Backend, request: GenerationRequest, body: dict[str, Any],
                      num_prompt: int) -> AsyncIterator[RequestOutput]:
        assert self._client is not None
        t0 = time.monotonic()
        remaining = None if request.deadline is None else max(request.deadline - time.monotonic(), 0.001)
        timings = RequestTimings(arrival=request.arrival_time)
        outputs: dict[int, int] = {}  # sample index -> its tokens so far
        finished = 0
        try:
            async with asyncio.timeout(remaining):
                async with self._client.stream("POST", f"{backend.url}/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        raise error_from_status(resp.status_code, (await resp.aread()).decode(errors="replace"),
                                                backend.url)
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:  # an error event after the stream began: the request was taken
                            err = chunk["error"]
                            message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                            raise InferenceError(f"backend {backend.url}: {message}")
                        usage = chunk.get("usage") or {}
                        for choice in chunk.get("choices") or []:
                            out = self._output(request, choice, usage, num_prompt, outputs, timings, t0)
                            if out is None:
                                continue
                            finished += out.finished
                            yield out
        except TimeoutError:
            raise RequestTimeoutError("request timed out (deadline passed)") from None
        except NOT_DELIVERED as exc:
            raise BackendUnavailable(backend.url, f"{type(exc).__name__}: {exc}") from None
        except httpx.HTTPError as exc:  # a read or write error, a dropped connection: it may have the request
            if outputs:
                raise InferenceError(f"backend {backend.url} failed mid-answer: {type(exc).__name__}: {exc}") from None
            raise BackendFailed(backend.url, f"{type(exc).__name__}: {exc}") from None
        if finished < request.params.n:
            if not outputs:
                raise InferenceError(f"backend {backend.url} ended the stream before any token")
            raise InferenceError(f"backend {backend.url} ended the stream before the answer finished")

    def _output(self, request: GenerationRequest, choice: dict[str, Any], usage: dict[str, Any], num_prompt: int,
                outputs: dict[int, int], timings: RequestTimings, t0: float) -> RequestOutput | None:
        index = int(choice.get("index", 0))
        text = choice.get("text") or ""
        ids = [int(t) for t in choice.get("token_ids") or []]
        reason = choice.get("finish_reason")
        if not ids and not text and reason is None:
            return None
        if not ids and text and "token_ids" not in choice:  # a backend without return_token_ids: count locally
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        now = time.monotonic()
        first = index not in outputs
        outputs[index] = outputs.get(index, 0) + len(ids)
        if first and ids:
            timings.first_token_s = now - request.arrival_time
            timings.prefill_s = now - t0
        timings.decode_s = now - t0 - timings.prefill_s
        finish = {"stop": "stop", "length": "length", "abort": "abort"}.get(reason) if reason else None
        if reason and finish is None:
            finish = "stop"
        return RequestOutput(
            request_id=request.request_id, index=index, new_token_ids=ids, text_delta=text,
            num_prompt_tokens=int(usage.get("prompt_tokens") or num_prompt),
            num_output_tokens=outputs[index], num_cached_tokens=int(
                ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0),
            logprobs=_logprobs(choice, ids), finished=finish is not None, finish_reason=finish,  # type: ignore[arg-type]
            stop_reason=choice.get("stop_reason"), timings=timings)
