"""Shared fixtures: one real engine with the embedded model, served by uvicorn on a free port; and the scripted
fake engine (tests/fake_engine.py) behind the same server, for every test that needs no model's answers."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

# Servers the tests start as processes: a 0.5 GiB KV cache (the default 2 GiB takes seconds to zero, and no
# test needs it); a test that sets its own still wins.
os.environ.setdefault("SPARK_KV_CACHE_SPACE", "0.5")

# The engine, the app and uvicorn are imported where a fixture or helper first needs them: xdist's controller
# process loads this file too, only to hand files to the workers, and importing torch there would delay every
# worker's start by seconds (and its exit by the interpreter's teardown of torch).
if TYPE_CHECKING:
    import uvicorn

    from engine.async_engine import AsyncEngine
    from spark_server.settings import Settings
    from tests.fake_engine import FakeEngine

# The files that hold a worker longest (each from ~10 s to ~45 s: a server process, engines of their own, a
# calibration), longest first. `make test` hands whole files to two workers in collection order as they free
# up (--dist loadfile --no-loadscope-reorder): these go first, so that the end of the run is short files that
# even out the two workers. A file missing here only runs later; a name of a file gone matches nothing.
LONG_FILES = (
    "tests/fuzz/test_attacks.py",
    "tests/engine/test_quantized_forward.py",
    "tests/fleet/test_fleet.py",
    "tests/lora/test_lora_sessions.py",
    "tests/lora/test_multi_lora_matches_peft.py",
    "tests/test_benchmarks.py",
    "tests/engine/test_structured.py",
    "tests/engine/test_speculation.py",
    "tests/engine/test_constraint_budget.py",
    "tests/engine/test_cpu_kernels.py",
    "tests/fuzz/test_corpus.py",
    "tests/lora/test_adapter_tenancy.py",
    "tests/engine/test_engine_behaviour.py",
    "tests/engine/test_greedy_matches_transformers.py",
    "tests/test_openapi_fuzz.py",
    "tests/test_shutdown.py",
    "tests/test_settings_and_cli.py",
    "tests/test_readme.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """LONG_FILES first, in their order; every other file after them in collection order; within a file, its
    tests marked ``last_in_module`` after the others, whatever order the tests were named or collected in (a
    stable sort: the rest keep their order, and a file's tests stay together, so its module fixtures start
    once)."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(_file_of(item), i)
    items.sort(key=lambda item: (rank.get(_file_of(item), len(LONG_FILES)), first_seen[_file_of(item)],
                                 item.get_closest_marker("last_in_module") is not None))


def _file_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, timeout: float = 120.0, **client_options) -> None:
    """Until GET /health answers 200 (a server process that is still starting refuses connections). The polls
    share one TLS context (tests/plain_http.py) unless the caller brings its own ``verify``."""
    import httpx

    from tests.plain_http import TLS

    client_options.setdefault("verify", TLS)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url + "/health", **client_options).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{base_url} not healthy within {timeout:g}s")


class ServerThread:
    """A real uvicorn server in a background thread."""

    def __init__(self, app, port: int, config: uvicorn.Config | None = None) -> None:
        import uvicorn

        self.port = port
        self.server = uvicorn.Server(config or uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                              ws_max_size=int(4.5 * (1 << 20))))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@dataclass
class LiveServer:
    engine: AsyncEngine
    port: int

    @property
    def ws_url(self) -> str:
        from spark_server.app import SPARK_WS_PATH

        return f"ws://127.0.0.1:{self.port}{SPARK_WS_PATH}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def spark_http_url(self) -> str:
        from spark_server.app import SPARK_HTTP_PATH

        return self.http_url + SPARK_HTTP_PATH

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no request is running or waiting and no KV block is held."""
        core = self.engine.engine
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if core.num_running == 0 and core.num_waiting == 0 and core.block_manager.num_used_blocks == 0:
                return
            time.sleep(0.05)
        raise AssertionError(f"engine not idle: running={core.num_running} waiting={core.num_waiting} "
                             f"blocks={core.block_manager.num_used_blocks}")


@pytest.fixture(scope="session")
def async_engine() -> Iterator[AsyncEngine]:
    # The weights `spark-server serve` runs by default (the GGUF file's own blocks, bf16 activations): the
    # protocol tests then meet what users meet, and answer 3-4x faster than on fp32 weights (the fp32
    # path keeps its own tests: tests/engine's `llm_engine`, held to transformers' fp32 forward).
    # The per-step grammar-mask budget is tested on engines of its own (tests/engine/test_structured.py);
    # here a loaded 2-core test machine must not make an ordinary grammar's masks count as too costly.
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.constraint_budget import ConstraintBudget

    engine = AsyncEngine.from_config(EngineConfig(max_num_seqs=32, kv_cache_space_gib=0.75,
                                                  constraint_budget=ConstraintBudget(max_step_ms=1000.0)))
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def live_server(async_engine: AsyncEngine) -> Iterator[LiveServer]:
    from spark_server.app import build_app
    from spark_server.settings import Settings

    settings = Settings(port=free_port(), ws_request_timeout=3.0)
    app = build_app(settings, async_engine, owns_engine=False)
    with ServerThread(app, settings.port):
        yield LiveServer(async_engine, settings.port)


@dataclass
class FakeServer:
    """A server on the scripted fake engine (tests/fake_engine.py): no model, milliseconds per request."""

    engine: FakeEngine
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return self.url

    @property
    def ws_url(self) -> str:
        from spark_server.app import SPARK_WS_PATH

        return f"ws://127.0.0.1:{self.port}{SPARK_WS_PATH}"

    @property
    def spark_http_url(self) -> str:
        from spark_server.app import SPARK_HTTP_PATH

        return self.url + SPARK_HTTP_PATH

    def last_request(self):
        assert self.engine.requests, "no request reached the engine"
        return self.engine.requests[-1]

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no scripted answer is still being generated."""
        deadline = time.monotonic() + timeout
        while self.engine.active and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.engine.active == 0, f"{self.engine.active} scripted answers still running"


@contextmanager
def fake_server_with(settings: Settings, engine: FakeEngine | None = None) -> Iterator[FakeServer]:
    """A fake-engine server with these settings (a fresh engine unless one is given), for the test's span."""
    from spark_server.app import build_app
    from tests.fake_engine import FakeEngine

    engine = engine or FakeEngine()
    with ServerThread(build_app(settings, engine, owns_engine=False), settings.port):
        yield FakeServer(engine, settings.port)


@pytest.fixture(scope="session")
def fake_server() -> Iterator[FakeServer]:
    from spark_server.app import build_app
    from spark_server.settings import Settings
    from tests.fake_engine import FakeEngine

    engine = FakeEngine()
    settings = Settings(port=free_port())
    with ServerThread(build_app(settings, engine), settings.port):
        yield FakeServer(engine, settings.port)


@pytest.fixture
def fake(fake_server: FakeServer) -> Iterator[FakeServer]:
    """The shared fake server with a fresh script and request log for this test."""
    from tests.fake_engine import Script

    fake_server.engine.script = Script()
    fake_server.engine.requests.clear()
    yield fake_server
    fake_server.engine.script = Script()


@pytest.fixture(scope="session")
def hf_server(async_engine):
    """A second server on the same engine, in the HF `text_generation` shape (--tgi-compat hf)."""
    from spark_server.app import build_app
    from spark_server.settings import Settings

    settings = Settings(port=free_port(), tgi_compat="hf")
    with ServerThread(build_app(settings, async_engine, owns_engine=False), settings.port):
        yield LiveServer(async_engine, settings.port)
