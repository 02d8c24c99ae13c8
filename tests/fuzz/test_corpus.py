"""The fixed corpus of hostile requests (tests/fuzz/corpus.jsonl) against a real server: every case
gets the code its protocol documents, never -1, HTTP 500 or a hang; afterwards the server is idle
(no sequence running or waiting, no KV block held) and a normal session still succeeds."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from tests.fuzz import corpus
from tests.spark.client import converse, spark_request

CASES = corpus.load()


def test_the_corpus_covers_every_category_on_every_endpoint():
    assert len(CASES) >= 300
    by_target = Counter(c["target"] for c in CASES)
    categories = {c["category"] for c in CASES}
    assert {"depth", "numbers", "surrogates", "encoding", "syntax", "sizes", "types", "token_ids"} <= categories
    from tests.fuzz.targets import TARGETS
    assert set(by_target) == set(TARGETS)


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client() as client:
        yield client


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_case(live_server, http, case):
    reply = corpus.send(live_server.http_url, live_server.ws_url, case, http)
    corpus.check(case, reply)


def test_the_server_is_idle_and_serving_after_the_corpus(live_server):
    live_server.wait_idle()
    frames = asyncio.run(converse(live_server.ws_url, spark_request("Hi", max_tokens=2, top_k=1)))
    assert frames[-1]["header"]["code"] == 0
    metrics = httpx.get(live_server.http_url + "/metrics").text
    for gauge in ("spark:num_requests_running", "spark:num_requests_waiting"):
        line = next(x for x in metrics.splitlines() if x.startswith((gauge + " ", gauge + "{")))
        assert float(line.split()[-1]) == 0.0, line
