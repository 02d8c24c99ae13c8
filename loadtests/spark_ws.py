"""Locust user for the Spark WebSocket: one session per task, timed the way chat clients feel it.

Recorded as locust request entries (request type "WS"), every column in its own unit:
- "spark first frame": ms from connecting to the first answer frame (time to first frame)
- "spark per frame": mean ms between answer frames of a session
- "spark session": ms for the whole session; its size is the answer's UTF-8 bytes
Token rates are not times, so they stay out of locust's ms columns: each session's completion tokens
and tokens/s are collected here and written beside locust's report when the run stops
(loadtests/reports/<run>-tokens.csv, and a summary line on stdout).
Any error frame or broken socket is a failure with the frame's code in the message.
"""

from __future__ import annotations

import json
import random
import time

import websocket
from locust import User, between, events, task

SESSIONS: list[tuple[int, float]] = []  # (completion tokens, tokens/s) of each finished session


@events.test_stop.add_listener
def write_token_rates(environment, **_kwargs) -> None:
    """Per-session token counts and rates, as a CSV beside locust's own report, and a summary line."""
    import os

    if not SESSIONS:
        return
    prefix = os.environ.get("SPARK_LOADTEST_REPORT", "loadtests/reports/run")
    with open(f"{prefix}-tokens.csv", "w") as out:
        out.write("completion_tokens,tokens_per_s\n")
        out.writelines(f"{n},{rate:.2f}\n" for n, rate in SESSIONS)
    rates = sorted(rate for _, rate in SESSIONS)
    print(f"spark sessions: {len(SESSIONS)}, completion tokens/s per session: p50 {rates[len(rates) // 2]:.1f}, "
          f"p10 {rates[len(rates) // 10]:.1f}, mean {sum(rates) / len(rates):.1f}")

QUESTIONS = ["What is the capital of France?", "Give me three tips for sleeping well.", "你好，请介绍一下你自己。",
             "Explain what a prime number is.", "Write a haiku about the sea.", "北京有哪些名胜古迹？"]


class SparkWebSocketUser(User):
    wait_time = between(0.1, 0.5)
    path = "/turing/v3/gpt"
    max_tokens = 48

    def _fire(self, name: str, ms: float, length: int = 0, exc: Exception | None = None) -> None:
        self.environment.events.request.fire(request_type="WS", name=name, response_time=ms,
                                             response_length=length, exception=exc, context={})

    @task
    def conversation(self) -> None:
        url = self.host.replace("http://", "ws://").replace("https://", "wss://").rstrip("/") + self.path
        body = {"header": {"traceId": f"locust-{random.getrandbits(32):08x}"},
                "parameter": {"chat": {"max_tokens": self.max_tokens, "temperature": 0.7, "top_k": 4}},
                "payload": {"message": {"text": [{"role": "user", "content": random.choice(QUESTIONS)}]}}}
        start = time.perf_counter()
        first = last = None
        frames = answer_bytes = 0
        try:
            ws = websocket.create_connection(url, timeout=120)
            try:
                ws.send(json.dumps(body, ensure_ascii=False))
                while True:
                    frame = json.loads(ws.recv())
                    now = time.perf_counter()
                    header = frame["header"]
                    if header["code"] != 0:
                        raise RuntimeError(f"error frame {header['code']}: {header['message']}")
                    first = first or now
                    last = now
                    frames += 1
                    answer_bytes += len(frame["payload"]["choices"]["text"][0]["content"].encode())
                    if header["status"] == 2:
                        tokens = frame["payload"]["usage"]["text"]["completion_tokens"]
                        break
            finally:
                ws.close()
        except Exception as exc:
            self._fire("spark session", (time.perf_counter() - start) * 1000, exc=exc)
            return
        total = last - start
        self._fire("spark first frame", (first - start) * 1000)
        if frames > 1:
            self._fire("spark per frame", (last - first) / (frames - 1) * 1000)
        self._fire("spark session", total * 1000, length=answer_bytes)
        if last > first and tokens > 1:
            SESSIONS.append((tokens, (tokens - 1) / (last - first)))
