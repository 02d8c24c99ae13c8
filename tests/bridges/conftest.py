from __future__ import annotations

import pytest

from spark_server.app import build_app
from spark_server.settings import Settings
from tests.conftest import LiveServer, ServerThread, free_port


@pytest.fixture(scope="session")
def variant_server(async_engine):
    """fullTextEnabled and vLLM's own cumulative stream."""
    settings = Settings(port=free_port(), full_text_enabled=True, vllm_stream="cumulative")
    with ServerThread(build_app(settings, async_engine, owns_engine=False), settings.port):
        yield LiveServer(async_engine, settings.port)
