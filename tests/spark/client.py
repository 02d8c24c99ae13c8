"""A small real Spark WebSocket client for the tests."""

from __future__ import annotations

import json
from typing import Any

import websockets


def spark_request(question: str | list[dict[str, str]], *, trace_id: str = "test", **chat: Any) -> dict[str, Any]:
    text = [{"role": "user", "content": question}] if isinstance(question, str) else question
    body: dict[str, Any] = {"header": {"traceId": trace_id}, "payload": {"message": {"text": text}}}
    if chat:
        body["parameter"] = {"chat": chat}
    return body


async def converse(url: str, body: dict[str, Any] | str | bytes) -> list[dict[str, Any]]:
    """Send one request and collect every frame until the server closes the socket."""
    frames = []
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(body if isinstance(body, (str, bytes)) else json.dumps(body, ensure_ascii=False))
        async for message in ws:
            frames.append(json.loads(message))
    return frames


def answer_text(frames: list[dict[str, Any]]) -> str:
    return "".join(f["payload"]["choices"]["text"][0]["content"] for f in frames if f["header"]["code"] == 0)
