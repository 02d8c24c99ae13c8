"""The one registry of protocols. Each protocol module in ``bridges/`` declares ``PROTOCOL`` once: its
label (metrics and logs), its operations (path, method, handler, request schemas, summary). The
Starlette routes, ``/openapi.json`` and the metrics' path -> protocol map are all derived from it, so a
new protocol is one module plus its schema.

Every route is made with the ``ServingContext`` (bridges/context.py): a handler marked ``with_context``
is called as ``handler(request, ctx)``.

Several protocols may share a path (POST /generate: TGI, vLLM and SGLang); each then says which bodies
it ``claims``, and one dispatcher parses the body once and hands it to the first that does, as
``handler(request, ctx, body)``."""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute, compile_path

from bridges.context import bind, with_context

if TYPE_CHECKING:
    from bridges.context import ServingContext
    from bridges.errors import ErrorInfo

Handler = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class Operation:
    method: str  # "POST", "GET" or "WEBSOCKET"
    path: str
    handler: Handler
    summary: str
    schemas: tuple[str, ...] = ()  # JSON schemas of the request body (in schemas/)
    streams: bool = False  # may answer text/event-stream (or NDJSON)
    # on a shared path: is this body this protocol's? (the handler is then called with the parsed body)
    claims: Callable[[dict], bool] | None = None
    claim_hint: str = ""  # what such a body has, for the error when none claims it ("`inputs` (TGI)")
    enabled: Callable[[Any], bool] | None = None  # by the settings; None: always


# A middleware's way to the error body of the protocol serving a path (Registry.refusal_of)
RefusalOf = Callable[[str], "Callable[[ErrorInfo], dict] | None"]


@dataclass(frozen=True)
class Protocol:
    label: str  # the `protocol` label of metrics and request logs
    operations: tuple[Operation, ...]
    counts_itself: bool = False  # sessions that count and log themselves (Spark)
    # the error body for a shared path's body that is not JSON, or that no protocol claims
    render_unclaimed: Callable[[ErrorInfo], dict] | None = None
    # a refusal made before its handler runs (a missing API key): the error body (None: OpenAI's)
    render_refusal: Callable[[ErrorInfo], dict] | None = None


def discover() -> list[Protocol]:
    """Every ``PROTOCOL`` declared by a module of the ``bridges`` package, in module-name order."""
    import bridges

    found = []
    for info in sorted(pkgutil.iter_modules(bridges.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"bridges.{info.name}")
        protocol = getattr(module, "PROTOCOL", None)
        if isinstance(protocol, Protocol):
            found.append(protocol)
    return found


class Registry:
    def __init__(self, protocols: list[Protocol], settings: Any = None) -> None:
        self.protocols = protocols
        self.operations: list[tuple[Protocol, Operation]] = [
            (p, op) for p in protocols for op in p.operations if op.enabled is None or op.enabled(settings)]
        self._labels: list[tuple[re.Pattern, str, Protocol]] = []
        for p, op in self.operations:
            if op.method == "POST":
                self._labels.append((compile_path(op.path)[0], op.method, p))

    def routes(self, ctx: ServingContext) -> list[BaseRoute]:
        by_path: dict[tuple[str, str], list[tuple[Protocol, Operation]]] = {}
        for p, op in self.operations:
            by_path.setdefault((op.path, op.method), []).append((p, op))
        routes: list[BaseRoute] = []
        for (path, method), ops in by_path.items():
            if method == "WEBSOCKET":
                routes.append(WebSocketRoute(path, bind(ops[0][1].handler, ctx)))
            elif len(ops) == 1:
                routes.append(Route(path, _labelled(ops[0][0].label, bind(ops[0][1].handler, ctx)), methods=[method]))
            else:
                routes.append(Route(path, bind(_dispatcher(ops), ctx), methods=[method]))
        return routes

    def protocol_of(self, path: str) -> Protocol | None:
        """The protocol answering a POST to ``path`` (None when no protocol declares it)."""
        for pattern, _, protocol in self._labels:
            if pattern.match(path):
                return protocol
        return None

    def refusal_of(self, path: str) -> Callable[[ErrorInfo], dict] | None:
        """The error body of the protocol serving ``path`` for a refusal made before its handler runs (None:
        no protocol there, or one without its own)."""
        protocol = self.protocol_of(path)
        return protocol.render_refusal if protocol is not None else None


def _labelled(label: str, handler: Handler) -> Handler:
    async def run(request: Request) -> Response:
        request.state.protocol = label
        return await handler(request)

    run.__name__ = getattr(handler, "__name__", "handler")
    return run


def _dispatcher(ops: list[tuple[Protocol, Operation]]) -> Handler:
    """One handler for a path several protocols share, choosing by the body's shape: the body is parsed
    here, once, and handed to the protocol that claims it."""
    from bridges.common import BridgeError, error_response, read_any_json
    from bridges.errors import ErrorInfo

    render = next((p.render_unclaimed for p, _ in ops if p.render_unclaimed), lambda err: {"error": err.message})

    @with_context
    async def dispatch(request: Request, ctx: ServingContext) -> Response:
        try:
            body = await read_any_json(request, ctx.options.max_request_items)
        except BridgeError as err:
            return error_response(err.info, render)
        for protocol, op in ops:
            if isinstance(body, dict) and op.claims is not None and op.claims(body):
                request.state.protocol = protocol.label
                return await op.handler(request, ctx, body)
        hints = ", ".join(op.claim_hint or p.label for p, op in ops)
        return error_response(ErrorInfo.of("invalid_request", f"cannot tell the protocol: send {hints}", status=422),
                              render)

    return dispatch
