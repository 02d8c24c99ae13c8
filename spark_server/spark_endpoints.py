"""The Spark protocol's two transports of one pipeline (spark_protocol.Spark): the WebSocket
(``/turing/v3/gpt``, and iFlytek's public paths in their form) streams frames, one request per connection,
then closes; the HTTP form (``POST /turing/v3/func/gpt``) takes the same body and answers once."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.websockets import WebSocket, WebSocketDisconnect

from bridges.common import client_identity, error_response, unless_disconnected
from bridges.context import ServingContext, with_context
from bridges.errors import BridgeError, SparkCode, SparkError, error_info
from bridges.log_safety import protect
from bridges.registry import Operation, Protocol
from spark_server import spark_protocol as sp
from spark_server.auth import AuthError, ReplayGuard, check_origin, denial, verify_websocket
from spark_server.spark_public import PATH_DOMAINS, PublicForm

logger = protect(logging.getLogger(__name__))

SPARK_WS_PATH = "/turing/v3/gpt"
SPARK_HTTP_PATH = "/turing/v3/func/gpt"


@dataclass(frozen=True)
class HandshakeRules:
    """Who may open a Spark WebSocket, and how long it may wait before its request."""

    api_key: str | None  # --api-key
    keys: dict[str, str]  # --spark-auth: signing key -> secret
    replay: ReplayGuard  # signatures seen (the seed form's clients sign each socket once)
    origins: list[str]  # --allowed-origins
    request_timeout: float  # --ws-request-timeout


class SparkEndpoints:
    """The Spark operations of one app: the protocol's options, its public form, the handshake rules and
    where finished sessions are counted (``on_result``: protocol, code or "aborted"). Each operation is
    called with the serving context, as every protocol's is."""

    def __init__(self, options: sp.SparkOptions, public: PublicForm, rules: HandshakeRules,
                 on_result: Callable[[str, int | str], None] | None = None) -> None:
        self.options = options
        self.public = public
        self.rules = rules
        self.on_result = on_result

    def _spark(self, ctx: ServingContext) -> sp.Spark:
        return sp.Spark(ctx, self.options, self.on_result)

    def protocol(self) -> Protocol:
        return Protocol("spark", (
            Operation("WEBSOCKET", SPARK_WS_PATH, self.websocket, "Spark conversation over a WebSocket",
                      ("spark-request",), streams=True),
            Operation("POST", SPARK_HTTP_PATH, self.http, "Spark conversation, one JSON answer (the WebSocket "
                      f"{SPARK_WS_PATH} takes the same body)", ("spark-request",)),
            *(Operation("WEBSOCKET", path, self.public_websocket, f"iFlytek's public Spark form (domain {domain} "
                        "and the others): header.app_id, parameter.chat.domain, payload.functions",
                        ("spark-public-request",), streams=True) for path, domain in PATH_DOMAINS.items()),
        ), counts_itself=True, render_refusal=sp.http_error)

    # ---- HTTP ----------------------------------------------------------------------------------------

    @with_context
    async def http(self, request: Request, ctx: ServingContext) -> Response:
        # a client that hangs up before the answer is complete aborts it
        return await unless_disconnected(request, self._answer(request, self._spark(ctx)))

    async def _answer(self, request: Request, spark: sp.Spark) -> Response:
        sid = sp.new_sid()
        session = None
        try:
            session = await spark.open(await request.body(), sid, client=client_identity(request))
            text: list[str] = []
            last = None
            async with aclosing(spark.outputs(session)) as outputs:
                async for out in outputs:
                    text.append(out.text_delta)
                    last = out
        except Exception as exc:
            info = error_info(exc)
            trace_id = session.trace_id if session is not None else getattr(exc, "trace_id", None)
            return error_response(info, lambda i: sp.http_error(i, trace_id, sid))
        return JSONResponse(sp.http_answer(session, "".join(text), last, self.options.spark_http_markers))

    # ---- WebSocket -----------------------------------------------------------------------------------

    @with_context
    async def websocket(self, ws: WebSocket, ctx: ServingContext) -> None:
        """The seed document's form (/turing/v3/gpt)."""
        await self._session(ws, self._spark(ctx), sp.SEED)

    @with_context
    async def public_websocket(self, ws: WebSocket, ctx: ServingContext) -> None:
        """iFlytek's public form (/v3.5/chat and the other public paths): spark_public.py."""
        await self._session(ws, self._spark(ctx), self.public)

    async def _session(self, ws: WebSocket, spark: sp.Spark, form: sp.Form) -> None:
        rules = self.rules
        try:  # refused at the handshake, before any engine work
            check_origin(ws.headers.get("origin"), rules.origins)
            # iFlytek's SDKs sign each connection's URL with a date of one-second resolution: two questions
            # within a second carry the same signature, so the public form takes a signature more than once
            # within its date window (the seed form's clients sign once per socket, and a reuse is refused).
            key = verify_websocket(dict(ws.headers), dict(ws.query_params), ws.url.path, rules.api_key, rules.keys,
                                   rules.replay if form is sp.SEED else None)
        except AuthError as err:
            await ws.send_denial_response(denial(err))
            return
        await ws.accept()
        sid = sp.new_sid()
        try:
            try:
                message = await asyncio.wait_for(ws.receive(), timeout=rules.request_timeout)
            except TimeoutError:
                raise SparkError(SparkCode.SCHEMA_ERROR,
                                 f"no request frame within {rules.request_timeout:g}s of connecting") from None
            if message["type"] == "websocket.disconnect":
                return
            raw = message.get("text")
            if raw is None:
                raw = message.get("bytes") or b""
            session = await spark.open(raw, sid, form, client=client_identity(ws, key), key=key)
            await _stream(ws, spark, session, form)
        except WebSocketDisconnect:
            return
        except Exception as exc:  # never let a session take the server down
            info = error_info(exc)
            if not isinstance(exc, BridgeError) and info.kind == "internal":
                logger.exception("spark session %s failed", sid)
            await _send_quietly(ws, form.error_frame(sid, info))
        await _close(ws)


async def _stream(ws: WebSocket, spark: sp.Spark, session: sp.SparkSession, form: sp.Form) -> None:
    """The session's frames as its outputs come, until the answer ends or the client leaves."""
    builder = form.frames(session)

    async def pump() -> None:
        async with aclosing(spark.outputs(session)) as outputs:  # closed at once when the client leaves
            async for out in outputs:
                for frame in builder.frames_for(out):
                    await _send(ws, frame)

    pump_task = asyncio.create_task(pump())
    gone_task = asyncio.create_task(_wait_for_disconnect(ws))
    try:
        done, _ = await asyncio.wait({pump_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
        if pump_task in done:
            pump_task.result()  # re-raise the engine's error / transport errors
        elif isinstance(gone_task.exception(), _ExtraFrame):
            raise SparkError(SparkCode.SCHEMA_ERROR, "one request per connection: a second frame was sent "
                                                     "during the answer (open a new connection per question)")
    finally:
        for task in (pump_task, gone_task):
            if not task.done():
                task.cancel()
        # Cancelling the pump closes the engine stream, which aborts the request and frees its cache.
        await asyncio.gather(pump_task, gone_task, return_exceptions=True)


class _ExtraFrame(Exception):
    pass


async def _wait_for_disconnect(ws: WebSocket) -> None:
    """After the request the client has nothing more to say: return when it goes away; a second
    frame is refused (one request per connection, as the spec's clients do)."""
    message = await ws.receive()
    if message["type"] == "websocket.disconnect":
        return
    raise _ExtraFrame()


async def _send(ws: WebSocket, frame: dict[str, Any]) -> None:
    await ws.send_text(json.dumps(frame, ensure_ascii=False))


async def _send_quietly(ws: WebSocket, frame: dict[str, Any]) -> None:
    try:
        await _send(ws, frame)
    except Exception:
        pass  # the client is already gone


async def _close(ws: WebSocket) -> None:
    try:
        await ws.close(code=1000)
    except Exception:
        pass
