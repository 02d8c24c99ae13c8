"""The Spark WebSocket session end to end, against the real server and model; the frames' shape, the Java
example's top-level chat and the history fitting (the server's, with the real tokenizer) on the scripted fake
engine."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import websockets

from tests.spark.client import answer_text, converse, spark_request

SPEC_SAMPLE = {
    "header": {"traceId": "SPARK_DEMO"},
    "parameter": {"chat": {"temperature": 0.5, "max_tokens": 24, "top_k": 1}},
    "payload": {"message": {"text": [
        {"role": "user", "content": "你是谁"},
        {"role": "assistant", "content": "我是一个AI助手。<end>"},
        {"role": "user", "content": "你会做什么"},
    ]}},
}


async def test_spec_sample_frames(fake):
    frames = await converse(fake.ws_url, SPEC_SAMPLE)
    assert len(frames) >= 2
    statuses = [f["header"]["status"] for f in frames]
    assert statuses[0] == 0 and statuses[-1] == 2 and all(s == 1 for s in statuses[1:-1])
    assert [f["payload"]["choices"]["status"] for f in frames] == statuses
    assert [f["payload"]["choices"]["seq"] for f in frames] == list(range(len(frames)))
    sids = {f["header"]["sid"] for f in frames}
    assert len(sids) == 1 and re.fullmatch(r"cht[0-9a-f]{8}@dx[0-9a-f]{18}", sids.pop())
    assert all(f["header"]["code"] == 0 for f in frames)
    assert all("usage" not in f["payload"] for f in frames[:-1])
    usage = frames[-1]["payload"]["usage"]["text"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 < usage["completion_tokens"] <= 24 and usage["prompt_tokens"] > usage["question_tokens"] > 0
    for f in frames:
        item = f["payload"]["choices"]["text"][0]
        assert item["role"] == "assistant" and item["index"] == 0
    assert answer_text(frames).strip()


async def test_top_k_1_is_deterministic_and_matches_http(live_server):
    body = spark_request("Name three colors.", max_tokens=20, top_k=1, temperature=0.5)
    first = answer_text(await converse(live_server.ws_url, body))
    second = answer_text(await converse(live_server.ws_url, body))
    assert first == second and first
    async with httpx.AsyncClient(timeout=60) as client:
        resp = await client.post(live_server.spark_http_url, json=body)
    assert resp.status_code == 200
    data = resp.json()
    assert data["header"]["code"] == 0 and data["header"]["traceId"] == "test"
    assert data["payload"]["choices"]["status"] == 2
    # the document's HTTP example: newlines as <ret>, the answer closed by <end> (--spark-http-markers)
    assert data["payload"]["choices"]["text"][0]["content"] == first.replace("\n", "<ret>") + "<end>"
    usage = data["payload"]["usage"]["text"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_chinese_streams_without_replacement_characters(live_server):
    body = spark_request("请用中文介绍一下北京的历史和文化。", max_tokens=48, top_k=1)
    frames = await converse(live_server.ws_url, body)
    text = answer_text(frames)
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text)
    for f in frames:
        assert "\ufffd" not in f["payload"]["choices"]["text"][0]["content"]


async def test_top_level_chat_from_the_java_example(fake):
    body = spark_request("Say hello.")
    body["chat"] = {"max_tokens": 5, "temperature": 0.1, "top_k": 1}
    frames = await converse(fake.ws_url, body)
    assert frames[-1]["header"]["status"] == 2
    assert frames[-1]["payload"]["usage"]["text"]["completion_tokens"] <= 5


async def test_a_knob_given_differently_at_the_top_and_under_parameter_is_refused(fake):
    """Both places are read; where they give one knob two values, neither is dropped silently: code 10000
    naming both. The same value in both is one value."""
    body = spark_request("Say hello.", max_tokens=30)
    body["chat"] = {"max_tokens": 3}
    frames = await converse(fake.ws_url, body)
    header = frames[-1]["header"]
    assert header["code"] == 10000 and "chat.max_tokens" in header["message"]
    assert "parameter.chat.max_tokens" in header["message"]
    body["chat"] = {"max_tokens": 30, "top_k": 1}
    frames = await converse(fake.ws_url, body)
    assert frames[-1]["header"]["status"] == 2 and frames[-1]["header"]["code"] == 0


async def test_end_marker_is_stripped_from_history(live_server, async_engine):
    from spark_server import spark_protocol as sp

    body = sp.parse_body(json.dumps(SPEC_SAMPLE))
    request, _ = sp.lower(body, "sid")
    assert request.prompt.messages[1].content == "我是一个AI助手。"
    # and the server answers the same as for the history without the marker
    plain = json.loads(json.dumps(SPEC_SAMPLE))
    plain["payload"]["message"]["text"][1]["content"] = "我是一个AI助手。"
    a = answer_text(await converse(live_server.ws_url, SPEC_SAMPLE))
    b = answer_text(await converse(live_server.ws_url, plain))
    assert a == b


async def test_adjust_tokens_drops_oldest_turns(fake):
    long_turn = "历史对话内容很长。" * 700  # several thousand tokens
    history = [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": long_turn}, {"role": "assistant", "content": "好的<end>"},
               {"role": "user", "content": long_turn}, {"role": "assistant", "content": "好的<end>"},
               {"role": "user", "content": "Say OK."}]
    refused = await converse(fake.ws_url, spark_request(history, max_tokens=4, top_k=1))
    assert refused[-1]["header"]["code"] == 10003
    adjusted = await converse(fake.ws_url, spark_request(history, max_tokens=4, top_k=1, adjustTokens=True))
    assert adjusted[-1]["header"]["code"] == 0 and adjusted[-1]["header"]["status"] == 2
    assert adjusted[-1]["payload"]["usage"]["text"]["prompt_tokens"] < 8192


async def test_client_disconnect_aborts_generation(live_server):
    core = live_server.engine.engine
    aborted_before = core.num_aborted
    body = spark_request("Write a very long story about the sea.", max_tokens=2000, top_k=4, temperature=1.0)
    async with websockets.connect(live_server.ws_url) as ws:
        await ws.send(json.dumps(body))
        for _ in range(3):
            await ws.recv()
    # the socket is closed mid-answer: the engine must drop the request and free its cache
    live_server.wait_idle(timeout=10)
    assert core.num_aborted == aborted_before + 1


async def test_sessions_run_concurrently(live_server):
    bodies = [spark_request(q, max_tokens=12, top_k=1) for q in ("Hi", "你好", "What is 2+2?", "Name a fruit.")]
    results = await asyncio.gather(*(converse(live_server.ws_url, b) for b in bodies))
    for frames in results:
        assert frames[-1]["header"]["status"] == 2 and frames[-1]["header"]["code"] == 0
    live_server.wait_idle()
