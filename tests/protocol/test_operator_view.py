"""What an operator sees: metrics labelled with the model and the process's own, and a Grafana dashboard
whose every query names a metric /metrics exports (the settings line and timestamps:
tests/test_settings_and_cli.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"


def test_metrics_carry_the_model_name_and_process_metrics(fake):
    httpx.post(fake.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    text = httpx.get(fake.url + "/metrics").text
    assert re.search(r'spark:requests_total\{[^}]*model_name="fake-model"[^}]*\} [1-9]', text)
    assert 'spark:num_requests_running{model_name="fake-model"}' in text
    assert "process_resident_memory_bytes" in text and "process_cpu_seconds_total" in text


def test_every_metric_the_dashboard_queries_is_exported(fake):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queried = {m for e in exprs for m in re.findall(r"\b(spark:[a-z0-9_:]+|process_[a-z0-9_]+)", e)}
    # a labelled counter has samples once a request made one of its label sets: one request first, so the
    # test does not depend on other tests of the session having run before it
    model = fake.engine.model_info.name
    assert httpx.post(fake.url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2}).is_success
    exported = set(re.findall(r"^([a-z0-9_:]+)(?:\{| )", httpx.get(fake.url + "/metrics").text, flags=re.M))
    from engine import cpu_contention

    if cpu_contention._thread_times() is None:  # a kernel without scheduler statistics: no queueing counters
        queried = {m for m in queried if not m.startswith("spark:cpu_")}
    assert queried and queried <= exported, sorted(queried - exported)


def test_the_playground_signs_urls_only_behind_the_api_key():
    import asyncio

    import websockets

    from spark_server.app import build_app
    from spark_server.settings import Settings
    from tests.conftest import ServerThread, free_port
    from tests.fake_engine import FakeEngine

    settings = Settings(port=free_port(), api_key="k", spark_auth="pk:ps")
    with ServerThread(build_app(settings, FakeEngine()), settings.port):
        base = f"http://127.0.0.1:{settings.port}"
        assert httpx.get(base + "/").status_code == 200  # the page itself needs no key
        assert httpx.post(base + "/playground/sign").status_code == 401
        url = httpx.post(base + "/playground/sign", headers={"Authorization": "Bearer k"}).json()["url"]

        async def opens() -> bool:
            async with websockets.connect(url):
                return True

        assert url.startswith(f"ws://127.0.0.1:{settings.port}/turing/v3/gpt?authorization=") and asyncio.run(opens())
