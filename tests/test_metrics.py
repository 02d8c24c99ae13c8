"""GET /metrics: vLLM-style names, and the counters move with real traffic."""

from __future__ import annotations

import asyncio
import re

import httpx

from tests.spark.client import converse, spark_request


def _value(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + (r"\{" + labels + r"\}" if labels else "") + r" ([0-9.e+-]+)"
    found = re.findall(pattern, text)
    return float(found[0]) if found else 0.0


def test_metrics_follow_traffic(live_server):
    url = live_server.http_url + "/metrics"
    before = httpx.get(url).text
    for name in ("spark:num_requests_running", "spark:num_requests_waiting", "spark:kv_cache_usage_perc",
                 "spark:time_to_first_token_seconds_bucket", "spark:time_per_output_token_seconds_bucket"):
        assert name in before
    asyncio.run(converse(live_server.ws_url, spark_request("Hi", max_tokens=4, top_k=1)))
    asyncio.run(converse(live_server.ws_url, "{not json"))
    model = live_server.engine.model_info.name
    httpx.post(live_server.http_url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
    httpx.post(live_server.http_url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 0})
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


def test_one_log_line_per_http_request(live_server, caplog):
    import logging

    model = live_server.engine.model_info.name
    with caplog.at_level(logging.INFO, logger="spark_server.requests"):
        httpx.post(live_server.http_url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 3},
                   headers={"X-Request-Id": "trace-123"})
        httpx.post(live_server.http_url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 0})
    lines = [r.getMessage() for r in caplog.records if r.name == "spark_server.requests"]
    ok = [line for line in lines if "id=trace-123" in line]
    assert len(ok) == 1 and "protocol=openai" in ok[0] and "code=200" in ok[0]
    assert "completion_tokens=3" in ok[0] and "ttft=-" not in ok[0]
    assert any("code=400" in line for line in lines)
