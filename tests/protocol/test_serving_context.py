"""The protocols see the server only through the ServingContext: no module of bridges/ reads app.state or
imports the app, and the shared POST /generate parses each body once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import httpx
import pytest

import bridges.common

BRIDGES = Path(bridges.common.__file__).resolve().parent


def _code(path: Path) -> str:
    """The module's source without its docstrings and comments (which may name app.state)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list) or not body:
            continue
        first = body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            body[0] = ast.Pass()
    return ast.unparse(tree)


def test_no_protocol_module_reads_app_state_or_imports_the_app():
    offenders = []
    for path in sorted(BRIDGES.glob("*.py")):
        imported = {alias.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.ImportFrom)}
        if re.search(r"\bapp\.state\b", _code(path)) or any(m.split(".")[0] == "spark_server" for m in imported):
            offenders.append(path.name)
    assert not offenders, f"read the ServingContext instead: {offenders}"


def test_the_checks_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""app.state in a docstring is fine"""\ndef f(request):\n    return request.app.state.engine\n')
    assert re.search(r"\bapp\.state\b", _code(bad))
    fine = tmp_path / "fine.py"
    fine.write_text('"""app.state in a docstring is fine"""\n')
    assert not re.search(r"\bapp\.state\b", _code(fine))


@pytest.mark.parametrize("body", [{"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
                                  {"prompt": "Hi", "max_tokens": 2},
                                  {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}])
def test_the_shared_generate_path_parses_each_body_once(fake, monkeypatch, body):
    calls = []
    parse = bridges.common.parse_body

    def counted(raw, max_items):
        calls.append(raw)
        return parse(raw, max_items)

    monkeypatch.setattr(bridges.common, "parse_body", counted)
    r = httpx.post(fake.url + "/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert len(calls) == 1
