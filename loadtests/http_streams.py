"""Locust users for the streaming HTTP bridges: OpenAI chat (SSE) and TGI /generate_stream.
Each records "first token" (ms to the first SSE event) beside the whole request."""

from __future__ import annotations

import json
import random
import time

from locust import HttpUser, between, task

PROMPTS = ["Tell me about the moon.", "List three fruits.", "What is 12 times 12?", "用一句话介绍长城。"]


class _StreamingUser(HttpUser):
    abstract = True
    wait_time = between(0.2, 1.0)

    def _first_token(self, name: str, ms: float) -> None:
        self.environment.events.request.fire(request_type="SSE", name=name, response_time=ms, response_length=0,
                                             exception=None, context={})

    def _stream(self, path: str, body: dict, name: str) -> None:
        start = time.perf_counter()
        with self.client.post(path, json=body, stream=True, catch_response=True, name=name) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            first = None
            events = 0
            for line in resp.iter_lines():
                if not line or not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    resp.failure(str(data["error"])[:200])
                    return
                if first is None:
                    first = time.perf_counter()
                    self._first_token(f"{name} first token", (first - start) * 1000)
                events += 1
            if events == 0:
                resp.failure("no events")
            else:
                resp.success()


class OpenAIChatUser(_StreamingUser):
    @task
    def chat(self) -> None:
        model = self.environment.parsed_options.model if hasattr(self.environment.parsed_options, "model") else None
        body = {"model": model or "SmolLM2-135M-Instruct", "stream": True, "max_tokens": 32, "temperature": 0.7,
                "messages": [{"role": "user", "content": random.choice(PROMPTS)}]}
        self._stream("/v1/chat/completions", body, "openai chat stream")


class TGIStreamUser(_StreamingUser):
    @task
    def generate(self) -> None:
        body = {"inputs": random.choice(PROMPTS), "parameters": {"max_new_tokens": 32, "do_sample": True,
                                                               "temperature": 0.7}}
        self._stream("/generate_stream", body, "tgi generate_stream")
