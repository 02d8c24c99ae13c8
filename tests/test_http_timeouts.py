"""HTTP sockets are timed out: one that never sends its headers (idle, or a byte at a time), one
that announces a body and never sends it, and one idle between keep-alive requests. The server is
configured exactly as the CLI configures it (spark_server.app.uvicorn_config), on the scripted fake engine:
the timers are the transport's."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from spark_server.app import build_app, uvicorn_config
from spark_server.settings import Settings
from tests.conftest import ServerThread, free_port
from tests.fake_engine import FakeEngine

TIMEOUT_S = 0.6


@pytest.fixture(scope="module")
def short_timeouts():
    settings = Settings(port=free_port(), header_timeout=TIMEOUT_S, body_timeout=TIMEOUT_S,
                        timeout_keep_alive=TIMEOUT_S, log_level="warning")
    app = build_app(settings, FakeEngine())
    with ServerThread(app, settings.port, uvicorn_config(app, settings)):
        yield settings.port


def _closed_after(sock: socket.socket, limit_s: float = 10 * TIMEOUT_S) -> tuple[float, bytes]:
    """Seconds until the server closes ``sock`` (and what it sent before closing)."""
    started = time.monotonic()
    sock.settimeout(limit_s)
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"still open after {limit_s:g} s; received {received[:200]!r}") from None
        except ConnectionResetError:
            break
        if not chunk:
            break
        received += chunk
    return time.monotonic() - started, received


def test_an_idle_socket_is_closed(short_timeouts):
    with socket.create_connection(("127.0.0.1", short_timeouts)) as sock:
        elapsed, got = _closed_after(sock)
    assert got == b"" and elapsed >= TIMEOUT_S * 0.8


def test_headers_sent_a_byte_at_a_time_are_cut_off(short_timeouts):
    with socket.create_connection(("127.0.0.1", short_timeouts)) as sock:
        started = time.monotonic()
        try:
            for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass
        _closed_after(sock)
    assert time.monotonic() - started < 5 * TIMEOUT_S + 1  # 100+ bytes at 20/s would take > 6 s


def test_an_announced_body_that_never_comes_gets_408(short_timeouts):
    with socket.create_connection(("127.0.0.1", short_timeouts)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")
        _, got = _closed_after(sock)
    assert got.startswith(b"HTTP/1.1 408") and b"--body-timeout" in got


def test_an_idle_keep_alive_connection_is_closed_and_requests_still_work(short_timeouts):
    with socket.create_connection(("127.0.0.1", short_timeouts)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        elapsed, got = _closed_after(sock)
    assert got.startswith(b"HTTP/1.1 200") and elapsed >= TIMEOUT_S * 0.8
    assert httpx.get(f"http://127.0.0.1:{short_timeouts}/health").status_code == 200


def test_a_body_trickling_in_below_the_minimum_rate_gets_408():
    settings = Settings(port=free_port(), body_timeout=60, body_min_rate_kb=1, log_level="warning")
    app = build_app(settings, FakeEngine())
    with (ServerThread(app, settings.port, uvicorn_config(app, settings)),
          socket.create_connection(("127.0.0.1", settings.port)) as sock):
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n")
            started = time.monotonic()
            got = b""
            sock.settimeout(0.2)
            while time.monotonic() - started < 20:
                try:
                    sock.sendall(b"          ")  # 50 bytes/s, far below 1 KiB/s
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    got += chunk
                except TimeoutError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    break
    assert got.startswith(b"HTTP/1.1 408") and b"--body-min-rate-kb" in got, got[:300]
    assert time.monotonic() - started < 10  # well before the 60 s --body-timeout


def test_a_websocket_outlives_the_header_timeout(short_timeouts):
    """The upgrade hands the socket to the WebSocket protocol: the HTTP header timer must not cut it."""
    import json

    from websockets.sync.client import connect

    from tests.spark.client import spark_request

    with connect(f"ws://127.0.0.1:{short_timeouts}/turing/v3/gpt") as ws:
        time.sleep(3 * TIMEOUT_S)
        ws.send(json.dumps(spark_request("Hi", max_tokens=2, top_k=1)))
        frames = [json.loads(m) for m in ws]
    assert frames[-1]["header"]["code"] == 0
