"""Auth, off by default as the spec says.

- HTTP endpoints: ``--api-key`` -> ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (health,
  metrics and the OpenAPI document stay open).
- Spark WebSocket: the public Spark HMAC scheme (``--spark-auth KEY:SECRET``, repeatable): query
  parameters ``authorization``, ``date`` and ``host``, where ``authorization`` is
  base64('api_key="K", algorithm="hmac-sha256", headers="host date request-line", signature="S"') and
  S = base64(HMAC-SHA256(secret, "host: {host}\\ndate: {date}\\nGET {path} HTTP/1.1")). Dates more than
  300 s away from the server's clock are refused. Refusals happen at the handshake, before any engine
  work: 401 for a missing or wrong credential, 403 for a stale date, each with a JSON message.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from datetime import UTC, datetime
from email.utils import format_datetime, parsedate_to_datetime
from urllib.parse import urlencode, urlsplit

from starlette.responses import JSONResponse

from bridges.common import error_response
from bridges.errors import BridgeError, ErrorInfo
from bridges.openai import render_error as openai_error
from bridges.registry import RefusalOf
from spark_server.settings import parse_pairs

DATE_WINDOW_S = 300
OPEN_PATHS = ("/health", "/metrics", "/openapi.json", "/v2/health/", "/version", "/server_info", "/model_info",
              "/lora/packs/")


class AuthError(BridgeError):
    """A credential refused (401), or one that may not do this (403)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message, kind="unauthorized" if status == 401 else "forbidden")


def parse_key_pairs(value: str | None) -> dict[str, str]:
    return parse_pairs(value, ":", "--spark-auth", "KEY:SECRET")


def signature(secret: str, host: str, date: str, path: str) -> str:
    origin = f"host: {host}\ndate: {date}\nGET {path} HTTP/1.1"
    return base64.b64encode(hmac.new(secret.encode(), origin.encode(), hashlib.sha256).digest()).decode()


def sign_url(url: str, key: str, secret: str, now: datetime | None = None) -> str:
    """The URL with ``authorization``, ``date`` and ``host`` query parameters for the key pair."""
    parts = urlsplit(url)
    date = format_datetime(now or datetime.now(UTC), usegmt=True)
    sig = signature(secret, parts.netloc, date, parts.path)
    origin = f'api_key="{key}", algorithm="hmac-sha256", headers="host date request-line", signature="{sig}"'
    query = urlencode({"authorization": base64.b64encode(origin.encode()).decode(), "date": date,
                       "host": parts.netloc})
    return f"{parts.scheme}://{parts.netloc}{parts.path}?{query}"


_FIELD = re.compile(r'(\w+)="([^"]*)"')


class ReplayGuard:
    """Signatures seen within the date window: a signed URL opens one socket (the Spark gateway's rule).
    Memory is bounded: entries leave when their window has passed, the oldest first when full."""

    def __init__(self, window_s: float = 2 * DATE_WINDOW_S, max_entries: int = 100_000) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: OrderedDict[str, float] = OrderedDict()  # signature -> when it may be forgotten

    def first_use(self, sig: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        while self._seen and (next(iter(self._seen.values())) <= now or len(self._seen) >= self.max_entries):
            self._seen.popitem(last=False)
        if sig in self._seen:
            return False
        self._seen[sig] = now + self.window_s
        return True


def verify_spark(query: dict[str, str], path: str, keys: dict[str, str], now: datetime | None = None,
                 request_host: str | None = None, replay: ReplayGuard | None = None) -> str:
    """Returns the api_key of a valid signed request; raises AuthError otherwise. ``request_host``: the
    request's Host header, which must be the host that was signed; ``replay``: refuses a signature
    already used."""
    missing = [p for p in ("authorization", "date", "host") if not query.get(p)]
    if missing:
        raise AuthError(401, f"missing query parameter(s): {', '.join(missing)} (sign the URL: spark-server sign-url)")
    try:
        fields = dict(_FIELD.findall(base64.b64decode(query["authorization"], validate=True).decode()))
    except (ValueError, UnicodeDecodeError):
        raise AuthError(401, "authorization is not valid base64") from None
    key, sig = fields.get("api_key"), fields.get("signature")
    if not key or not sig:
        raise AuthError(401, "authorization lacks api_key or signature")
    if fields.get("algorithm", "hmac-sha256") != "hmac-sha256":
        raise AuthError(401, f"unsupported algorithm {fields.get('algorithm')!r}")
    try:
        date = parsedate_to_datetime(query["date"])
        if date.tzinfo is None:
            date = date.replace(tzinfo=UTC)
        skew = abs(((now or datetime.now(UTC)) - date).total_seconds())
    except (TypeError, ValueError, OverflowError, IndexError):
        raise AuthError(401, "date is not an RFC 1123 date the server can read") from None
    if skew > DATE_WINDOW_S:
        raise AuthError(403, f"date is {skew:.0f}s away from the server's clock (allowed: {DATE_WINDOW_S}s)")
    secret = keys.get(key)
    expected = signature(secret, query["host"], query["date"], path) if secret else secrets.token_hex(16)
    if secret is None or not hmac.compare_digest(expected, sig):
        raise AuthError(401, "signature does not match (unknown api_key, or wrong secret, host, date or path)")
    if request_host is not None and query["host"].lower() != request_host.lower():
        raise AuthError(401, "the signed host is not the host this request was sent to")
    if replay is not None and not replay.first_use(sig):
        raise AuthError(401, "this signed URL was already used: sign a new one for each connection")
    return key


def check_origin(origin: str | None, allowed: list[str]) -> None:
    """With --allowed-origins set, a browser's WebSocket (it always sends Origin) must come from one of
    them; clients that send no Origin (programs, not pages) are not browsers and pass."""
    if not allowed or origin is None or "*" in allowed or origin in allowed:
        return
    raise AuthError(403, f"origin {origin!r} is not in --allowed-origins")


def verify_websocket(headers: dict[str, str], query: dict[str, str], path: str, api_key: str | None,
                     keys: dict[str, str], replay: ReplayGuard | None = None) -> str | None:
    """The Spark WebSocket's handshake check. With ``--api-key`` the key is accepted as
    ``Authorization: Bearer KEY`` or, for browsers (which cannot set headers on a WebSocket), as the
    ``api_key`` query parameter; with ``--spark-auth`` a signed URL is accepted. With both, either
    credential opens the socket. Raises AuthError; when the socket may open, returns the Spark key that
    signed the URL (it names the client), or None."""
    if not api_key and not keys:
        return None
    if api_key:
        expected = f"Bearer {api_key}"
        if hmac.compare_digest(headers.get("authorization", "").encode(), expected.encode()) or \
                hmac.compare_digest(query.get("api_key", "").encode(), api_key.encode()):
            return None
        if not keys or "authorization" not in query:
            given = headers.get("authorization") or query.get("api_key")
            raise AuthError(401, "invalid API key" if given else
                            "missing credential: send Authorization: Bearer <key> or the api_key query parameter")
    return verify_spark(query, path, keys, request_host=headers.get("host", ""), replay=replay)


class ApiKeyMiddleware:
    """The API key on every HTTP endpoint except the open ones: ``Authorization: Bearer <key>``, or the
    key alone in ``x-api-key`` (what Anthropic's clients send). ``refusal_of``: the body of a refusal
    in the protocol's own shape for a path (None: OpenAI's)."""

    def __init__(self, app, api_key: str,
                 refusal_of: RefusalOf | None = None) -> None:
        self.app = app
        self.key = api_key.encode()
        self.refusal_of = refusal_of

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(OPEN_PATHS) or \
                (scope["path"] == "/" and scope.get("method") in ("GET", "HEAD")):  # the playground page itself
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given, key = headers.get(b"authorization", b""), headers.get(b"x-api-key")
        if not carries_api_key(headers, self.key):
            message = "invalid API key" if given or key is not None else "missing Authorization header"
            message += " (send Authorization: Bearer <key> or x-api-key: <key>)"
            render = self.refusal_of(scope["path"]) if self.refusal_of is not None else None
            refusal = error_response(ErrorInfo.of("unauthorized", message), render or openai_error,
                                     {"WWW-Authenticate": "Bearer"})
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


def carries_api_key(headers: dict[bytes, bytes], api_key: bytes) -> bool:
    """Whether raw request headers carry the API key: ``Authorization: Bearer <key>`` or ``x-api-key: <key>``
    (compared in constant time)."""
    key = headers.get(b"x-api-key")
    return hmac.compare_digest(headers.get(b"authorization", b""), b"Bearer " + api_key) or (
        key is not None and hmac.compare_digest(key, api_key))


def denial(err: AuthError) -> JSONResponse:
    """A refused Spark WebSocket handshake: the Spark form's header, with the status."""
    return JSONResponse({"header": {"code": err.info.spark_code, "message": err.message, "status": 2}},
                        status_code=err.status)



# The endpoints that change which adapters the server serves. Each accepts one kind of body, and never one
# a web page can send cross-origin without a CORS preflight ("simple requests": text/plain, form bodies,
# or no Content-Type at all), so a page the operator visits cannot call them even without --api-key.
JSON_BODY = ("application/json",)
PACK_BODY = ("application/octet-stream", "application/gzip", "application/x-gzip", "application/x-tar",
             "application/zip", "application/x-zip-compressed")
ADMIN_ENDPOINTS = {"/v1/load_lora_adapter": JSON_BODY, "/v1/unload_lora_adapter": JSON_BODY,
                   "/v1/lora/packs": PACK_BODY}


def _error(kind: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return error_response(ErrorInfo.of(kind, message), openai_error, headers)


class AdminGate:
    """The adapter endpoints, closed unless the operator opened them: without --api-key they answer 403
    (or, with --allow-unauthenticated-admin, stay open, for a lab); with it the key is checked here. Then
    the body's Content-Type (415). All of it before a byte of the body is read, so a client without the
    key cannot make the server receive, buffer or wait for its upload."""

    def __init__(self, app, api_key: str | None, allow_unauthenticated: bool) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.open = allow_unauthenticated

    async def __call__(self, scope, receive, send) -> None:
        accepted = ADMIN_ENDPOINTS.get(scope["path"]) if scope["type"] == "http" else None
        if accepted is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        refusal = None
        if self.expected is None and not self.open:
            refusal = _error("forbidden", f"{scope['path']} needs the server to run with --api-key (or "
                                          "--allow-unauthenticated-admin, for a lab)")
        elif self.expected is not None:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "missing Authorization header" if not given else "invalid API key"
                refusal = _error("unauthorized", f"{message} (send Authorization: Bearer <key>)",
                                 headers={"WWW-Authenticate": "Bearer"})
        if refusal is None:
            media = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
            if media not in accepted:
                refusal = _error("unsupported_media_type",
                                 f"{scope['path']} takes a body of Content-Type {' or '.join(accepted[:2])}"
                                 f"{' (or another archive type)' if len(accepted) > 2 else ''}, not {media or 'none'}")
        if refusal is not None:
            # Connection: close, as the body is never read: the connection cannot carry another request
            refusal.headers["Connection"] = "close"
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


def host_allowed(host: str, allowed: list[str]) -> bool:
    """``host`` (a Host header: name or name:port) against --allowed-hosts entries: ``name`` (any port),
    ``name:port``, ``*.domain`` (its subdomains, any port) or ``*`` (any)."""
    host = host.strip().lower()
    if not host:
        return False
    name = host[:host.index("]") + 1] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
    for entry in allowed:
        if entry in ("*", host, name):
            return True
        if entry.startswith("*.") and name.endswith(entry[1:]):
            return True
    return False


class AllowedHosts:
    """With --allowed-hosts, every HTTP request and WebSocket handshake must name one of them in its Host
    header: a page on a name the attacker controls, re-pointed at this server's address (DNS rebinding),
    sends its own name and is refused (400, or a refused handshake)."""

    def __init__(self, app, hosts: list[str]) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if host_allowed(host, self.hosts):
            await self.app(scope, receive, send)
            return
        refusal = _error("invalid_request", f"Host {host[:100]!r} is not served here (--allowed-hosts)")
        if scope["type"] == "http":
            await refusal(scope, receive, send)
        elif "websocket.http.response" in scope.get("extensions", {}):
            await receive()  # websocket.connect
            await refusal(scope, receive, send)  # sent as the handshake's answer
        else:
            await receive()
            await send({"type": "websocket.close", "code": 1008})
