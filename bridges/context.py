"""What the protocols may know of the server, as one frozen, typed value: the ``ServingContext`` the app
factory builds once and the registry hands to every operation with its request. The protocol code reads
no ``app.state`` and no settings object: the served model, a tokenizer facade, the protocol options (each
named as its flag), the adapters a request may name and the engine client are all here.

    app factory (spark_server/app.py)
        -> build_context(engine, options, LoRA resolver, registry)
        -> Registry.routes(ctx): each operation called as handler(request, ctx)
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from engine.protocol import EngineClient, ModelInfo
from engine.request import GenerationRequest, Prompt
from lora_store.resolver import LoraResolver, resolve_lora

if TYPE_CHECKING:
    from bridges.registry import Registry
    from bridges.responses_store import ResponseStore


@dataclass(frozen=True)
class ProtocolOptions:
    """The server's options the protocols read, each named as its setting (``--max-seqs-per-request`` is
    ``max_seqs_per_request``); the app factory copies them from the settings."""

    max_request_items: int  # JSON values one body may hold
    max_seqs_per_request: int  # prompts x n one request may start
    max_logprob_entries: int  # the answer-volume budget (bridges/answer_volume.py)
    reasoning_parser: str | None  # the thinking split out of answers (bridges/reasoning.py)
    tool_call_parser: str  # the tool-call format (bridges/tool_formats.py)
    enable_auto_tool_choice: bool  # tool_choice "auto" allowed
    trust_request_chat_template: bool  # a request's own chat_template (pooling's messages form)
    vllm_stream: str  # vLLM /generate's stream shape: "spec" or "cumulative"
    full_text_enabled: bool  # stream events carry the output so far (vLLM, TGI)
    tgi_compat: str  # TGI's answer shape: "spec" or "hf"
    responses_store_max_items: int  # the kept responses' bounds
    responses_store_max_mb: float
    model_aliases: tuple[str, ...] = ()  # further names of the served model (vLLM's --served-model-name list)
    return_tokens_as_token_ids: bool = False  # vLLM's flag: logprobs name tokens "token_id:<id>"
    # the OpenAI-compatible endpoints' defaults for knobs a request leaves out (--generation-config: the
    # model's recommendation, spark_server/sampling_defaults.py), in the engine's knob names
    openai_sampling_defaults: tuple[tuple[str, float | int], ...] = ()
    openai_max_tokens_cap: int | None = None  # vLLM's override_max_tokens: no request's max_tokens above it


class Tokenizer:
    """The served model's tokenizer as the protocols use it: text <-> ids, and a prompt's ids as the
    engine would make them (chat template included)."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    @property
    def _tok(self) -> Any:
        return self._engine.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's vocabulary entry (vLLM's token_strs)."""
        return self._tok.convert_ids_to_tokens(ids)

    def pair(self, first: str, second: str) -> list[int]:
        """The ids of a text pair as the tokenizer joins one (a cross-encoder's input)."""
        return list(self._tok(first, text_pair=second)["input_ids"])

    def is_special(self, token_id: int) -> bool:
        return token_id in self._tok.all_special_ids

    async def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The ids the engine would run for ``prompt``."""
        return await self._engine.encode_prompt(prompt)


class Adapters:
    """The LoRA adapters requests may name: those registered by name (``--lora``, the load endpoint), and
    how a request's reference becomes a loadable adapter (``resolve``). Without LoRA there are none and
    a reference is refused when resolved."""

    def __init__(self, resolver: LoraResolver | None) -> None:
        self.resolver = resolver

    @property
    def registered(self) -> dict[str, str]:
        """name -> adapter directory, sorted by name."""
        return dict(sorted(self.resolver.registered.items())) if self.resolver is not None else {}

    def __contains__(self, name: object) -> bool:
        return self.resolver is not None and name in self.resolver.registered

    async def resolve(self, req: GenerationRequest) -> None:
        await resolve_lora(self.resolver, req)


@dataclass(frozen=True)
class ServingContext:
    engine: EngineClient
    options: ProtocolOptions
    adapters: Adapters
    tokenizer: Tokenizer
    responses: ResponseStore  # the kept OpenAI Responses (bridges/responses.py)
    registry: Registry  # the served operations (GET /openapi.json lists them)

    @property
    def model(self) -> ModelInfo:
        return self.engine.model_info


def build_context(engine: EngineClient, options: ProtocolOptions, resolver: LoraResolver | None,
                  registry: Registry) -> ServingContext:
    """The app's one context; refuses (ValueError) a --reasoning-parser the served tokenizer cannot serve."""
    from bridges.reasoning import check_reasoning_parser  # imports bridges.common, which imports this module
    from bridges.responses_store import ResponseStore

    check_reasoning_parser(options.reasoning_parser, engine.tokenizer)
    store = ResponseStore(options.responses_store_max_items, int(options.responses_store_max_mb * (1 << 20)))
    return ServingContext(engine=engine, options=options, adapters=Adapters(resolver), tokenizer=Tokenizer(engine),
                          responses=store, registry=registry)


T = TypeVar("T", bound=Callable[..., Awaitable[Any]])


def with_context(handler: T) -> T:
    """Marks an operation's handler as taking ``(request, ctx)``: the registry passes the context."""
    handler.takes_context = True  # type: ignore[attr-defined]
    return handler


def bind(handler: Callable[..., Awaitable[Any]], ctx: ServingContext) -> Callable[..., Awaitable[Any]]:
    """The Starlette endpoint of an operation's handler: ``ctx`` passed along where it takes one."""
    if not getattr(handler, "takes_context", False):
        return handler

    @functools.wraps(handler)
    async def run(connection: Any) -> Any:
        return await handler(connection, ctx)

    return run
