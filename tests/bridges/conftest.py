from __future__ import annotations

import pytest

from spark_server.settings import Settings
from tests.conftest import fake_server_with, free_port


@pytest.fixture(scope="session")
def fake_variant_server():
    """fullTextEnabled and vLLM's own cumulative stream, on the scripted fake engine."""
    with fake_server_with(Settings(port=free_port(), full_text_enabled=True, vllm_stream="cumulative")) as server:
        yield server
