"""Input limits that sit in front of every endpoint."""

from __future__ import annotations

from starlette.responses import JSONResponse


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
        received = 0
        too_large = False

        async def bounded_receive():
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    return {"type": "http.disconnect"}
            return message

        started = False

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, bounded_receive, tracking_send)
        if too_large and not started:
            await self._too_large()(scope, receive, send)
