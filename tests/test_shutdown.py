"""SIGTERM during running sessions: short ones finish, long ones get the shutdown frame, exit 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import httpx
import websockets

from tests.conftest import free_port, wait_healthy
from tests.spark.client import spark_request


def test_sigterm_drains_then_exits_zero():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "spark_server", "serve", "--port", str(port),
                             "--shutdown-grace", "3", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}")
        url = f"ws://127.0.0.1:{port}/turing/v3/gpt"

        async def session(long: bool):
            body = spark_request("Write a very long story about the sea." if long else "Say hi.",
                                 max_tokens=2000 if long else 6, temperature=1.0, top_k=6)
            frames = []
            async with websockets.connect(url) as ws:
                await ws.send(json.dumps(body))
                async for message in ws:
                    frames.append(json.loads(message))
            return frames

        async def scenario():
            tasks = [asyncio.create_task(session(long=i % 2 == 0)) for i in range(10)]
            await asyncio.sleep(1.5)  # everyone is running
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient() as client:  # new work is refused while draining
                refused = await client.post(f"http://127.0.0.1:{port}/generate", json={"inputs": "hi"})
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=60), refused

        results, refused = asyncio.run(scenario())
        assert refused.status_code == 503
        codes = [frames[-1]["header"]["code"] for frames in results]
        assert all(frames[-1]["header"]["status"] == 2 for frames in results)
        assert codes.count(0) >= 5 and set(codes) <= {0, 12101}  # short ones finished
        assert 12101 in codes  # long ones were ended after the grace period, with a frame
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
