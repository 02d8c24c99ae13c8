"""Auth on: signed Spark URLs pass, bad or stale ones are refused at the handshake; HTTP needs the key.

Auth is the server's door, in front of any engine: these run on the scripted fake engine (no model)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import websockets

from spark_server.auth import sign_url
from spark_server.settings import Settings
from tests.conftest import fake_server_with, free_port
from tests.spark.client import converse, spark_request

KEY, SECRET, API_KEY = "app-key", "app-secret", "sk-test"


@pytest.fixture(scope="module")
def auth_server():
    with fake_server_with(Settings(port=free_port(), spark_auth=f"{KEY}:{SECRET}", api_key=API_KEY)) as server:
        yield server


def _refused(url: str) -> tuple[int, str]:
    async def go():
        try:
            async with websockets.connect(url):
                return 101, ""
        except websockets.InvalidStatus as exc:
            return exc.response.status_code, exc.response.body.decode()
    return asyncio.run(go())


def test_a_signed_url_works(auth_server):
    # dated a few seconds back: a signed URL opens one socket, and the CLI test signs "now"
    signed = sign_url(auth_server.ws_url, KEY, SECRET, datetime.now(UTC) - timedelta(seconds=7))
    frames = asyncio.run(converse(signed, spark_request("Hi", max_tokens=3)))
    assert frames[-1]["header"]["code"] == 0


def test_cli_signs_urls(auth_server):
    out = subprocess.run([sys.executable, "-m", "spark_server", "sign-url", "--url", auth_server.ws_url,
                          "--key", KEY, "--secret", SECRET], capture_output=True, text=True, check=True).stdout.strip()
    frames = asyncio.run(converse(out, spark_request("Hi", max_tokens=2)))
    assert frames[-1]["header"]["code"] == 0


@pytest.mark.parametrize("make, status, needle", [
    (lambda u: u, 401, "missing"),
    (lambda u: sign_url(u, KEY, "wrong-secret"), 401, "signature"),
    (lambda u: sign_url(u, "nobody", SECRET), 401, "signature"),
    (lambda u: sign_url(u, KEY, SECRET, datetime.now(UTC) - timedelta(seconds=600)), 403, "clock"),
])
def test_bad_credentials_are_refused_at_the_handshake(auth_server, make, status, needle):
    before = len(auth_server.engine.requests)
    code, body = _refused(make(auth_server.ws_url))
    assert code == status and needle in body and '"code":11200' in body.replace(" ", "")
    assert len(auth_server.engine.requests) == before  # no engine work


def test_http_bridges_need_the_key(auth_server):
    model = auth_server.engine.model_info.name
    url = auth_server.http_url + "/v1/completions"
    body = {"model": model, "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(url, json=body).status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert httpx.post(auth_server.http_url + "/generate", json={"inputs": "hi"}).status_code == 401
    assert httpx.get(auth_server.http_url + "/health").status_code == 200  # open for load balancers


def _signed_for(url: str, host: str, when: datetime) -> str:
    """``url`` signed as if it were sent to ``host`` (the query says ``host``; the socket goes to ``url``)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    other = sign_url(f"{parts.scheme}://{host}{parts.path}", KEY, SECRET, when)
    return url + "?" + urlsplit(other).query


def test_hmac_gaps_are_closed(auth_server):
    url = auth_server.ws_url
    when = datetime.now(UTC) - timedelta(seconds=20)
    # a date far beyond what a datetime holds
    signed = sign_url(url, KEY, SECRET, when)
    from urllib.parse import quote
    overflow = url + "?" + "&".join(p for p in signed.split("?", 1)[1].split("&") if not p.startswith("date=")) + \
        "&date=" + quote("Fri, 31 Dec 99999999999 23:59:59 GMT")
    assert _refused(overflow)[0] == 401
    # signed for another host
    code, body = _refused(_signed_for(url, "other.example:9990", when))
    assert code == 401 and "host" in body
    # one signed URL, one socket
    once = sign_url(url, KEY, SECRET, when - timedelta(seconds=1))
    assert _refused(once)[0] == 101
    code, body = _refused(once)
    assert code == 401 and "already used" in body


def test_logs_hold_no_credentials():
    import logging

    from bridges.log_safety import protect_server_logs

    protect_server_logs()
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("uvicorn.error")
    handler = Keep()
    logger.addHandler(handler)
    try:
        logger.warning('%s - "WebSocket %s" [accepted]', "127.0.0.1:5",
                       "/turing/v3/gpt?authorization=YXBpX2tleT0ic2Vj&date=Sun&host=h&api_key=sk-1&signature=abc")
    finally:
        logger.removeHandler(handler)
    assert records and "YXBpX2tleT0ic2Vj" not in records[0] and "sk-1" not in records[0] and "abc" not in records[0]
    assert "authorization=REDACTED" in records[0]


def test_a_refused_handshake_logs_no_error(caplog):
    import logging

    from bridges.log_safety import protect_server_logs

    with fake_server_with(Settings(port=free_port(), spark_auth=f"{KEY}:{SECRET}")) as server:
        protect_server_logs()  # as the CLI does once uvicorn has set up its loggers
        with caplog.at_level(logging.INFO, logger="uvicorn.error"):
            assert _refused(server.ws_url)[0] == 401
            assert _refused(server.ws_url + "?date=x")[0] == 401
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []


def test_the_open_info_endpoints_show_the_models_path_only_to_a_caller_with_the_key(auth_server):
    info = auth_server.engine.model_info
    for path in ("/server_info", "/model_info"):
        url = auth_server.http_url + path
        anonymous = httpx.get(url).json()  # open: routers read them
        assert anonymous["model_path"] == anonymous["tokenizer_path"] == info.name
        assert info.path not in httpx.get(url).text
        keyed = httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}).json()
        assert keyed["model_path"] == info.path
        assert httpx.get(url, headers={"x-api-key": API_KEY}).json()["model_path"] == info.path
