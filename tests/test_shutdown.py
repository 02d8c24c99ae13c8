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
from tests.plain_http import TLS
from tests.spark.client import spark_request

MODEL = "SmolLM2-135M-Instruct"
_LONG = "Write a very long story about the sea."
_COUNT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"  # plain text that greedy decoding continues for long
LONG_STREAMS = {
    "openai": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": _LONG}],
                                        "max_tokens": 2000, "ignore_eos": True, "stream": True}),
    "tgi": ("/generate_stream", {"inputs": _COUNT, "parameters": {"max_new_tokens": 2000}}),
    "vllm": ("/generate", {"prompt": _LONG, "max_tokens": 2000, "ignore_eos": True, "stream": True}),
    "sglang": ("/generate", {"text": _LONG, "stream": True, "sampling_params": {"max_new_tokens": 2000,
                                                                                "ignore_eos": True}}),
    "triton": (f"/v2/models/{MODEL}/generate_stream", {"text_input": _COUNT, "parameters": {"max_new_tokens": 2000}}),
    "mindie": ("/infer", {"inputs": _COUNT, "stream": True, "parameters": {"max_new_tokens": 2000}}),
}


def _events(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]


WELL_FORMED_END = {
    "openai": lambda t: "shutting down" in _events(t)[-2] and _events(t)[-1] == "[DONE]",
    "tgi": lambda t: "shutting down" in _events(t)[-1] and '"error_type"' in _events(t)[-1],
    "vllm": lambda t: t.endswith("\0") and "shutting down" in t.split("\0")[-2],
    "sglang": lambda t: "shutting down" in _events(t)[-2] and _events(t)[-1] == "[DONE]",
    "triton": lambda t: "shutting down" in _events(t)[-1],
    "mindie": lambda t: "shutting down" in _events(t)[-1],
}


def test_sigterm_drains_then_exits_zero():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "spark_server", "serve", "--port", str(port),
                             "--shutdown-grace", "2", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", verify=TLS)
        url = f"ws://127.0.0.1:{port}/turing/v3/gpt"

        async def session(long: bool, first: asyncio.Event):
            body = spark_request("Write a very long story about the sea." if long else "Say hi.",
                                 max_tokens=2000 if long else 6, temperature=1.0, top_k=6)
            frames = []
            async with websockets.connect(url) as ws:
                await ws.send(json.dumps(body))
                async for message in ws:
                    frames.append(json.loads(message))
                    first.set()
            return frames

        async def stream(client: httpx.AsyncClient, path: str, body: dict, first: asyncio.Event) -> str:
            chunks = []
            async with client.stream("POST", f"http://127.0.0.1:{port}{path}", json=body, timeout=60) as resp:
                assert resp.status_code == 200
                async for chunk in resp.aiter_text():
                    chunks.append(chunk)
                    first.set()
            return "".join(chunks)

        async def scenario():
            started = [asyncio.Event() for _ in range(10 + len(LONG_STREAMS))]  # at a first frame or chunk
            tasks = [asyncio.create_task(session(i % 2 == 0, started[i])) for i in range(10)]
            async with httpx.AsyncClient(verify=TLS) as client:
                streams = {name: asyncio.create_task(stream(client, path, body, started[10 + j]))
                           for j, (name, (path, body)) in enumerate(LONG_STREAMS.items())}
                # everyone is running (on a loaded machine that takes longer than any fixed wait), and a
                # short session has at most 6 tokens to go: well within the 2 s grace
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=60)
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                # new work is refused while draining
                refused = await client.post(f"http://127.0.0.1:{port}/generate", json={"inputs": "hi"})
                ended = {name: await asyncio.wait_for(task, timeout=60) for name, task in streams.items()}
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=60), refused, ended

        results, refused, ended = asyncio.run(scenario())
        for name, text in ended.items():  # every streaming protocol ends with its own well-formed end
            assert WELL_FORMED_END[name](text), (name, text[-300:])
        assert refused.status_code == 503
        codes = [frames[-1]["header"]["code"] for frames in results]
        assert all(frames[-1]["header"]["status"] == 2 for frames in results)
        assert codes.count(0) >= 5 and set(codes) <= {0, 12101}  # short ones finished
        assert 12101 in codes  # long ones were ended after the grace period, with a frame
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
