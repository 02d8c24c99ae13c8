"""Writes ``corpus.jsonl``: the fixed corpus of hostile requests, one case a line, each with the code
its protocol documents for it. Run ``python -m tests.fuzz.make_corpus`` after changing the recipes;
the file is committed, and ``test_corpus.py`` replays it against a real server.

A case: ``id``, ``category`` (depth, numbers, surrogates, encoding, syntax, sizes, types, token_ids,
valid), ``target`` (a key of ``TARGETS`` in targets.py), ``body`` (the request text, with ``@0@``,
``@1@``... standing for ``fill[i][0]`` repeated ``fill[i][1]`` times), ``encoding`` (how the text
becomes bytes: utf-8, or a hostile one), ``chunked`` (send without Content-Length) and ``expect``:
``{"spark": code}`` on the WebSocket, ``{"spark": code, "status": s}`` on Spark HTTP, ``{"status": s}``
on a bridge.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.fuzz.targets import TARGETS, Target

HERE = Path(__file__).parent
DEEP = 1000


def _set(body: Any, path: tuple, value: Any) -> Any:
    body = json.loads(json.dumps(body))
    node = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return body


def _text_with(body: Any, path: tuple, marker: str) -> str:
    """The body's JSON with the value at ``path`` replaced by raw text ``marker`` (not a JSON string)."""
    return json.dumps(_set(body, path, "\0MARK\0")).replace('"\\u0000MARK\\u0000"', marker)


def _cases_for(name: str, t: Target) -> list[dict[str, Any]]:
    base, text, number, ids = t.base, t.text_path, t.number_path, t.ids_path
    out: list[dict[str, Any]] = []

    def add(category: str, label: str, body: str, kind: str, **extra: Any) -> None:
        if label in t.skip:
            return
        kind = t.overrides.get(label, kind)
        out.append({"id": f"{name}/{category}/{label}", "category": category, "target": name, "body": body,
                    "expect": t.expect(kind), **extra})

    # syntax and encodings: not JSON, or not UTF-8
    good = json.dumps(base, ensure_ascii=False)
    add("syntax", "empty", "", "syntax")
    add("syntax", "truncated", good[:-1], "syntax")
    add("syntax", "trailing garbage", good + "}", "syntax")
    add("syntax", "single quotes", good.replace('"', "'"), "syntax")
    add("syntax", "NaN literal", _text_with(base, number or text, "NaN"), "syntax")
    add("syntax", "Infinity literal", _text_with(base, number or text, "-Infinity"), "syntax")
    add("encoding", "utf-16", good, "syntax", encoding="utf-16")
    add("encoding", "utf-16-be", good, "syntax", encoding="utf-16-be")
    add("encoding", "utf-32", good, "syntax", encoding="utf-32")
    add("encoding", "latin-1", _text_with(base, text, '"caf\u00e9 \u00ff"'), "syntax", encoding="latin-1")
    add("encoding", "encoded surrogate bytes", _text_with(base, text, '"\udcff"'), "syntax",
        encoding="utf-8-surrogatepass")
    # top level
    for label, value in (("null", "null"), ("array", "[]"), ("number", "1"), ("string", '"hi"')):
        add("types", f"top-level {label}", value, "not_object")
    # depth
    add("depth", f"{DEEP} arrays at the top", '{"deep": @0@@1@}' if name.startswith("spark") else
        _text_with(base, ("zz_deep",), "@0@@1@"), "json_content", fill=[["[", DEEP], ["]", DEEP]])
    add("depth", f"{DEEP} objects in the text field", _text_with(base, text, "@0@ 1 @1@"), "json_content",
        fill=[['{"a":', DEEP], ["}", DEEP]])
    add("depth", "65 arrays in the text field", _text_with(base, text, "@0@@1@"), "json_content",
        fill=[["[", 65], ["]", 65]])
    add("depth", "500 arrays around a 5000-digit integer", _text_with(base, text, "@0@" + "9" * 5000 + "@1@"),
        "json_content", fill=[["[", 500], ["]", 500]])
    add("depth", "100000 arrays", _text_with(base, text, "@0@@1@"), "json_content", fill=[["[", 100000], ["]", 100000]])
    # numbers
    for label, value in (("5000-digit integer", "9" * 5000), ("negative 5000-digit integer", "-" + "9" * 5000),
                         ("1e400", "1e400"), ("-1e400", "-1e400"), ("999999999999", "999999999999"),
                         ("fraction", "1.5"), ("boolean", "true"), ("string", '"2"'), ("null in a list", "[null]")):
        if number is not None:
            add("numbers", label, _text_with(base, number, value), "content")
    # lone surrogates
    for label, value in (("lone high", '"\\ud800"'), ("lone low", '"\\udfff x"'), ("reversed pair", '"\\udc00\\ud800"'),
                         ("high at the end", '"abc\\ud83d"')):
        add("surrogates", label, _text_with(base, text, value), "json_content")
    add("surrogates", "in a key", json.dumps(base)[:-1] + ', "\\ud800": 1}', "json_content")
    # types of the text field
    for label, value in (("number", "123"), ("null", "null"), ("object", "{}"), ("boolean", "false")):
        add("types", f"text field {label}", _text_with(base, text, value), "content")
    add("types", "unknown field", json.dumps(base)[:-1] + ', "no_such_field": 1}', "content")
    # token ids
    if ids is not None:
        for label, value in (("outside the vocabulary", "[1000000000]"), ("negative", "[-1]"), ("huge", "[1e400]"),
                             ("fractional", "[1.5]"), ("5000 digits", "[" + "9" * 5000 + "]")):
            add("token_ids", label, _text_with(base, ids, value), "content")
        add("sizes", "20000 token ids", _text_with(base, ids, "[@0@1]"), "json_content", fill=[["1, ", 20000]])
    # sizes
    add("sizes", "over the body limit", _text_with(base, text, '"@0@"'), "too_large", fill=[["a", 9 << 20]])
    add("sizes", "over the body limit, chunked", _text_with(base, text, '"@0@"'), "too_large",
        fill=[["a", 9 << 20]], chunked=True)
    add("sizes", "over the context, by size", _text_with(base, text, '"@0@"'), "too_long", fill=[["word ", 400000]])
    # valid, to show the rest is refused for a reason
    add("valid", "plain", good, "ok")
    add("valid", "surrogate pair", _text_with(base, text, '"smile \\ud83d\\ude00"'), "ok")
    add("valid", "utf-8 BOM", "\ufeff" + good, "ok")
    return out


def _spark_only() -> list[dict[str, Any]]:
    """Spark's own fields, on both Spark forms."""
    out: list[dict[str, Any]] = []
    recipes: list[tuple[str, str, Callable[[dict], Any], str]] = [
        ("traceId number", "types", lambda b: _set(b, ("header", "traceId"), 5), "content"),
        ("traceId null", "types", lambda b: _set(b, ("header", "traceId"), None), "content"),
        ("traceId list", "types", lambda b: _set(b, ("header", "traceId"), ["a"]), "content"),
        ("traceId object", "types", lambda b: _set(b, ("header", "traceId"), {"a": 1}), "content"),
        ("traceId empty", "types", lambda b: _set(b, ("header", "traceId"), ""), "content"),
        ("traceId too long", "sizes", lambda b: _set(b, ("header", "traceId"), "t" * 257), "content"),
        ("traceId with newline", "valid", lambda b: _set(b, ("header", "traceId"), "x\nsid=FORGED code=0"), "ok"),
        ("header missing", "types", lambda b: {k: v for k, v in b.items() if k != "header"}, "content"),
        ("header a string", "types", lambda b: _set(b, ("header",), "h"), "content"),
        ("text not a list", "types", lambda b: _set(b, ("payload", "message", "text"), "hi"), "content"),
        ("empty text", "types", lambda b: _set(b, ("payload", "message", "text"), []), "no_content"),
        ("last turn assistant", "types", lambda b: _set(b, ("payload", "message", "text", 0, "role"), "assistant"),
         "no_content"),
        ("blank question", "types", lambda b: _set(b, ("payload", "message", "text", 0, "content"), "   "),
         "no_content"),
        ("role unknown", "types", lambda b: _set(b, ("payload", "message", "text", 0, "role"), "robot"), "content"),
        ("role a number", "types", lambda b: _set(b, ("payload", "message", "text", 0, "role"), 1), "content"),
        ("temperature 999999999999", "numbers", lambda b: _set(b, ("parameter", "chat", "temperature"), 999999999999),
         "content"),
        ("top_k 0", "numbers", lambda b: _set(b, ("parameter", "chat", "top_k"), 0), "content"),
        ("max_tokens 5000", "numbers", lambda b: _set(b, ("parameter", "chat", "max_tokens"), 5000), "content"),
        ("punish 0", "numbers", lambda b: _set(b, ("parameter", "chat", "punish"), 0), "content"),
        ("adjustTokens a string", "types", lambda b: _set(b, ("parameter", "chat", "adjustTokens"), "yes"), "content"),
        ("unknown chat field", "types", lambda b: _set(b, ("parameter", "chat", "top_p"), 0.5), "content"),
        ("lora url a number", "types", lambda b: _set(b, ("payload", "lora"), {"url": 1, "md5": "0" * 32}), "content"),
        ("lora md5 short", "types", lambda b: _set(b, ("payload", "lora"), {"url": "http://x/a", "md5": "0"}),
         "content"),
        ("lora without LoRA on", "valid", lambda b: _set(b, ("payload", "lora"), {"url": "http://127.0.0.1:1/a.tar",
                                                                                  "md5": "0" * 32}), "lora_off"),
    ]
    for name in ("spark_ws", "spark_http"):
        t = TARGETS[name]
        for label, category, mutate, kind in recipes:
            out.append({"id": f"{name}/{category}/{label}", "category": category, "target": name,
                        "body": json.dumps(mutate(t.base), ensure_ascii=False), "expect": t.expect(kind)})
        # 10,000 turns: over the history limit; 20,000: over --max-request-items, refused before any work
        turn = '{"role": "user", "content": "hi hi hi"}, '
        for count, kind in ((10000, "too_long"), (20000, "json_content")):
            out.append({"id": f"{name}/sizes/{count} messages", "category": "sizes", "target": name,
                        "body": json.dumps(t.base).replace('"text": [', '"text": [@0@'), "fill": [[turn, count]],
                        "expect": t.expect(kind)})
        # a 4 MB content: refused 10003 from its size, without tokenizing
        out.append({"id": f"{name}/sizes/4 MB content", "category": "sizes", "target": name,
                    "body": _text_with(t.base, t.text_path, '"@0@"'), "fill": [["x", 4 << 20]],
                    "expect": t.expect("too_long")})
        out.append({"id": f"{name}/encoding/binary utf-16 frame" if name == "spark_ws" else
                    f"{name}/encoding/utf-16 with BOM", "category": "encoding", "target": name,
                    "body": json.dumps(t.base), "encoding": "utf-16", "expect": t.expect("syntax")})
    return out


def build() -> list[dict[str, Any]]:
    cases = []
    for name, target in TARGETS.items():
        cases += _cases_for(name, target)
    cases += _spark_only()
    ids = [c["id"] for c in cases]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    return cases


def main() -> None:
    cases = build()
    with open(HERE / "corpus.jsonl", "w", encoding="utf-8") as fh:
        for case in cases:
            fh.write(json.dumps(case, ensure_ascii=True) + "\n")
    print(f"{len(cases)} cases written to {HERE / 'corpus.jsonl'}")


if __name__ == "__main__":
    main()
