"""schemathesis against the published /openapi.json: no generated request gets a 5xx.

Driven through each operation's hypothesis strategy (schemathesis' pytest plugin does not run
under this pytest version)."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from spark_server.app import build_app  # noqa: E402
from spark_server.settings import Settings  # noqa: E402
from tests.conftest import ServerThread, free_port  # noqa: E402


@pytest.fixture(scope="module")
def schema(async_engine):
    # A generated body may validly ask for millions of tokens: with a short deadline it ends with
    # the documented timeout (504), which is not a server error here. 0.2 s still lets the examples that
    # answer 200 at 0.3 s answer 200 (the same answers, up to one example that was at the edge at 0.3 s).
    old = async_engine.limits.default_timeout_s
    settings_ = Settings(port=free_port(), request_timeout=0.2)
    with ServerThread(build_app(settings_, async_engine, owns_engine=False), settings_.port):
        yield schemathesis.openapi.from_url(f"http://127.0.0.1:{settings_.port}/openapi.json")
    async_engine.limits.default_timeout_s = old


@pytest.mark.timeout(240, method="thread")  # a hang fails here, with every thread's stack, not the whole run
def test_no_generated_request_gets_a_server_error(schema):
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 18
    for operation in operations:
        @given(case=operation.as_strategy())
        # derandomized: the same examples every run, so CI is reproducible (random runs: drop it locally)
        @settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  derandomize=True)
        def check(case):
            response = case.call(timeout=30)
            if response.status_code == 504:
                assert "timed out" in response.text  # the deadline, reported as documented
                return
            case.validate_response(response, checks=[not_a_server_error])

        check()
