"""GET /metrics: vLLM-style names, and the counters move with real traffic (real clients and sockets, on the
scripted fake engine: what is counted and logged is the server's, not the model's)."""

from __future__ import annotations

import asyncio
import re

import httpx

from engine import cpu_contention
from tests.fake_engine import Script
from tests.spark.client import converse, spark_request


def _value(text: str, name: str, labels: str = "") -> float:
    """The sample of ``name`` whose labels include every pair in ``labels`` (others, such as model_name,
    may be there too)."""
    wanted = set(re.findall(r'\w+="[^"]*"', labels))
    for line in text.splitlines():
        m = re.fullmatch(re.escape(name) + r'(?:\{([^}]*)\})? ([0-9.e+-]+)', line)
        if m and wanted <= set(re.findall(r'\w+="[^"]*"', m.group(1) or "")):
            return float(m.group(2))
    return 0.0


def test_metrics_follow_traffic(fake):
    url = fake.http_url + "/metrics"
    before = httpx.get(url).text
    for name in ("spark:num_requests_running", "spark:num_requests_waiting", "spark:kv_cache_usage_perc",
                 "spark:time_to_first_token_seconds_bucket", "spark:time_per_output_token_seconds_bucket"):
        assert name in before
    asyncio.run(converse(fake.ws_url, spark_request("Hi", max_tokens=4, top_k=1)))
    asyncio.run(converse(fake.ws_url, "{not json"))
    model = fake.engine.model_info.name
    httpx.post(fake.http_url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
    httpx.post(fake.http_url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 0})
    after = httpx.get(url).text
    ok = 'code="0",protocol="spark"'
    assert _value(after, "spark:requests_total", ok) == _value(before, "spark:requests_total", ok) + 1
    bad = 'code="4",protocol="spark"'
    assert _value(after, "spark:requests_total", bad) == _value(before, "spark:requests_total", bad) + 1
    for code in ("200", "400"):
        lab = f'code="{code}",protocol="openai"'
        assert _value(after, "spark:requests_total", lab) >= _value(before, "spark:requests_total", lab) + 1
    assert _value(after, "spark:time_to_first_token_seconds_count") >= \
        _value(before, "spark:time_to_first_token_seconds_count") + 2
    assert _value(after, "spark:generation_tokens_total") > _value(before, "spark:generation_tokens_total")
    if cpu_contention._thread_times() is not None:  # the threads' CPU time, and their queueing for a CPU
        assert _value(after, "spark:cpu_run_seconds_total") > _value(before, "spark:cpu_run_seconds_total") > 0
        assert _value(after, "spark:cpu_queue_seconds_total") >= _value(before, "spark:cpu_queue_seconds_total") >= 0


def test_one_log_line_per_http_request(fake, caplog):
    import logging

    model = fake.engine.model_info.name
    with caplog.at_level(logging.INFO, logger="spark_server.requests"):
        httpx.post(fake.http_url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 3},
                   headers={"X-Request-Id": "trace-123"})
        httpx.post(fake.http_url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 0})
    lines = [r.getMessage() for r in caplog.records if r.name == "spark_server.requests"]
    ok = [line for line in lines if "id=trace-123" in line]
    assert len(ok) == 1 and "protocol=openai" in ok[0] and "code=200" in ok[0]
    assert "completion_tokens=3" in ok[0] and "ttft=-" not in ok[0]
    assert any("code=400" in line for line in lines)


def _wait_for(predicate, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def test_a_session_the_client_leaves_is_counted_and_logged_as_aborted(fake, caplog):
    import json
    import logging

    import websockets

    url = fake.http_url + "/metrics"
    label = 'code="aborted",protocol="spark"'
    before = _value(httpx.get(url).text, "spark:requests_total", label)
    ok_before = _value(httpx.get(url).text, "spark:requests_total", 'code="0",protocol="spark"')

    fake.engine.script = Script(answer="word " * 200, token_delay_s=0.02)  # still answering when the client leaves

    async def leave_after_first_frame() -> None:
        async with websockets.connect(fake.ws_url) as ws:
            await ws.send(json.dumps(spark_request("Tell me a long story.", trace_id="leaver", max_tokens=200,
                                                   top_k=1)))
            await ws.recv()

    with caplog.at_level(logging.INFO, logger="spark_server.sessions"):
        asyncio.run(leave_after_first_frame())
        _wait_for(lambda: _value(httpx.get(url).text, "spark:requests_total", label) == before + 1)
        _wait_for(lambda: any("traceId=leaver" in r.getMessage() for r in caplog.records))
    line = next(r.getMessage() for r in caplog.records if "traceId=leaver" in r.getMessage())
    assert "code=aborted" in line, line
    assert _value(httpx.get(url).text, "spark:requests_total", 'code="0",protocol="spark"') == ok_before
    fake.wait_idle()


def test_a_client_hanging_up_mid_body_is_499_not_500(fake):
    import socket

    url = fake.http_url + "/metrics"
    before = {s: _value(httpx.get(url).text, "spark:requests_total", f'code="{s}",protocol="openai"')
              for s in ("499", "500")}
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", fake.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": \"Hi")
    _wait_for(lambda: _value(httpx.get(url).text, "spark:requests_total",
                             'code="499",protocol="openai"') == before["499"] + 5)
    assert _value(httpx.get(url).text, "spark:requests_total", 'code="500",protocol="openai"') == before["500"]


def test_the_request_id_is_echoed_and_a_500_is_logged_with_it(fake, caplog, monkeypatch):
    import logging

    from bridges import openai as openai_bridge

    model = fake.engine.model_info.name
    body = {"model": model, "prompt": "Hi", "max_tokens": 2}
    given = httpx.post(fake.http_url + "/v1/completions", json=body, headers={"X-Request-Id": "abc-123"})
    assert given.headers["x-request-id"] == "abc-123"
    made = httpx.post(fake.http_url + "/v1/completions", json=body)
    assert made.status_code == 200 and len(made.headers["x-request-id"]) >= 8

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(openai_bridge, "lower_completion", broken)
    with caplog.at_level(logging.ERROR, logger="spark_server.requests"):
        failed = httpx.post(fake.http_url + "/v1/completions", json=body, headers={"X-Request-Id": "r-500"})
    assert failed.status_code == 500 and failed.headers["x-request-id"] == "r-500"
    logged = [r for r in caplog.records if "r-500" in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the traceback goes with the id


def test_an_http_stream_the_client_leaves_is_logged_with_the_tokens_it_got(fake, caplog):
    import logging

    model = fake.engine.model_info.name
    fake.engine.script = Script(answer="word " * 200, token_delay_s=0.01)
    url = fake.http_url + "/metrics"
    tokens_before = _value(httpx.get(url).text, "spark:generation_tokens_total")
    with caplog.at_level(logging.INFO, logger="spark_server.requests"):
        with httpx.stream("POST", fake.http_url + "/v1/completions", headers={"X-Request-Id": "leaver-http"},
                          json={"model": model, "prompt": "Hi", "max_tokens": 200, "stream": True}) as r:
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data:")
                if chunks == 5:
                    break
        _wait_for(lambda: any("id=leaver-http" in r.getMessage() for r in caplog.records))
    line = next(r.getMessage() for r in caplog.records if "id=leaver-http" in r.getMessage())
    got = int(re.search(r"completion_tokens=(\d+)", line).group(1))
    assert 5 <= got < 200 and "ttft=-" not in line, line
    assert _value(httpx.get(url).text, "spark:generation_tokens_total") >= tokens_before + 5
    fake.wait_idle()
