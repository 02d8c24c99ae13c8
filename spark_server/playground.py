"""The browser playground at ``/`` (one static page, no CDN, no build step), the URL signing it uses when
the server runs with ``--spark-auth``, and the check that tells it why a socket was refused (a browser
never sees the status of a refused WebSocket handshake)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from bridges.common import error_response
from bridges.errors import ErrorInfo
from spark_server.auth import AuthError, check_origin, sign_url, verify_websocket

SPARK_WS_PATH = "/turing/v3/gpt"
CONFIG_SLOT = "/*SERVER-CONFIG*/null"  # in the page's script: replaced by what the page needs to know


@lru_cache(maxsize=1)
def _page() -> str:
    return resources.files("spark_server").joinpath("static/playground.html").read_text(encoding="utf-8")


@dataclass(frozen=True)
class PlaygroundConfig:
    """What these endpoints read, made once by the app factory and bound to each of them."""

    model: str  # the served model's name
    api_key: str | None  # --api-key
    spark_keys: dict[str, str]  # --spark-auth's key -> secret
    origins: list[str]  # --allowed-origins


def page_config(config: PlaygroundConfig) -> dict:
    """What the page shows and how it connects: the model's name, and which credentials the server wants."""
    return {"model": config.model, "api_key": bool(config.api_key), "spark_auth": bool(config.spark_keys),
            "path": SPARK_WS_PATH}


async def playground(request: Request, config: PlaygroundConfig) -> Response:
    # "<" escaped: a model name cannot end the script element it is written into
    page = json.dumps(page_config(config)).replace("<", "\\u003c")
    return HTMLResponse(_page().replace(CONFIG_SLOT, page, 1))


async def check(request: Request, config: PlaygroundConfig) -> Response:
    """How the server answers a Spark WebSocket handshake with this query (the URL the page would open):
    ``{"status": 101}`` when it would open, else the refusal's status (401 / 403) and message. Always a 200,
    read by the page after a socket closed unopened. With --api-key the page sends its key as a bearer
    header here, so a wrong key is refused by the middleware already, as a 401 it can read."""
    headers = {k: v for k, v in request.headers.items() if k != "authorization"}  # what the socket sends
    try:
        check_origin(headers.get("origin"), config.origins)
        verify_websocket(headers, dict(request.query_params), SPARK_WS_PATH, config.api_key,
                         config.spark_keys, replay=None)  # a probe does not use up the signature
    except AuthError as err:
        return JSONResponse({"status": err.status, "message": err.message})
    return JSONResponse({"status": 101, "message": "the handshake would be accepted"})


async def sign(request: Request, config: PlaygroundConfig) -> Response:
    """A signed Spark WebSocket URL for the page. Only behind --api-key (the middleware checks the key):
    without it anyone could turn --spark-auth off by asking here."""
    keys = config.spark_keys
    if not keys:
        return _refusal(ErrorInfo.of("not_found", "the server runs without --spark-auth: no signing needed"))
    if not config.api_key:
        return _refusal(ErrorInfo.of("forbidden", "signing URLs for the page needs --api-key"))
    key, secret = next(iter(keys.items()))
    scheme = "wss" if request.url.scheme == "https" else "ws"
    return JSONResponse({"url": sign_url(f"{scheme}://{request.headers.get('host', request.url.netloc)}"
                                         f"{SPARK_WS_PATH}", key, secret)})


def _refusal(err: ErrorInfo) -> Response:
    """A refusal in the page's own form: the message under ``error``."""
    return error_response(err, lambda e: {"error": e.message})
