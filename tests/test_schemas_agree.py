"""The compiled validator (jsonschema-rs) that clears valid bodies fast never accepts a body jsonschema
refuses: across every schema, for each endpoint's valid body, the fuzz corpus, and random mutations of
them. (Where it is stricter, jsonschema judges again: schemas.first_error.)"""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import schemas
from tests.fuzz import corpus
from tests.fuzz.targets import TARGETS

NAMES = schemas.available()

# values at the edges where two validators could differ: integral floats, booleans as numbers, huge and
# negative numbers, empty and newline-ended strings (a pattern's "$"), containers of the wrong kind
EDGES = [None, True, False, 0, -1, 1, 1.0, 1.5, -0.0, 2**53 + 1, 10**30, -(10**30), 1e308, "", "a", "abc\n",
         "a" * 65, "0123456789abcdef0123456789abcdef", "0123456789abcdef0123456789abcdef\n", "user",
         "assistant", "system", "text", [], {}, [1], {"type": "text", "text": "x"}, ["x"],
         float("inf"), float("-inf")]  # the body parser reads 1e400 as infinity
edges = st.sampled_from(EDGES) | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
values = st.recursive(edges, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(["type", "text", "role", "content", "x"]), inner, max_size=3),
                      max_leaves=6)


def _disagreements(body: Any) -> list[str]:
    return [name for name in NAMES if schemas.is_valid(name, body) and not schemas.validator(name).is_valid(body)]


def test_every_endpoints_valid_body_is_cleared_by_the_compiled_validator():
    for name, target in TARGETS.items():
        accepted = [n for n in NAMES if schemas.is_valid(n, target.base)]
        assert accepted, name  # each endpoint's body is valid against its schema, and judged fast
        assert not _disagreements(target.base), name


def test_the_corpus_bodies_are_never_accepted_where_jsonschema_refuses():
    checked = 0
    for case in corpus.load():
        if case.get("fill") or case.get("encoding", "utf-8") != "utf-8":
            continue
        try:
            body = json.loads(case["body"])
        except ValueError:
            continue
        if isinstance(body, dict):
            assert not _disagreements(body), case["id"]
            checked += 1
    assert checked > 100


@st.composite
def mutated(draw) -> Any:
    body = json.loads(json.dumps(draw(st.sampled_from([t.base for t in TARGETS.values()]))))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        paths = corpus.paths(body)
        path = draw(st.sampled_from(paths)) if paths else ()
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if action == "replace" and path:
            parent[path[-1]] = copy.deepcopy(draw(values))  # EDGES' containers stay as they are
        elif action == "delete" and path and isinstance(parent, dict):
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.sampled_from(["x", "type", "extra_body", "logprobs", "n"]))] = copy.deepcopy(draw(values))
    return body


def test_random_mutations_are_never_accepted_where_jsonschema_refuses():
    @settings(max_examples=800, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=mutated())
    def check(body: Any) -> None:
        assert not _disagreements(body), json.dumps(body)[:300]

    check()


def test_a_valid_body_never_reaches_jsonschema(monkeypatch):
    blocks = [{"type": "text", "text": "hi"} for _ in range(20_000)]
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": blocks}]}

    def refuse(name: str) -> Any:
        raise AssertionError(f"jsonschema was asked about a valid body ({name})")

    monkeypatch.setattr(schemas, "validator", refuse)
    assert schemas.first_error("anthropic-messages", body) is None


def test_a_pattern_ends_at_the_end_of_the_string_for_both_validators():
    # Python's "$" also matches before a trailing newline; the schemas' patterns mean the end (ECMA-262)
    tool = {"name": "a" * 64 + "\n", "input_schema": {"type": "object"}}
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    assert not schemas.is_valid("anthropic-messages", body)
    error = schemas.first_error("anthropic-messages", body)
    assert error is not None and list(error.absolute_path) == ["tools", 0, "name"]
    tool["name"] = "a" * 64
    assert schemas.first_error("anthropic-messages", body) is None
