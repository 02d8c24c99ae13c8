"""GET /metrics in Prometheus format, named like vLLM's (`vllm:` -> `spark:`) so dashboards translate;
the few gauges fleet routers read also under vLLM's own `vllm:` names."""

from __future__ import annotations

import contextvars
import logging
import time
import uuid
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import Response

from bridges.log_safety import protect
from bridges.registry import Registry
from engine.cpu_contention import ThreadQueueing
from engine.request import RequestOutput

logger = protect(logging.getLogger("spark_server.requests"))

# Per HTTP request: protocol, id, and what the engine reports when its samples finish (tokens, TTFT).
# Set by the middleware, filled by the engine's finished-listener running inside the request's task.
REQUEST_CONTEXT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("spark_request", default=None)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


class _EngineCollector:
    """Gauges read from the engine at scrape time (no bookkeeping on the hot path)."""

    def __init__(self, app_state: Any, model_name: str) -> None:
        self.state = app_state
        self.model_name = model_name

    def collect(self) -> Iterable:
        engine = getattr(self.state, "engine", None)
        if engine is not None:
            st = engine.stats()
            yield self._one(GaugeMetricFamily, "spark:num_requests_running", "Sequences in the running batch.",
                            st.num_requests_running)
            yield self._one(GaugeMetricFamily, "spark:num_requests_waiting", "Sequences waiting to be scheduled.",
                            st.num_requests_waiting)
            yield self._one(GaugeMetricFamily, "spark:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).",
                            st.kv_cache_usage)
            yield self._one(CounterMetricFamily, "spark:num_preemptions", "Sequences preempted for KV space.",
                            st.num_preemptions)
            yield self._one(CounterMetricFamily, "spark:num_share_preemptions",
                            "Sequences preempted to give another client its share of the running slots.",
                            st.num_share_preemptions)
            yield self._one(CounterMetricFamily, "spark:prefix_cache_queries",
                            "Admissions that looked up the prefix cache.", st.prefix_cache_queries)
            yield self._one(CounterMetricFamily, "spark:prefix_cache_hits",
                            "Admissions that reused cached prefix blocks.", st.prefix_cache_hits)
            if st.max_loras:
                yield self._one(CounterMetricFamily, "spark:lora_loads", "Adapters loaded into a slot.", st.lora_loads)
            yield self._one(CounterMetricFamily, "spark:spec_decode_num_draft_tokens",
                            "Prompt-lookup draft tokens computed.", st.spec_draft_tokens)
            yield self._one(CounterMetricFamily, "spark:spec_decode_num_accepted_tokens",
                            "Draft tokens the model's own picks confirmed.", st.spec_accepted_tokens)
            yield from self._vllm_named(st)
        resolver = getattr(self.state, "lora_resolver", None)
        store = getattr(resolver, "store", None)
        if store is not None:
            yield self._one(CounterMetricFamily, "spark:lora_cache_hits", "LoRA pack requests served from the cache.",
                            store.num_hits)
            yield self._one(CounterMetricFamily, "spark:lora_downloads", "LoRA packs downloaded and verified.",
                            store.num_downloads)

    def _vllm_named(self, st: Any) -> Iterable:
        """The gauges a fleet's routers read under vLLM's own names: smg's load monitor and the Gateway
        API Inference Extension's model-server protocol (queue, KV usage, LoRA adapters)."""
        yield self._one(GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch.",
                        st.num_requests_running)
        yield self._one(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                        st.num_requests_waiting)
        yield self._one(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV cache usage (1 = full).",
                        st.kv_cache_usage)
        hit_rate = st.prefix_cache_hits / st.prefix_cache_queries if st.prefix_cache_queries else 0.0
        yield self._one(GaugeMetricFamily, "vllm:gpu_prefix_cache_hit_rate",
                        "Share of admissions that reused cached prefix blocks (vLLM's name).", hit_rate)
        if st.max_loras:
            # vLLM's shape: one sample, the adapters in labels, the value a timestamp
            info = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA adapters.",
                                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric([str(st.max_loras), ",".join(st.running_lora_adapters),
                             ",".join(st.waiting_lora_adapters)], time.time())
            yield info

    def _one(self, family: type, name: str, doc: str, value: float):
        metric = family(name, doc, labels=["model_name"])
        metric.add_metric([self.model_name], value)
        return metric


def note_in_request_context(out: RequestOutput) -> None:
    """Engine finished-listener (registered once per engine): tokens and TTFT for the request's log line."""
    ctx = REQUEST_CONTEXT.get()
    if ctx is not None:
        ctx["prompt_tokens"] = ctx.get("prompt_tokens", 0) + out.num_prompt_tokens
        ctx["completion_tokens"] = ctx.get("completion_tokens", 0) + out.num_output_tokens
        if out.timings.first_token_s is not None and "ttft" not in ctx:
            ctx["ttft"] = out.timings.first_token_s


class _ThreadQueueingCollector:
    """The server process's threads' CPU time and their waiting for a CPU, as two counters read at scrape
    time (engine/cpu_contention.py): the second's rate over the sum of both rates is the share of the time
    the threads wanted a CPU that they spent queued for one, which should stay near zero; where it does
    not, other work computes on the server's cores."""

    def __init__(self, model_name: str) -> None:
        self.queueing = ThreadQueueing()
        self.model_name = model_name

    def collect(self) -> Iterable:
        if not self.queueing.known:
            return
        self.queueing.update()
        for name, text, value in (
                ("spark:cpu_run_seconds", "CPU time of the server's threads.", self.queueing.ran_s),
                ("spark:cpu_queue_seconds", "Time the server's threads stood runnable, waiting for a CPU (other "
                 "work on the same cores, or more threads than cores).", self.queueing.waited_s)):
            metric = CounterMetricFamily(name, text, labels=["model_name"])
            metric.add_metric([self.model_name], value)
            yield metric


class Metrics:
    """Request metrics, each labelled with the served model's name (as vLLM's `model_name`), plus the
    engine's gauges read at scrape time and the process's own (CPU, memory, open files)."""

    def __init__(self, app_state: Any, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(app_state, model_name))
        self.registry.register(_ThreadQueueingCollector(model_name))
        ProcessCollector(registry=self.registry)
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram("spark:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.tpot = Histogram("spark:time_per_output_token_seconds", "Time per output token after the first.",
                              labels, buckets=TPOT_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("spark:e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.requests = Counter("spark:requests", "Finished requests by protocol and result code.",
                                ["protocol", "code", "model_name"], registry=self.registry)
        self.prompt_tokens = Counter("spark:prompt_tokens", "Prompt tokens processed.", labels,
                                     registry=self.registry).labels(model_name)
        self.generation_tokens = Counter("spark:generation_tokens", "Tokens generated.", labels,
                                         registry=self.registry).labels(model_name)

    def observe_finished(self, out: RequestOutput) -> None:
        """Called by the engine for every sample's final output."""
        t = out.timings
        if t.first_token_s is not None:
            self.ttft.observe(t.first_token_s)
            if out.num_output_tokens > 1:
                self.tpot.observe(t.decode_s / (out.num_output_tokens - 1))
        if t.arrival:
            self.e2e.observe(max(0.0, time.monotonic() - t.arrival))
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.generation_tokens.inc(out.num_output_tokens)

    def count(self, protocol: str, code: int | str) -> None:
        self.requests.labels(protocol=protocol, code=str(code), model_name=self.model_name).inc()


class RequestCounter:
    """ASGI middleware counting HTTP answers by protocol and status, and logging one line per request
    (Spark sessions count and log themselves)."""

    def __init__(self, app, metrics: Metrics, registry: Registry, echo_request_id: bool = True) -> None:
        self.app = app
        self.metrics = metrics
        self.registry = registry  # which protocol answers a path
        self.echo_request_id = echo_request_id

    async def __call__(self, scope, receive, send) -> None:
        declared = None
        if scope["type"] == "http" and scope.get("method") == "POST":
            declared = self.registry.protocol_of(scope.get("path", ""))
        if declared is None or declared.counts_itself:
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        status = {"code": 500}
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode(errors="replace")[:128]
        ctx = {"id": given or uuid.uuid4().hex[:16]}
        token = REQUEST_CONTEXT.set(ctx)
        started = time.monotonic()

        state["request_id"] = ctx["id"]  # request.state.request_id, for error logs

        async def record(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            if message["type"] == "http.response.start" and self.echo_request_id:
                # echoed as vLLM does (--enable-request-id-headers): the client's id, or the one we made
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", ctx["id"].encode("latin-1", "replace"))]}
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            REQUEST_CONTEXT.reset(token)
            protocol = state.get("protocol", declared.label)  # a shared path's handler names the one it chose
            self.metrics.count(protocol, status["code"])
            ttft = ctx.get("ttft")
            logger.info("request id=%s protocol=%s path=%s prompt_tokens=%d completion_tokens=%d ttft=%s "
                        "duration=%.3f code=%d", ctx["id"], protocol, scope.get("path"), ctx.get("prompt_tokens", 0),
                        ctx.get("completion_tokens", 0), f"{ttft:.3f}" if ttft is not None else "-",
                        time.monotonic() - started, status["code"])


async def metrics_endpoint(request: Request) -> Response:
    metrics: Metrics = request.app.state.metrics
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
