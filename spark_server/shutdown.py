"""Graceful shutdown on SIGTERM / SIGINT.

uvicorn's own shutdown closes WebSockets at once (1012), so the server drains first: new work is
refused (503), running sessions get ``--shutdown-grace`` seconds to finish, the rest are ended with
the shutdown error (Spark 12101), and only then does uvicorn stop. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import uvicorn
from starlette.responses import JSONResponse

from bridges.common import error_response
from bridges.errors import ErrorInfo
from bridges.registry import RefusalOf
from engine.errors import EngineShutdownError

logger = logging.getLogger(__name__)


async def drain(app: Any, grace_s: float) -> None:
    engine = app.state.engine
    app.state.draining = True
    deadline = time.monotonic() + grace_s
    while engine.num_active_requests and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = engine.num_active_requests
    if left:
        logger.warning("shutdown: %d request(s) still running after %.0fs; ending them", left, grace_s)
        engine.fail_all(EngineShutdownError("the server is shutting down"))
        end = time.monotonic() + 5.0
        while engine.num_active_requests and time.monotonic() < end:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # let the last error frames reach their sockets


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Any, grace_s: float) -> None:
        super().__init__(config)
        self.app_ref = app
        self.grace_s = grace_s
        self.draining = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.draining or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self.draining = True
        logger.info("shutdown: draining (grace %.0fs)", self.grace_s)
        loop = asyncio.get_event_loop()

        async def then_exit() -> None:
            try:
                await drain(self.app_ref, self.grace_s)
            except Exception:
                logger.exception("shutdown: draining failed")
            finally:
                # Not uvicorn's handle_exit: it records the signal and re-raises it after shutdown,
                # which would end the process by SIGTERM instead of exit code 0.
                self.should_exit = True

        loop.call_soon_threadsafe(lambda: loop.create_task(then_exit()))


class DrainGuard:
    """While draining, new requests and sessions are refused with 503."""

    def __init__(self, app, state: Any,
                 refusal_of: RefusalOf | None = None) -> None:
        self.app = app
        self.state = state
        self.refusal_of = refusal_of  # the error body of a protocol that declares its own for such refusals

    async def __call__(self, scope, receive, send) -> None:
        if not getattr(self.state, "draining", False) or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        info = ErrorInfo.of("shutting_down", "the server is shutting down")
        headers = {"Retry-After": "5", "Connection": "close"}
        render = self.refusal_of(scope["path"]) if self.refusal_of is not None and scope["type"] == "http" else None
        if render is not None:
            response = error_response(info, render, headers)
        else:
            # one body every other protocol's client reads an error from: a message (TGI's and the text
            # servers' clients read a string there), and the Spark form's header
            body = {"error": info.message, "header": {"code": info.spark_code, "message": info.message, "status": 2}}
            response = JSONResponse(body, status_code=info.status, headers=headers)
        if scope["type"] == "http":
            await response(scope, receive, send)
            return
        await receive()  # websocket.connect
        await send({"type": "websocket.http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "websocket.http.response.body", "body": response.body})
