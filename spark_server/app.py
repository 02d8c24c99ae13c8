"""The app factory: Spark endpoints (and, later, every bridge) on one Starlette app."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import fields
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware

from bridges.context import ProtocolOptions, build_context
from bridges.registry import Operation, Protocol, Registry, discover
from engine.model_loader import default_cache_dir
from engine.protocol import EngineClient
from lora_store.pack import UnpackLimits
from lora_store.resolver import RESERVED_PREFIXES, LoraResolver, reserved, store_validator
from lora_store.store import LoraStore, StoreLimits
from spark_server.auth import AdminGate, AllowedHosts, ApiKeyMiddleware, ReplayGuard, parse_key_pairs
from spark_server.fleet import (
    Replica,
    get_pack,
    load_lora_adapter,
    model_info,
    publish_pack,
    server_info,
    unload_lora_adapter,
    version_endpoint,
)
from spark_server.health import health
from spark_server.limits import BodySizeLimit
from spark_server.metrics import Metrics, RequestCounter, metrics_endpoint, note_in_request_context
from spark_server.playground import PlaygroundConfig, check, playground, sign
from spark_server.sampling_defaults import openai_sampling_defaults
from spark_server.settings import Settings
from spark_server.shutdown import DrainGuard
from spark_server.spark_endpoints import SPARK_HTTP_PATH, SPARK_WS_PATH, HandshakeRules, SparkEndpoints
from spark_server.spark_protocol import SparkOptions
from spark_server.spark_public import PublicForm, PublicSettings

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger(__name__)

__all__ = ["SPARK_HTTP_PATH", "SPARK_WS_PATH", "build_app", "uvicorn_config"]

def server_protocol(replica: Replica, page: PlaygroundConfig) -> Protocol:
    """The server's own operations, each bound to what it reads (no handler reads app.state)."""
    return Protocol("server", (
        Operation("GET", "/health", health, "ready when the model is loaded"),
        Operation("GET", "/metrics", metrics_endpoint, "Prometheus metrics"),
        Operation("GET", "/", partial(playground, config=page), "the browser playground (a Spark WebSocket "
                  "conversation)"),
        Operation("POST", "/playground/sign", partial(sign, config=page), "a signed Spark WebSocket URL for the "
                  "playground (--spark-auth)"),
        Operation("GET", "/playground/check", partial(check, config=page), "how the Spark WebSocket's handshake "
                  "would answer this query (the playground's: a browser never sees why a socket was refused)"),
        Operation("GET", "/version", version_endpoint, "the server's version (vLLM's; routers identify the engine "
                  "by it)"),
        Operation("GET", "/server_info", partial(server_info, replica=replica), "the replica's settings in SGLang's "
                  "shape (routers read it)"),
        Operation("GET", "/model_info", partial(model_info, replica=replica), "the served model in SGLang's shape "
                  "(routers read it)"),
        Operation("POST", "/v1/load_lora_adapter", partial(load_lora_adapter, replica=replica), "vLLM's: register "
                  "an adapter under a name (a directory under --lora-shared-dir, or a pack url + md5)"),
        Operation("POST", "/v1/unload_lora_adapter", partial(unload_lora_adapter, replica=replica), "vLLM's: forget "
                  "a registered adapter"),
        Operation("POST", "/v1/lora/packs", partial(publish_pack, replica=replica), "publish a LoRA pack (the file "
                  "as the body; --api-key): checked against the served model, kept by md5, answered with "
                  "{url, md5}"),
        Operation("GET", "/lora/packs/{name}", partial(get_pack, replica=replica), "a published LoRA pack, "
                  "<md5>.<ext>"),
    ))


def protocol_options(settings: Settings, overrides: Mapping[str, Any] | None = None) -> ProtocolOptions:
    """The settings the protocols read, each under its own name; ``overrides``: what start-up decided
    beside the settings (vLLM's further served names, --return-tokens-as-token-ids)."""
    values = {f.name: getattr(settings, f.name) for f in fields(ProtocolOptions) if hasattr(settings, f.name)}
    values.update(overrides or {})
    values["model_aliases"] = tuple(values.get("model_aliases", ()))
    return ProtocolOptions(**values)


def build_app(settings: Settings, engine: EngineClient, owns_engine: bool = True,
              protocol_overrides: Mapping[str, Any] | None = None) -> Starlette:
    """``engine`` is started/stopped with the app when ``owns_engine``. ``protocol_overrides``: options the
    protocols read that start-up sets beside the settings (``ProtocolOptions``' names)."""

    taken = [name for name in settings.lora_sources() if reserved(name)]
    if taken:
        raise ValueError(f"--lora {taken[0]}: names starting with {' or '.join(RESERVED_PREFIXES)} are the "
                         "server's own; choose another")
    defaults = openai_sampling_defaults(settings.generation_config, settings.override_generation_config,
                                        engine.model_info)
    options = protocol_options(settings, {**(protocol_overrides or {}),
                                          "openai_sampling_defaults": tuple(defaults.knobs.items()),
                                          "openai_max_tokens_cap": defaults.max_tokens_cap})
    resolver = attach_lora(settings, engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if owns_engine:
            engine.start()
        if resolver is not None:
            for name, source in settings.lora_sources().items():
                await resolver.register(name, source)
        try:
            yield
        finally:
            if owns_engine:
                engine.shutdown()

    spark_keys = parse_key_pairs(settings.spark_auth)
    spark = SparkEndpoints(
        SparkOptions(settings.max_history_tokens, settings.spark_http_markers),
        PublicForm(PublicSettings.from_flags(settings.spark_app_ids, settings.spark_domains, signing=bool(spark_keys))),
        HandshakeRules(settings.api_key, spark_keys, ReplayGuard(), settings.origins, settings.ws_request_timeout),
        on_result=lambda protocol, code: metrics.count(protocol, code))  # sessions counted; metrics: made below
    server = server_protocol(Replica(settings, engine, resolver),
                             PlaygroundConfig(engine.model_info.name, settings.api_key, spark_keys, settings.origins))
    registry = Registry([spark.protocol(), server, *discover()], settings)
    serving = build_context(engine, options, resolver, registry)
    app = Starlette(routes=registry.routes(serving), lifespan=lifespan)
    app.state.serving = serving
    app.state.registry = registry
    metrics = Metrics(app.state, engine.model_info.name)
    app.state.metrics = metrics
    engine.finished_listeners.append(metrics.observe_finished)
    if note_in_request_context not in engine.finished_listeners:  # once, however many apps share the engine
        engine.finished_listeners.append(note_in_request_context)
    app.add_middleware(RequestCounter, metrics=metrics, registry=registry,
                       echo_request_id=settings.enable_request_id_headers)
    refusal_of = registry.refusal_of  # refusals made before a handler runs, in the path's protocol's form
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, refusal_of=refusal_of)
    app.state.draining = False
    app.add_middleware(DrainGuard, state=app.state, refusal_of=refusal_of)
    if settings.origins:  # CORS, off unless origins are named (vLLM's --allowed-origins)
        app.add_middleware(CORSMiddleware, allow_origins=settings.origins, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["*"], expose_headers=["X-Request-Id", "X-Ignored-Parameters"])
    app.add_middleware(BodySizeLimit, max_bytes=int(settings.max_body_mb * (1 << 20)), timeout_s=settings.body_timeout,
                       min_rate=settings.body_min_rate_kb * 1024,
                       large_bodies={"/v1/lora/packs": settings.lora_max_pack_mb << 20}, refusal_of=refusal_of)
    # outside the body limit: the adapter endpoints' permission, key and Content-Type are checked before
    # any of a body is read
    app.add_middleware(AdminGate, api_key=settings.api_key, allow_unauthenticated=settings.allow_unauthenticated_admin)
    if settings.hosts:  # outermost: a request to a host not served is answered before anything else runs
        app.add_middleware(AllowedHosts, hosts=settings.hosts)
    engine.limits.default_timeout_s = settings.request_timeout
    engine.limits.stuck_after_s = settings.stuck_step_timeout
    app.state.settings = settings
    app.state.engine = engine
    app.state.lora_resolver = resolver
    app.state.responses_store = serving.responses
    return app


def attach_lora(settings: Settings, engine: EngineClient) -> LoraResolver | None:
    """The resolver of LoRA references when LoRA is configured (else they are refused)."""
    if not settings.lora_enabled or not engine.lora_enabled:
        return None
    max_pack, budget = settings.lora_max_pack_mb << 20, int(settings.lora_disk_budget_gb * (1 << 30))
    limits = StoreLimits(max_pack_bytes=max_pack, total_timeout_s=settings.lora_download_timeout,
                         disk_budget_bytes=budget, unpack=UnpackLimits.for_pack_limit(max_pack, budget))
    # a front end unpacks packs where its backends can read them
    chosen = settings.lora_cache_dir or settings.lora_shared_dir
    cache = Path(chosen) if chosen else default_cache_dir() / "lora"
    store = LoraStore(cache, (settings.lora_allowed_urls or "").split(","), limits,
                      validator=store_validator(engine.check_adapter),
                      refuse_private=settings.lora_refuse_private_addresses)
    return LoraResolver(store, engine.check_adapter, pin=engine.register_adapter, unpin=engine.forget_adapter)


def uvicorn_config(app: Starlette, settings: Settings) -> uvicorn.Config:
    """The one uvicorn configuration (the CLI's and the tests'): frame and time limits included."""
    import uvicorn

    from spark_server.limits import header_timeout_protocol

    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                          ws_max_size=int(settings.max_frame_mb * (1 << 20)), ssl_certfile=settings.ssl_certfile,
                          ssl_keyfile=settings.ssl_keyfile,
                          timeout_keep_alive=settings.timeout_keep_alive,  # type: ignore[arg-type]  # uvicorn hints int; call_later takes float
                          http=header_timeout_protocol(settings.header_timeout), log_config=timestamped_log_config())


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def timestamped_log_config() -> dict:
    """uvicorn's own logging, with a timestamp on every line: its server lines and its access lines."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["default"]["fmt"] = "%(asctime)s %(levelprefix)s %(message)s"
    config["formatters"]["access"]["fmt"] = \
        '%(asctime)s %(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s'
    return config
