"""Input limits, default deadlines and a stuck engine turning /health red.

The size limits are the transport's and the protocol layer's: they run on the scripted fake engine. The
deadline and the stuck step are kept by the real engine's loop, so those two run on it."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import websockets

from tests.spark.client import converse, spark_request


def test_http_body_over_the_limit_is_413(fake):
    r = httpx.post(fake.http_url + "/v1/completions", content=b"x" * (9 << 20),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/messages", "/turing/v3/func/gpt", "/v1/chat/completions"])
@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_refused_in_its_protocols_own_form(fake, path, declared):
    """The refusal is made before any handler runs, but in the error body of the protocol serving the path:
    Anthropic's on /v1/messages, the Spark HTTP form's header, OpenAI's elsewhere."""
    body = b"x" * (9 << 20)
    content = body if declared else iter([body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)])
    r = httpx.post(fake.http_url + path, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413
    got = r.json()
    if path == "/v1/messages":
        assert got["type"] == "error" and got["error"]["type"] == "request_too_large", got
        assert "byte limit" in got["error"]["message"]
    elif path.startswith("/turing"):
        assert got["header"]["code"] != 0 and "byte limit" in got["header"]["message"], got
    else:
        assert "byte limit" in got["error"]["message"], got


def test_websocket_frame_over_the_limit_is_closed_with_1009(fake):
    async def go():
        async with websockets.connect(fake.ws_url, max_size=None) as ws:
            await ws.send("x" * (5 << 20))
            await ws.recv()

    with pytest.raises(websockets.ConnectionClosed) as err:
        asyncio.run(go())
    assert err.value.rcvd is not None and err.value.rcvd.code == 1009  # message too big


def test_a_4mb_frame_is_accepted_and_parsed(fake):
    # a frame just under the spec's 4 MB passes the transport and gets a protocol answer
    body = spark_request("hi " * 1_300_000, max_tokens=2)
    frames = asyncio.run(converse(fake.ws_url, body))
    assert frames[-1]["header"]["code"] == 10003  # too many tokens, said in the protocol's own form


def test_the_server_default_deadline_ends_a_request(live_server):
    engine = live_server.engine
    old = engine.limits.default_timeout_s
    engine.limits.default_timeout_s = 0.5
    try:
        frames = asyncio.run(converse(live_server.ws_url, spark_request("Count to a thousand: 1, 2, 3,",
                                                                        max_tokens=4000, top_k=1)))
    finally:
        engine.limits.default_timeout_s = old
    assert frames[-1]["header"]["code"] == 12100 and "deadline" in frames[-1]["header"]["message"]
    live_server.wait_idle()


def test_a_stuck_model_step_turns_health_red(live_server):
    engine = live_server.engine
    core = engine.engine
    release = threading.Event()
    old = engine.limits.stuck_after_s
    engine.limits.stuck_after_s = 0.5
    core.fault_hook = lambda seqs: release.wait(10)
    try:
        task_done = threading.Event()

        def run_session():
            asyncio.run(converse(live_server.ws_url, spark_request("Hi", max_tokens=2, top_k=1)))
            task_done.set()

        threading.Thread(target=run_session, daemon=True).start()
        deadline = time.monotonic() + 15  # the step starts, then is stuck for 0.5 s (longer on a loaded machine)
        while httpx.get(live_server.http_url + "/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(live_server.http_url + "/health").status_code == 503
        assert httpx.get(live_server.http_url + "/v2/health/ready").status_code == 503
    finally:
        core.fault_hook = None
        release.set()
        engine.limits.stuck_after_s = old
    assert task_done.wait(30)
    assert httpx.get(live_server.http_url + "/health").status_code == 200


def test_a_refusal_while_draining_is_in_the_protocols_own_form_where_it_has_one():
    """Anthropic's clients read their own error body, the Spark HTTP form its header; every other protocol
    gets the one body all their clients read (a message string, and the Spark header)."""
    from spark_server.app import build_app
    from spark_server.settings import Settings
    from tests.conftest import ServerThread, free_port
    from tests.fake_engine import FakeEngine

    settings = Settings(port=free_port(), log_level="warning")
    app = build_app(settings, FakeEngine())
    with ServerThread(app, settings.port):
        app.state.draining = True
        base = f"http://127.0.0.1:{settings.port}"
        messages = httpx.post(base + "/v1/messages", json={"model": "m", "max_tokens": 4, "messages": []}, timeout=30)
        spark = httpx.post(base + "/turing/v3/func/gpt", json={}, timeout=30)
        tgi = httpx.post(base + "/generate", json={"inputs": "hi"}, timeout=30)
        app.state.draining = False
    assert messages.status_code == spark.status_code == tgi.status_code == 503
    assert messages.json()["type"] == "error" and messages.json()["error"]["type"] == "overloaded_error"
    assert spark.json()["header"]["code"] == 12101
    assert tgi.json()["error"] == "the server is shutting down" and messages.headers["retry-after"] == "5"
