"""Request bodies from bytes to JSON values, refusing what would hurt the code behind the schema.

``parse_json`` is the one parser every endpoint uses (Spark frames, Spark HTTP, every bridge):
- bytes must be UTF-8 (a UTF-16 or Latin-1 body is not sniffed and accepted: it is refused);
- ``NaN`` / ``Infinity`` literals are not JSON and are refused;
- nesting deeper than ``MAX_DEPTH`` is refused before any schema sees it (no RecursionError);
- an array or object with more than ``max_items`` entries (3.9 million token ids, 140,000 messages,
  100,000 bad words) is refused before any per-item work (schema validation, tokenizing);
- integers too long for Python's int parser (over 4,300 digits) become +-inf, so the schema refuses
  them by name ("is not of type 'integer'", "is greater than the maximum");
- strings holding a lone UTF-16 surrogate (``"\\ud800"``) are refused, naming the field: they cannot
  be encoded, tokenized or logged.
``SyntaxError_`` maps to Spark 4, ``ContentError`` to Spark 10000; both are HTTP 400.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any

MAX_DEPTH = 64
MAX_ITEMS = 16384
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class JsonBodyError(ValueError):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class JsonSyntaxError(JsonBodyError):
    """Not JSON at all (or not UTF-8)."""


class JsonContentError(JsonBodyError):
    """Valid JSON that no request may hold (too deep, a lone surrogate)."""


def _refuse_constant(name: str) -> Any:
    raise JsonSyntaxError(f"request is not valid JSON: {name} is not a JSON value")


def _huge_int(text: str) -> float:
    try:
        return int(text)
    except ValueError:  # over sys.get_int_max_str_digits(): no field accepts such a number
        return -math.inf if text.startswith("-") else math.inf


def parse_json(raw: str | bytes, max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS) -> Any:
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonSyntaxError(f"request is not valid UTF-8 JSON: {exc}") from None
    raw = raw.removeprefix("\ufeff")
    try:
        value = _loads(raw, max_depth)
    except JsonBodyError:
        raise
    except ValueError as exc:  # an integer over Python's 4,300-digit conversion limit
        if "digits" not in str(exc):
            raise JsonSyntaxError(f"request is not valid JSON: {exc}") from None
        value = _loads(raw, max_depth, parse_int=_huge_int)
    _check_tree(value, max_depth, max_items, surrogates=_SURROGATE_ESCAPE.search(raw) is not None)
    return value


def _loads(raw: str, max_depth: int, **hooks: Any) -> Any:
    try:
        return json.loads(raw, parse_constant=_refuse_constant, **hooks)
    except RecursionError:
        raise JsonContentError(f"$: the request nests deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise JsonSyntaxError(f"request is not valid JSON: {exc}") from None


def _check_tree(value: Any, max_depth: int, max_items: int, surrogates: bool) -> None:
    """Depth, size of every container (checked before its items are looked at), and (only when the
    raw text had surrogate escapes) lone surrogates; iterative."""
    stack: list[tuple[Any, str, int]] = [(value, "$", 0)]
    while stack:
        node, path, depth = stack.pop()
        items: Iterable[tuple[Any, Any]]
        if isinstance(node, dict):
            items = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            if surrogates and isinstance(node, str) and _LONE_SURROGATE.search(node):
                raise JsonContentError(f"{path}: the string holds a lone UTF-16 surrogate (an unpaired \\ud800-"
                                       "\\udfff escape), which is not text")
            continue
        if depth >= max_depth:
            raise JsonContentError(f"{path}: the request nests deeper than {max_depth} levels")
        if len(node) > max_items:
            raise JsonContentError(f"{path}: {len(node)} items; at most {max_items} are accepted in one array or "
                                   "object (--max-request-items)")
        for key, child in items:
            if surrogates and isinstance(key, str) and _LONE_SURROGATE.search(key):
                raise JsonContentError(f"{path}: a key holds a lone UTF-16 surrogate, which is not text")
            if isinstance(child, (dict, list)) or (surrogates and isinstance(child, str)):
                stack.append((child, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}", depth + 1))
