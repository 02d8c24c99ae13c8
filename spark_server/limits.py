"""Input limits that sit in front of every endpoint: body size and time (ASGI middleware), and the
time a connection may take to send its request headers (a uvicorn protocol)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from bridges.common import error_response
from bridges.errors import ErrorInfo
from bridges.openai import render_error as openai_error
from bridges.registry import RefusalOf


async def _disconnected() -> dict:
    return {"type": "http.disconnect"}


class BodySizeLimit:
    """Refuse HTTP bodies over ``max_bytes`` with 413 (by Content-Length up front, or while streaming),
    and bodies not received within ``timeout_s`` with 408."""

    def __init__(self, app, max_bytes: int, timeout_s: float | None = None, min_rate: float = 0.0,
                 rate_grace_s: float = 2.0, large_bodies: dict[str, int] | None = None,
                 refusal_of: RefusalOf | None = None) -> None:
        self.app = app
        # the error body of the protocol that serves a path (None, or no protocol there: OpenAI's)
        self.refusal_of = refusal_of
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        # paths that take files (LoRA packs), with their own size limit: only a declared Content-Length is
        # checked here; the body goes to the handler as it arrives, which streams it to disk within that
        # limit and its own clocks (nothing of it is held in memory, nor read before the handler's checks)
        self.large_bodies = large_bodies or {}
        self.min_rate = min_rate  # bytes/s a body must average once ``rate_grace_s`` have passed
        self.rate_grace_s = rate_grace_s

    def _render(self, path: str) -> Callable[[ErrorInfo], dict]:
        return (self.refusal_of(path) if self.refusal_of is not None else None) or openai_error

    def _too_slow(self, path: str, why: str | None = None) -> JSONResponse:
        message = why or f"the request body did not arrive within {self.timeout_s:g} s (--body-timeout)"
        return error_response(ErrorInfo.of("body_timeout", message), self._render(path), {"Connection": "close"})

    def _too_large(self, limit: int, path: str) -> JSONResponse:
        where = f"of {path}" if path in self.large_bodies else "(--max-body-mb)"
        message = f"request body is over the {limit} byte limit {where}"
        return error_response(ErrorInfo.of("body_too_large", message), self._render(path),
                              {"Connection": "close"} if path in self.large_bodies else None)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.large_bodies.get(scope["path"], self.max_bytes)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            await self._too_large(max_bytes, scope["path"])(scope, receive, send)
            return
        if scope["path"] in self.large_bodies:
            await self.app(scope, receive, send)
            return
        timeout_s = self.timeout_s
        # Read the whole body here (bounded), so an over-long chunked body is answered 413 before any
        # handler runs; the handler then gets it in one message, and later receives (disconnect
        # watching) go to the server.
        chunks: list[bytes] = []
        received = 0
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    elapsed = time.monotonic() - started
                    if self.min_rate and elapsed > self.rate_grace_s and received / elapsed < self.min_rate:
                        why = (f"the request body arrives at {received / elapsed:.0f} bytes/s; at least "
                               f"{self.min_rate:.0f} are required (--body-min-rate-kb)")
                        await self._too_slow(scope["path"], why)(scope, receive, send)
                        return
                    message = await receive()
                    if message["type"] != "http.request":  # the client left mid-body: the app counts it (499)
                        await self.app(scope, _disconnected, send)
                        return
                    chunk = message.get("body", b"")
                    received += len(chunk)
                    if received > max_bytes:
                        await self._too_large(max_bytes, scope["path"])(scope, receive, send)
                        return
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await self._too_slow(scope["path"])(scope, receive, send)
            return
        body = b"".join(chunks)
        replayed = False

        async def replay_receive():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay_receive, send)


def header_timeout_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol, closing a connection that has not sent a request's complete headers
    within ``timeout_s``: an idle socket that never speaks, or headers sent a byte at a time. (Idle
    time between keep-alive requests is uvicorn's own --timeout-keep-alive.)"""

    class HeaderTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._header_timer is None and self._awaiting_headers():  # a new request has begun
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _awaiting_headers(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return cycle is None or cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if self.transport.get_protocol() is not self:  # upgraded: the WebSocket protocol owns it now
                return
            keep_alive_idle = getattr(self, "timeout_keep_alive_task", None) is not None
            if self._awaiting_headers() and not keep_alive_idle and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
