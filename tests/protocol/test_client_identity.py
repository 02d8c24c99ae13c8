"""Every request reaches the engine naming its client (the scheduler's fair share between clients): the
Spark key that signed the socket's URL, else the peer's address, whatever the protocol."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from spark_server.app import build_app
from spark_server.auth import sign_url
from spark_server.settings import Settings
from tests.conftest import ServerThread, free_port
from tests.fake_engine import FakeEngine
from tests.protocol.conftest import FakeServer
from tests.spark.client import converse, spark_request

MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2}),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ("/turing/v3/func/gpt", spark_request("hi", max_tokens=2)),
])
def test_http_requests_name_the_peer_address(fake, path, body):
    r = httpx.post(fake.url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert fake.engine.requests and {req.client for req in fake.engine.requests} == {"addr:127.0.0.1"}


def test_a_spark_socket_names_the_peer_address(fake):
    asyncio.run(converse(fake.ws_url, spark_request("hi", max_tokens=2)))
    assert fake.last_request().client == "addr:127.0.0.1"


def test_a_signed_spark_socket_names_its_key():
    engine = FakeEngine()
    settings = Settings(port=free_port(), spark_auth="tenant-a:secret-a,tenant-b:secret-b")
    with ServerThread(build_app(settings, engine), settings.port):
        server = FakeServer(engine, settings.port)
        when = datetime.now(UTC) - timedelta(seconds=3)
        for key, secret in (("tenant-a", "secret-a"), ("tenant-b", "secret-b")):
            frames = asyncio.run(converse(sign_url(server.ws_url, key, secret, when), spark_request("hi")))
            assert frames[-1]["header"]["code"] == 0
            assert server.last_request().client == f"key:{key}"
