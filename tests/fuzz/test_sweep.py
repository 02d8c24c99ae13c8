"""A bounded hypothesis sweep (slow suite, 2,400 cases): random mutations of every endpoint's valid
body (any field replaced by a hostile value: deep nesting, huge or odd numbers, lone surrogates,
wrong types), sent as UTF-8 or in a hostile encoding. Every reply is a documented code, never -1,
HTTP 500 or a hang; afterwards the server is idle and still serving."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridges.errors import SparkCode
from tests.fuzz import corpus
from tests.fuzz.targets import TARGETS
from tests.spark.client import converse, spark_request

pytestmark = pytest.mark.slow

BIG = "@BIG@"  # rendered as a 5,000-digit integer literal (json.dumps refuses to write one)
LENGTH_FIELDS = {"max_tokens", "max_new_tokens", "max_completion_tokens", "min_tokens", "min_new_tokens"}
SPARK_CODES = {int(c) for c in SparkCode} - {int(SparkCode.UNKNOWN)}
HTTP_STATUSES = {200, 400, 404, 413, 422, 429}

scalars = (st.none() | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30)
           | st.floats(allow_nan=False) | st.text(max_size=12)
           | st.sampled_from(["\ud800", "x\udfff", "9" * 5000, BIG, 1e308, -1e308, 0, -1, 10**9, 2.5]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                              max_size=3), max_leaves=8)
deep = st.integers(min_value=60, max_value=3000).map(lambda n: {"$deep": n})


def _short_answers(node: Any) -> None:
    """A mutation may leave a valid, long answer: keep every length at most 8 tokens (no hang by design)."""
    if isinstance(node, dict):
        for key, value in node.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if key in LENGTH_FIELDS and number and value > 8 and float(value).is_integer():
                node[key] = 8
            _short_answers(value)
    elif isinstance(node, list):
        for value in node:
            _short_answers(value)


def _marked(node: Any) -> Any:
    """Deep-nesting markers as placeholder strings (a marker may have been mutated into another)."""
    if isinstance(node, dict):
        if set(node) == {"$deep"}:
            depth = node["$deep"]
            return f"@DEEP{depth if isinstance(depth, int) and not isinstance(depth, bool) else 60}@"
        return {k: _marked(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_marked(v) for v in node]
    return node


def _render(body: Any) -> str:
    _short_answers(body)
    text = json.dumps(_marked(body), ensure_ascii=True).replace(f'"{BIG}"', "9" * 5000)
    # nesting deeper than json.dumps would build
    return re.sub(r'"@DEEP(\d+)@"', lambda m: "[" * int(m.group(1)) + "]" * int(m.group(1)), text)


@st.composite
def cases(draw) -> dict[str, Any]:
    name = draw(st.sampled_from(sorted(TARGETS)))
    body = json.loads(json.dumps(TARGETS[name].base))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        paths = corpus.paths(body)
        new = draw(values | deep)
        if paths and draw(st.booleans()):
            path = draw(st.sampled_from(paths))
            node = body
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = new
        elif isinstance(body, dict):
            body[draw(st.text(max_size=8))] = new
    encoding = draw(st.sampled_from(["utf-8"] * 6 + ["utf-16", "utf-32", "utf-8-surrogatepass"]))
    return {"id": f"sweep/{name}", "target": name, "body": _render(body), "encoding": encoding}


@pytest.fixture(scope="module")
def http():
    with httpx.Client() as client:
        yield client


@settings(max_examples=2400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_random_mutations_get_documented_codes(live_server, http, case):
    reply = corpus.send(live_server.http_url, live_server.ws_url, case, http)
    where = f"{case['id']} {case['body'][:200]!r}: {reply.text[:300]}"
    if reply.status is not None:
        assert reply.status in HTTP_STATUSES, where
    if TARGETS[case["target"]].path.startswith(("ws", "/turing/")) and reply.status != 413:
        assert reply.spark_code in SPARK_CODES, where


def test_idle_and_serving_after_the_sweep(live_server):
    live_server.wait_idle()
    frames = asyncio.run(converse(live_server.ws_url, spark_request("Hi", max_tokens=2, top_k=1)))
    assert frames[-1]["header"]["code"] == 0
