"""Every Spark error code from offending input, and the server keeps serving after each.

The codes are the protocol layer's: they run on the scripted fake engine (real tokenizer, no model). One
test drives a fault through the real engine's step, so that the engine's own failure reaches code 11000."""

from __future__ import annotations

import asyncio

import pytest
import websockets

from engine.errors import InferenceError
from spark_server.settings import Settings
from tests.conftest import fake_server_with, free_port
from tests.fake_engine import Script
from tests.spark.client import converse, spark_request


async def _expect_error(live_server, body, code: int, *needles: str) -> dict:
    """``live_server``: any server (the fake engine's, for most tests here)."""
    frames = await converse(live_server.ws_url, body)
    assert len(frames) == 1, frames
    header = frames[0]["header"]
    assert header["code"] == code, header
    assert header["status"] == 2 and header["sid"].startswith("cht")
    for needle in needles:
        assert needle in header["message"], header["message"]
    # the server still answers the next connection
    ok = await converse(live_server.ws_url, spark_request("Hi", max_tokens=2, top_k=1))
    assert ok[-1]["header"]["code"] == 0 and ok[-1]["header"]["status"] == 2
    return header


async def test_not_json_is_code_4(fake):
    await _expect_error(fake, "{this is not json", 4, "JSON")


async def test_binary_garbage_is_code_4(fake):
    await _expect_error(fake, b"\xff\xfe\x00garbage", 4)


@pytest.mark.parametrize("mutate, path", [
    (lambda b: b["header"].pop("traceId"), "traceId"),
    (lambda b: b["parameter"]["chat"].update(temperature=1.5), "$.parameter.chat.temperature"),
    (lambda b: b["parameter"]["chat"].update(max_tokens=0), "$.parameter.chat.max_tokens"),
    (lambda b: b["parameter"]["chat"].update(max_tokens=5000), "$.parameter.chat.max_tokens"),
    (lambda b: b["parameter"]["chat"].update(top_k=7), "$.parameter.chat.top_k"),
    (lambda b: b["parameter"]["chat"].update(adjustTokens="yes"), "$.parameter.chat.adjustTokens"),
    (lambda b: b["parameter"]["chat"].update(frequency=3), "frequency"),
    (lambda b: b["payload"]["message"]["text"][0].update(role="bot"), "$.payload.message.text[0].role"),
    (lambda b: b["payload"]["message"]["text"][0].update(content=5), "$.payload.message.text[0].content"),
    (lambda b: b["payload"].update(lora={"url": "http://x/y.tar"}), "md5"),
])
async def test_schema_violations_are_code_10000_naming_the_field(fake, mutate, path):
    body = spark_request("Hi", max_tokens=4, top_k=1)
    mutate(body)
    await _expect_error(fake, body, 10000, path)


async def test_top_level_array_is_code_10000(fake):
    await _expect_error(fake, "[1, 2]", 10000)


async def test_empty_text_list_is_code_10002(fake):
    await _expect_error(fake, spark_request([]), 10002, "payload.message.text")


async def test_empty_last_question_is_code_10002(fake):
    await _expect_error(fake, spark_request("   "), 10002)


async def test_over_token_limit_is_code_10003(fake):
    await _expect_error(fake, spark_request("hello " * 9000, max_tokens=4), 10003, "8192")


async def test_inference_failure_is_code_11000(live_server):
    core = live_server.engine.engine

    def explode(seqs):
        raise RuntimeError("injected fault")

    core.fault_hook = explode
    try:
        await _expect_error_no_followup(live_server, spark_request("Hi", max_tokens=4), 11000, "injected fault")
    finally:
        core.fault_hook = None
    ok = await converse(live_server.ws_url, spark_request("Hi", max_tokens=2, top_k=1))
    assert ok[-1]["header"]["code"] == 0
    live_server.wait_idle()


async def _expect_error_no_followup(live_server, body, code, needle):
    frames = await converse(live_server.ws_url, body)
    assert frames[-1]["header"]["code"] == code and frames[-1]["header"]["status"] == 2
    assert needle in frames[-1]["header"]["message"]


async def test_unexpected_failure_is_code_minus_1(fake, monkeypatch):
    from spark_server import spark_protocol

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(spark_protocol, "fit_history", broken)
    await _expect_error_no_followup(fake, spark_request("Hi", max_tokens=4), -1, "unexpected")
    monkeypatch.undo()
    ok = await converse(fake.ws_url, spark_request("Hi", max_tokens=2, top_k=1))
    assert ok[-1]["header"]["code"] == 0


async def test_lora_is_refused_until_supported(fake):
    body = spark_request("Hi", max_tokens=4)
    body["payload"]["lora"] = {"url": "http://127.0.0.1:1/pack.tar", "md5": "0" * 32}
    await _expect_error(fake, body, 12000, "LoRA")


def test_silent_client_is_closed_with_an_error():
    async def go(url: str) -> str:
        async with websockets.connect(url) as ws:
            return str(await ws.recv())  # the server gives up after --ws-request-timeout

    with fake_server_with(Settings(port=free_port(), ws_request_timeout=0.5)) as server:
        frame = asyncio.run(go(server.ws_url))
    assert '"code": 10000' in frame and "no request frame" in frame


async def test_http_form_errors_use_spark_codes(fake):
    import httpx

    async with httpx.AsyncClient(timeout=30) as client:
        bad = await client.post(fake.spark_http_url, content=b"nope")
        empty = await client.post(fake.spark_http_url, json=spark_request([]))
    assert bad.status_code == 400 and bad.json()["header"]["code"] == 4
    assert empty.status_code == 400 and empty.json()["header"]["code"] == 10002
    assert empty.json()["header"]["traceId"] == "test"


async def test_a_second_frame_on_one_connection_is_refused(fake):
    import json

    # 300 tokens 50 ms apart: still answering when the second frame comes, for 15 s unless it is stopped
    fake.engine.script = Script(answer="word " * 300, token_delay_s=0.05)
    frames = []
    async with websockets.connect(fake.ws_url) as ws:
        await ws.send(json.dumps(spark_request("Write a long story.", max_tokens=300, temperature=1.0)))
        frames.append(json.loads(await ws.recv()))
        await ws.send(json.dumps(spark_request("Another question", max_tokens=3)))
        async for message in ws:
            frames.append(json.loads(message))
    last = frames[-1]["header"]
    assert last["code"] == 10000 and "one request per connection" in last["message"] and last["status"] == 2
    fake.wait_idle(timeout=3.0)  # the answer in progress was stopped


async def test_a_model_fault_is_a_500_on_the_bridges(fake):
    import httpx

    # what the engine raises when a model step fails (the real step's fault: test_inference_failure_is_code_11000)
    fake.engine.script = Script(fail_before=InferenceError("injected fault"))
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(fake.http_url + "/v1/completions", json={
            "model": fake.engine.model_info.name, "prompt": "Hi", "max_tokens": 3})
        tgi = await client.post(fake.http_url + "/generate", json={"inputs": "Hi"})
    fake.engine.script = Script()
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    assert tgi.status_code == 500 and tgi.json()["error_type"] == "generation"
    ok = await converse(fake.ws_url, spark_request("Hi", max_tokens=2, top_k=1))
    assert ok[-1]["header"]["code"] == 0
