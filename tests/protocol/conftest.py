"""The protocol layer on the scripted fake engine (tests/fake_engine.py), served by a real uvicorn and
reached with real clients: no model, milliseconds per request."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from spark_server.app import SPARK_WS_PATH, build_app
from spark_server.settings import Settings
from tests.conftest import ServerThread, free_port
from tests.fake_engine import FakeEngine, Script


@dataclass
class FakeServer:
    engine: FakeEngine
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}{SPARK_WS_PATH}"

    def last_request(self):
        assert self.engine.requests, "no request reached the engine"
        return self.engine.requests[-1]


@pytest.fixture(scope="session")
def fake_server() -> FakeServer:
    engine = FakeEngine()
    settings = Settings(port=free_port())
    with ServerThread(build_app(settings, engine), settings.port):
        yield FakeServer(engine, settings.port)


@pytest.fixture(scope="session")
def fake_hf_server(fake_server: FakeServer) -> FakeServer:
    """The same fake engine in the HF `text_generation` client's shape (--tgi-compat hf)."""
    settings = Settings(port=free_port(), tgi_compat="hf")
    with ServerThread(build_app(settings, fake_server.engine, owns_engine=False), settings.port):
        yield FakeServer(fake_server.engine, settings.port)


@pytest.fixture
def fake(fake_server: FakeServer) -> FakeServer:
    """The shared fake server with a fresh script and request log for this test."""
    fake_server.engine.script = Script()
    fake_server.engine.requests.clear()
    yield fake_server
    fake_server.engine.script = Script()
