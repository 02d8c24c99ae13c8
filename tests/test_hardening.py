"""One request must never hurt another: out-of-vocabulary ids, refused fan-outs, client-chosen ids,
forged log lines, and the API key on the WebSocket. Those about the engine run beside a real Spark session
that must finish normally; those decided at the server's door (the key, bounds checked before admission, log
lines) run on the scripted fake engine."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest
import websockets

import schemas
from engine.errors import InvalidRequestError
from engine.request import GenerationRequest, TextPrompt
from engine.sampling_params import SamplingParams
from spark_server.settings import Settings
from tests.conftest import FakeServer, LiveServer, fake_server_with, free_port
from tests.spark.client import converse, spark_request

LONG = "Count slowly from one to fifty, one number per line."


def _spark_alongside(live: LiveServer, max_tokens: int = 24) -> asyncio.Task:
    return asyncio.ensure_future(converse(live.ws_url, spark_request(LONG, max_tokens=max_tokens, top_k=1)))


async def _finished_normally(task: asyncio.Task) -> None:
    frames = await task
    last = frames[-1]
    assert last["header"]["code"] == 0, last
    assert last["payload"]["usage"]["text"]["completion_tokens"] >= 1


async def _first_frame_seen(live: LiveServer) -> None:
    """Until the engine has a running sequence (the co-batched session is decoding)."""
    core = live.engine.engine
    for _ in range(400):
        if core.num_running:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the Spark session never started")


def _model(live: LiveServer | FakeServer) -> str:
    return live.engine.model_info.name


async def test_an_out_of_vocabulary_token_id_fails_only_its_own_request(live_server):
    m = _model(live_server)
    spark = _spark_alongside(live_server)
    await _first_frame_seen(live_server)
    bad = 1_000_000_000
    calls = [
        ("/v1/completions", {"model": m, "prompt": "Hi", "max_tokens": 4, "stop_token_ids": [bad]}),
        ("/v1/completions", {"model": m, "prompt": "Hi", "max_tokens": 4, "stop_token_ids": [bad], "stream": True}),
        ("/v1/chat/completions", {"model": m, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                  "stop_token_ids": [bad]}),
        ("/generate", {"prompt": "Hi", "max_tokens": 4, "stop_token_ids": [bad]}),
        ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "stop_token_ids": [bad]}}),
    ]
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as client:
        for path, body in calls:
            resp = await client.post(path, json=body)
            assert resp.status_code == 400, (path, resp.text)
            assert "stop_token_ids" in resp.text and "vocabulary" in resp.text, resp.text
    await _finished_normally(spark)
    live_server.wait_idle()


async def test_the_engine_checks_token_ids_at_the_door(async_engine):
    req = GenerationRequest("x", TextPrompt("Hi"), SamplingParams(max_tokens=2, stop_token_ids=[10**9]))
    with pytest.raises(InvalidRequestError) as err:
        async for _ in async_engine.generate(req):
            pass
    assert err.value.parameter == "stop_token_ids"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [[1, 2, 3], [1, 1_000_000_000]], "max_tokens": 1000, "ignore_eos": True}),
    ("/v1/completions", {"prompt": [[1, 2, 3], [1, 1_000_000_000]], "max_tokens": 1000, "ignore_eos": True,
                         "stream": True}),
    ("/generate", {"input_ids": [[1, 2, 3], [1, 1_000_000_000]],
                   "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}),
    ("/generate", {"input_ids": [[1, 2, 3], [1, 1_000_000_000]], "stream": True,
                   "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}),
])
async def test_a_refused_fan_out_leaves_nothing_running(live_server, path, body):
    """The first prompt is admitted before the second is refused: it must be aborted, not left to
    generate 1,000 tokens for nobody."""
    if path.startswith("/v1/"):
        body = {"model": _model(live_server), **body}
    spark = _spark_alongside(live_server, max_tokens=8)
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as client:
        resp = await client.post(path, json=body)
    assert resp.status_code == 400 and "vocabulary" in resp.text, resp.text
    await _finished_normally(spark)
    live_server.wait_idle(timeout=3.0)  # 1,000 leaked tokens would take far longer


async def test_client_chosen_ids_never_collide(live_server):
    m = _model(live_server)
    # a Spark session's sid, then the same string as an SGLang rid while it runs
    async with (httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as client,
                websockets.connect(live_server.ws_url) as ws):
        await ws.send(json.dumps(spark_request(LONG, max_tokens=16, top_k=1)))
        first = json.loads(await ws.recv())
        sid = first["header"]["sid"]
        same_sid = client.post("/generate",
                               json={"text": "Hi", "rid": sid, "sampling_params": {"max_new_tokens": 4}})
        triton = [client.post(f"/v2/models/{m}/generate", json={"id": "same", "text_input": "Hi",
                                                                 "parameters": {"max_new_tokens": 4}})
                  for _ in range(3)]
        sglang = [client.post("/generate", json={"text": "Hi", "rid": "dup", "sampling_params": {
            "max_new_tokens": 4}}) for _ in range(2)]
        replies = await asyncio.gather(same_sid, *triton, *sglang)
        frames = [first] + [json.loads(f) async for f in ws]
    assert [r.status_code for r in replies] == [200] * 6, [r.text for r in replies]
    assert replies[0].json()["meta_info"]["id"] == sid
    assert all(r.json()["id"] == "same" for r in replies[1:4])
    assert all(r.json()["meta_info"]["id"] == "dup" for r in replies[4:])
    assert frames[-1]["header"]["code"] == 0
    live_server.wait_idle()


async def test_a_trace_id_cannot_forge_a_log_line(fake, caplog):
    forged = "x\nINFO spark_server.sessions: session sid=FORGED code=0\r"
    with caplog.at_level(logging.INFO, logger="spark_server.sessions"):
        frames = await converse(fake.ws_url, spark_request("Hi", trace_id=forged, max_tokens=2, top_k=1))
        assert frames[-1]["header"]["code"] == 0
        for _ in range(100):
            lines = [r.getMessage() for r in caplog.records if r.name == "spark_server.sessions"
                     and "FORGED" in r.getMessage()]
            if lines:
                break
            await asyncio.sleep(0.02)
    assert lines and all("\n" not in line and "\r" not in line for line in lines), lines
    assert "x\\x0aINFO" in lines[0]


def test_every_number_in_every_schema_is_bounded():
    """An unbounded number field lets 999999999999 or a 5,000-digit integer through to the engine."""
    exempt = {("vllm-generate", "/properties/stop_token_ids/items")}  # the spec: ids beyond int32 are ignored
    unbounded = []

    def walk(node: Any, name: str, path: str) -> None:
        if isinstance(node, dict):
            kind = node.get("type")
            types = kind if isinstance(kind, list) else [kind] if isinstance(kind, str) else []
            if {"number", "integer"} & set(types) and "enum" not in node and "const" not in node:
                low = "minimum" in node or "exclusiveMinimum" in node
                high = "maximum" in node or "exclusiveMaximum" in node
                if not (low and high) and (name, path) not in exempt:
                    unbounded.append(f"{name}{path}")
            for key, child in node.items():
                walk(child, name, f"{path}/{key}")
        elif isinstance(node, list):
            for i, child in enumerate(node):
                walk(child, name, f"{path}/{i}")

    for name in schemas.available():
        walk(schemas.load_schema(name), name, "")
    assert unbounded == []


def test_schema_validation_stops_after_a_few_errors(monkeypatch):
    body = {"header": {"traceId": "t"}, "payload": {"message": {"text": [{"role": 1, "content": 2}] * 50_000}}}
    real = schemas.validator("spark-request")
    seen = []

    class Counting:
        def iter_errors(self, instance):
            for error in real.iter_errors(instance):
                seen.append(error)
                yield error

    monkeypatch.setattr(schemas, "validator", lambda name: Counting())
    assert schemas.first_error("spark-request", body) is not None
    assert len(seen) <= schemas.MAX_ERRORS_CONSIDERED


# ---- the API key on the Spark WebSocket ---------------------------------------------------------

API_KEY = "sk-only-this"


@pytest.fixture(scope="module")
def key_only_server():
    with fake_server_with(Settings(port=free_port(), api_key=API_KEY)) as server:
        yield server


async def _handshake(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        async with websockets.connect(url, additional_headers=headers or {}) as ws:
            await ws.send(json.dumps(spark_request("Hi", max_tokens=2, top_k=1)))
            frames = [json.loads(f) async for f in ws]
            assert frames[-1]["header"]["code"] == 0
            return 101
    except websockets.InvalidStatus as exc:
        body = exc.response.body.decode()
        assert '"code":11200' in body.replace(" ", ""), body
        return exc.response.status_code


async def test_api_key_alone_protects_the_websocket(key_only_server):
    url = key_only_server.ws_url
    assert await _handshake(url) == 401
    assert await _handshake(url, {"Authorization": "Bearer wrong"}) == 401
    assert await _handshake(url + "?api_key=wrong") == 401
    assert await _handshake(url, {"Authorization": f"Bearer {API_KEY}"}) == 101
    assert await _handshake(url + f"?api_key={API_KEY}") == 101  # browsers cannot set headers
    async with httpx.AsyncClient(base_url=key_only_server.http_url) as client:
        body = spark_request("Hi", max_tokens=2, top_k=1)
        assert (await client.post("/turing/v3/func/gpt", json=body)).status_code == 401
        assert (await client.post("/turing/v3/func/gpt", json=body,
                                  headers={"Authorization": f"Bearer {API_KEY}"})).status_code == 200
        assert (await client.get("/health")).status_code == 200


async def test_a_fan_out_over_the_limit_is_refused_before_any_work(fake):
    m = _model(fake)
    async with httpx.AsyncClient(base_url=fake.http_url, timeout=60) as client:
        resp = await client.post("/v1/completions", json={"model": m, "prompt": [f"p{i}" for i in range(8)],
                                                          "n": 16, "max_tokens": 4})
        assert resp.status_code == 400 and "--max-seqs-per-request" in resp.text, resp.text
        resp = await client.post("/generate", json={"text": [f"p{i}" for i in range(8)],
                                                    "sampling_params": {"n": 16, "max_new_tokens": 4}})
        assert resp.status_code == 400 and "--max-seqs-per-request" in resp.text, resp.text
    assert fake.engine.requests == []  # nothing reached the engine


async def test_an_overloaded_fan_out_leaves_nothing_running(live_server):
    """Refused with 429 part-way (the wait queue is full): the prompts already admitted are aborted."""
    m = _model(live_server)
    core = live_server.engine.engine
    old = core.config.max_waiting, core.config.max_num_seqs
    core.config.max_waiting, core.config.max_num_seqs = 0, 16  # room for 16 sequences, none waiting
    try:
        async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as client:
            resp = await client.post("/v1/completions", json={"model": m, "prompt": [f"story {i}" for i in range(2)],
                                                              "n": 16, "max_tokens": 1000, "ignore_eos": True})
        assert resp.status_code == 429, resp.text
        live_server.wait_idle(timeout=3.0)
    finally:
        core.config.max_waiting, core.config.max_num_seqs = old


async def test_stop_strings_over_the_budget_are_refused_naming_stop(live_server):
    """--max-stop-strings (64) and --max-stop-chars (4,096 in all): every stop string is matched against
    every token of every sample, so their number and size are bounded before admission (by the engine's
    own parameter check: the real one)."""
    m = _model(live_server)
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as client:
        resp = await client.post("/generate", json={"text": "hi", "sampling_params": {
            "max_new_tokens": 2, "stop": [f"s{i}" for i in range(65)]}})
        assert resp.status_code == 400 and "--max-stop-strings" in resp.text, resp.text
        resp = await client.post("/v1/completions", json={"model": m, "prompt": "hi", "max_tokens": 2,
                                                          "stop": ["x" * 2048, "y" * 2049]})
        assert resp.status_code == 400 and "--max-stop-chars" in resp.text, resp.text
        assert resp.json()["error"]["param"] == "stop"
        resp = await client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2,
                                                                                   "stop": ["x" * 1000] * 5}})
        assert resp.status_code == 422 and "--max-stop-chars" in resp.text, resp.text
        resp = await client.post("/v1/completions", json={"model": m, "prompt": "hi", "max_tokens": 2,
                                                          "stop": [f"s{i}" for i in range(64)]})
        assert resp.status_code == 200, resp.text
