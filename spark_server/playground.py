"""The browser playground at ``/`` (one static page, no CDN, no build step) and the URL signing it uses
when the server runs with ``--spark-auth``."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from spark_server.auth import sign_url


@lru_cache(maxsize=1)
def _page() -> str:
    return resources.files("spark_server").joinpath("static/playground.html").read_text(encoding="utf-8")


async def playground(request: Request) -> Response:
    return HTMLResponse(_page())


async def sign(request: Request) -> Response:
    """A signed Spark WebSocket URL for the page. Only behind --api-key (the middleware checks the key):
    without it anyone could turn --spark-auth off by asking here."""
    settings = request.app.state.settings
    keys = request.app.state.spark_keys
    if not keys:
        return JSONResponse({"error": "the server runs without --spark-auth: no signing needed"}, status_code=404)
    if not settings.api_key:
        return JSONResponse({"error": "signing URLs for the page needs --api-key"}, status_code=403)
    key, secret = next(iter(keys.items()))
    scheme = "wss" if request.url.scheme == "https" else "ws"
    return JSONResponse({"url": sign_url(f"{scheme}://{request.headers.get('host', request.url.netloc)}"
                                         "/turing/v3/gpt", key, secret)})
