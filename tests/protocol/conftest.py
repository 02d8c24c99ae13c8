"""The protocol layer on the scripted fake engine (tests/fake_engine.py), served by a real uvicorn and
reached with real clients: no model, milliseconds per request."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from spark_server.app import build_app
from spark_server.settings import Settings
from tests.conftest import FakeServer, ServerThread, free_port


@pytest.fixture(scope="session")
def fake_hf_server(fake_server: FakeServer) -> Iterator[FakeServer]:
    """The same fake engine in the HF `text_generation` client's shape (--tgi-compat hf)."""
    settings = Settings(port=free_port(), tgi_compat="hf")
    with ServerThread(build_app(settings, fake_server.engine, owns_engine=False), settings.port):
        yield FakeServer(fake_server.engine, settings.port)
