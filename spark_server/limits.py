"""Input limits that sit in front of every endpoint."""

from __future__ import annotations

from starlette.responses import JSONResponse


async def _disconnected() -> dict:
    return {"type": "http.disconnect"}


class BodySizeLimit:
    """Refuse HTTP bodies over ``max_bytes`` with 413: by Content-Length up front, or while streaming."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> JSONResponse:
        message = f"request body is over the {self.max_bytes} byte limit (--max-body-mb)"
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": 413}},
                            status_code=413)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large()(scope, receive, send)
            return
        # Read the whole body here (bounded), so an over-long chunked body is answered 413 before any
        # handler runs; the handler then gets it in one message, and later receives (disconnect
        # watching) go to the server.
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body: the app counts it (499)
                await self.app(scope, _disconnected, send)
                return
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay_receive():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay_receive, send)
