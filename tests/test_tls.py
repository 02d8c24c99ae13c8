"""--ssl-certfile / --ssl-keyfile: the real server answers over wss:// and https://."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess

import httpx
import pytest
import websockets

from spark_server.app import build_app, uvicorn_config
from spark_server.settings import Settings
from tests.conftest import ServerThread, free_port, wait_healthy
from tests.fake_engine import FakeEngine
from tests.spark.client import spark_request


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_wss_and_https(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    # the app as the CLI configures it (uvicorn_config), in-process on the scripted engine: TLS is the
    # server's business, not the model's
    settings = Settings(port=free_port(), ssl_certfile=str(cert), ssl_keyfile=str(key), log_level="warning")
    app = build_app(settings, FakeEngine())
    port = settings.port
    with ServerThread(app, port, uvicorn_config(app, settings)):
        context = ssl.create_default_context(cafile=str(cert))
        wait_healthy(f"https://127.0.0.1:{port}", verify=context)

        async def talk():
            async with websockets.connect(f"wss://127.0.0.1:{port}/turing/v3/gpt", ssl=context) as ws:
                await ws.send(json.dumps(spark_request("Hi", max_tokens=3, top_k=1)))
                return [json.loads(m) async for m in ws]

        frames = asyncio.run(talk())
        assert frames[-1]["header"]["code"] == 0 and frames[-1]["header"]["status"] == 2
        assert httpx.get(f"https://127.0.0.1:{port}/health", verify=context).status_code == 200
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)  # plain HTTP is not served
