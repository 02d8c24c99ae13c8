"""The fleet front end (--engine-url over several backends) retries only a request no backend took: a
backend that accepts a request and then drops the connection may have been killed by that very request,
so it goes to no other backend (one request must not take down the fleet). Fake backends on real
sockets: no model, no router."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from spark_server.app import build_app
from spark_server.settings import Settings
from tests.conftest import ServerThread, free_port

MODEL = "fake-backend-model"


class FakeBackend:
    """An OpenAI-style backend: ``mode`` says what it does with a completion request it is sent: "drop"
    (reads it whole, then closes the connection without a word), "refuse" (503 before reading it), "ok"
    (one token, then the end)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.completions = 0
        self.bodies: list[dict] = []  # every completion request's body, as read
        backend = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _json(self, status: int, data: dict) -> None:
                payload = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": MODEL, "max_model_len": 2048}]})
                elif self.path == "/health":
                    self._json(200, {})
                else:
                    self._json(404, {"error": "not found"})

            def do_POST(self) -> None:
                if self.path != "/v1/completions":
                    self._json(404, {"error": "not found"})
                    return
                if backend.mode == "refuse":
                    self._json(503, {"error": {"message": "not ready", "code": 503}})
                    return
                backend.bodies.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0))))
                backend.completions += 1
                if backend.mode == "drop":
                    self.close_connection = True  # as a process killed by the request would
                    return
                chunk = {"choices": [{"index": 0, "text": " hi", "token_ids": [1], "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeBackend:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _front_end(backends: list[FakeBackend]):
    settings = Settings(port=free_port(), engine_url=",".join(b.url for b in backends))
    return settings, ServerThread(build_app(settings, settings.remote_engine()), settings.port)


def _complete(port: int) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                      json={"model": MODEL, "prompt": "Hello", "max_tokens": 1}, timeout=60)


def test_a_request_a_backend_took_and_died_on_is_not_sent_to_another():
    """Both backends drop what they take: whichever gets the request, it is the only one that sees it,
    and the client gets an error (before: the request was sent on, and one request dropped both)."""
    with FakeBackend("drop") as a, FakeBackend("drop") as b:
        settings, server = _front_end([a, b])
        with server:
            for seen in (1, 2):  # the front end takes backends in turn: the second request goes to the other
                resp = _complete(settings.port)
                assert resp.status_code == 500, resp.text
                assert "after accepting it" in resp.json()["error"]["message"], resp.text
                assert a.completions + b.completions == seen  # only the backend it went to saw it
            assert a.completions == b.completions == 1  # the second went to the other, in turn
            assert httpx.get(f"http://127.0.0.1:{settings.port}/v1/models", timeout=10).status_code == 200


def test_a_refusal_before_the_request_was_taken_goes_to_the_next_backend():
    """503 before the body is read (or nothing listening): the request was never delivered, so the next
    backend answers it."""
    with FakeBackend("refuse") as a, FakeBackend("ok") as b:
        settings, server = _front_end([a, b])
        with server:
            resp = _complete(settings.port)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == " hi"
            assert b.completions == 1


def test_a_backend_that_is_not_listening_is_skipped():
    port = free_port()  # nothing listens there
    with FakeBackend("ok") as b:
        settings = Settings(port=free_port(), engine_url=f"http://127.0.0.1:{port},{b.url}")
        with ServerThread(build_app(settings, settings.remote_engine()), settings.port):
            for _ in range(2):  # either backend's turn first
                resp = _complete(settings.port)
                assert resp.status_code == 200, resp.text
            assert b.completions == 2
