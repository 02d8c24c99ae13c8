"""--ssl-certfile / --ssl-keyfile: the real server answers over wss:// and https://."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
import sys

import httpx
import pytest
import websockets

from tests.conftest import free_port, wait_healthy
from tests.spark.client import spark_request


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_wss_and_https(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "spark_server", "serve", "--port", str(port), "--log-level",
                             "warning", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        while "serving" not in line:
            assert line or proc.poll() is None, "server exited"
            line = proc.stdout.readline()
        assert f"wss://127.0.0.1:{port}/turing/v3/gpt" in line
        context = ssl.create_default_context(cafile=str(cert))
        wait_healthy(f"https://127.0.0.1:{port}", verify=context)

        async def talk():
            async with websockets.connect(f"wss://127.0.0.1:{port}/turing/v3/gpt", ssl=context) as ws:
                await ws.send(json.dumps(spark_request("Hi", max_tokens=3, top_k=1)))
                return [json.loads(m) async for m in ws]

        frames = asyncio.run(talk())
        assert frames[-1]["header"]["code"] == 0 and frames[-1]["header"]["status"] == 2
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)  # plain HTTP is not served
    finally:
        proc.terminate()
        proc.wait(timeout=30)
