"""The Spark WebSocket endpoints, ``/turing/v3/gpt`` and iFlytek's public paths: one request per connection,
frames, then close."""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing

from starlette.websockets import WebSocket, WebSocketDisconnect

from bridges.common import client_identity
from bridges.log_safety import protect
from spark_server import spark_protocol as sp
from spark_server import spark_public
from spark_server.auth import AuthError, check_origin, denial, verify_websocket
from spark_server.errors import SparkCode, SparkError, spark_error_from
from spark_server.spark_service import SparkService

logger = protect(logging.getLogger(__name__))


async def _send(ws: WebSocket, frame: dict) -> None:
    await ws.send_text(json.dumps(frame, ensure_ascii=False))


class _ExtraFrame(Exception):
    pass


async def _wait_for_disconnect(ws: WebSocket) -> None:
    """After the request the client has nothing more to say: return when it goes away; a second
    frame is refused (one request per connection, as the spec's clients do)."""
    message = await ws.receive()
    if message["type"] == "websocket.disconnect":
        return
    raise _ExtraFrame()


async def spark_websocket(ws: WebSocket) -> None:
    """The seed document's form (/turing/v3/gpt)."""
    await _session(ws, public=False)


async def public_spark_websocket(ws: WebSocket) -> None:
    """iFlytek's public form (/v3.5/chat and the other public paths): spark_public.py."""
    await _session(ws, public=True)


async def _session(ws: WebSocket, public: bool) -> None:
    service: SparkService = ws.app.state.spark
    request_timeout: float = ws.app.state.settings.ws_request_timeout
    try:  # refused at the handshake, before any engine work
        check_origin(ws.headers.get("origin"), ws.app.state.settings.origins)
        # iFlytek's SDKs sign each connection's URL with a date of one-second resolution: two questions
        # within a second carry the same signature, so the public form takes a signature more than once
        # within its date window (the seed form's clients sign once per socket, and a reuse is refused).
        key = verify_websocket(dict(ws.headers), dict(ws.query_params), ws.url.path, ws.app.state.settings.api_key,
                               ws.app.state.spark_keys, None if public else ws.app.state.spark_replay)
    except AuthError as err:
        await ws.send_denial_response(denial(err))
        return
    await ws.accept()
    sid = sp.new_sid()
    render_error = spark_public.error_frame if public else sp.error_frame
    try:
        try:
            message = await asyncio.wait_for(ws.receive(), timeout=request_timeout)
        except TimeoutError:
            raise SparkError(SparkCode.SCHEMA_ERROR,
                             f"no request frame within {request_timeout:g}s of connecting") from None
        if message["type"] == "websocket.disconnect":
            return
        raw = message.get("text")
        if raw is None:
            raw = message.get("bytes") or b""
        session = await service.open_session(raw, sid, client=client_identity(ws, key),
                                             public=ws.app.state.spark_public if public else None, key=key)
        await _stream(ws, service, session)
    except SparkError as err:
        await _send_error(ws, render_error(sid, err))
    except WebSocketDisconnect:
        return
    except Exception as exc:  # never let a session take the server down
        logger.exception("spark session %s failed", sid)
        await _send_error(ws, render_error(sid, spark_error_from(exc)))
    await _close(ws)


async def _stream(ws: WebSocket, service: SparkService, session: sp.SparkSession) -> None:
    async def pump() -> None:
        async with aclosing(service.frames(session)) as frames:  # closed at once when the client leaves
            async for frame in frames:
                await _send(ws, frame)

    pump_task = asyncio.create_task(pump())
    gone_task = asyncio.create_task(_wait_for_disconnect(ws))
    try:
        done, _ = await asyncio.wait({pump_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
        if pump_task in done:
            pump_task.result()  # re-raise SparkError / transport errors
        elif isinstance(gone_task.exception(), _ExtraFrame):
            raise SparkError(SparkCode.SCHEMA_ERROR, "one request per connection: a second frame was sent "
                                                     "during the answer (open a new connection per question)")
    finally:
        for task in (pump_task, gone_task):
            if not task.done():
                task.cancel()
        # Cancelling the pump closes the engine stream, which aborts the request and frees its cache.
        await asyncio.gather(pump_task, gone_task, return_exceptions=True)


async def _send_error(ws: WebSocket, frame: dict) -> None:
    try:
        await _send(ws, frame)
    except Exception:
        pass  # the client is already gone


async def _close(ws: WebSocket) -> None:
    try:
        await ws.close(code=1000)
    except Exception:
        pass
