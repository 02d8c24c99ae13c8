"""The budget of one structured-output constraint, and the checks made before anything compiles it.

A grammar library compiles a client's schema or grammar by recursion: a ``$ref`` chain a few thousand
long, or a chain of rules, overflows a thread's stack and kills the process. So every constraint is
measured here first, by iteration only, and refused with a message naming its field when its source is
too large or its reference chains too deep; what passes is then compiled in a worker process
(``engine/grammar_worker.py``) before the server builds it itself."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from schemas.json_body import JsonBodyError, parse_json


@dataclass(frozen=True, slots=True)
class ConstraintBudget:
    """Limits on one constraint and on the compiled ones kept. Each is one server flag."""

    max_source_bytes: int = 256 << 10  # --max-constraint-kb: the schema / grammar / regex / choices text
    max_depth: int = 128  # --max-constraint-depth: nesting plus reference or rule chains, followed
    compile_timeout_s: float = 10.0  # --constraint-compile-timeout: one compile, in the worker
    max_compiled_bytes: int = 32 << 20  # --max-constraint-compiled-mb: what one compiled grammar holds
    cache_bytes: int = 64 << 20  # --constraint-cache-mb: compiled grammars kept for reuse, in all
    workers: int = 1  # --constraint-compile-workers: compiles at once (each its own worker process)
    max_step_ms: float = 50.0  # --max-constraint-step-ms: one client's grammar masks in one engine step


class ConstraintTooLarge(ValueError):
    """The constraint breaks its budget; the message completes "'<field>' ...". """


def check_constraint(kind: str, value: str, budget: ConstraintBudget) -> None:
    """Refuse, before any compiling, a constraint over the source-size or depth budget."""
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > budget.max_source_bytes:
        raise ConstraintTooLarge(f"is {size:,} bytes; this server compiles at most {budget.max_source_bytes:,} "
                                 "(--max-constraint-kb)")
    if kind in ("json", "choice"):
        depth = json_depth(_parse(value))
    elif kind == "structural_tag":  # each structure's schema resolves its own "#/..." references
        spec = _parse(value)
        structures = spec.get("structures") if isinstance(spec, dict) else None
        schemas = [s["schema"] for s in structures or [] if isinstance(s, dict) and isinstance(s.get("schema"), dict)]
        depth = max([json_depth(spec)] + [json_depth(schema) for schema in schemas])
    elif kind == "grammar":
        depth = max([grammar_depth(value)] + [json_depth(schema) for schema in _embedded_json(value)])
    elif kind == "regex":
        depth = bracket_depth(value)
    else:
        return
    if depth > budget.max_depth:
        raise ConstraintTooLarge(f"nests or chains references {depth:,} levels deep; at most {budget.max_depth} "
                                 "are compiled (--max-constraint-depth)")


def _parse(value: str) -> Any:
    # The text came from inside a request: the same bounded parser as request bodies, deeper nesting
    # allowed (a schema is JSON in JSON) but never enough to exhaust Python's own recursion.
    try:
        return parse_json(value, max_depth=512)
    except JsonBodyError as exc:
        raise ConstraintTooLarge(f"is not valid JSON: {exc}") from None


def json_depth(schema: Any) -> int:
    """The deepest path through a JSON schema, local ``$ref``s followed as if inlined (a cycle counts
    once: compilers tie recursion off rather than unroll it). Iterative; each node measured once."""
    root = schema
    anchors = _anchors(root)
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = _children(node, root, anchors)
        if done:
            on_path.discard(key)
            depth[key] = 1 + max((depth.get(id(c), 0) for c in children), default=0)
            continue
        if key in depth or key in on_path:
            continue
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in depth and id(c) not in on_path)
    return depth.get(id(root), 0)


def _children(node: Any, root: Any, anchors: dict[str, Any]) -> list[Any]:
    if isinstance(node, list):
        return [c for c in node if isinstance(c, (dict, list))]
    if not isinstance(node, dict):
        return []
    kids = [c for c in node.values() if isinstance(c, (dict, list))]
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        fragment = unquote(ref[1:])  # a URI fragment: compilers percent-decode it
        target = _pointer(root, fragment) if fragment.startswith("/") or not fragment else anchors.get(fragment)
        if isinstance(target, (dict, list)):
            kids.append(target)
    return kids


def _anchors(root: Any) -> dict[str, Any]:
    """Every ``$anchor`` (and plain-name ``$id`` fragment) in the schema, by name, found iteratively."""
    found: dict[str, Any] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in ("$anchor", "$dynamicAnchor"):
                if isinstance(node.get(key), str):
                    found.setdefault(node[key], node)
            if isinstance(node.get("$id"), str) and node["$id"].startswith("#"):
                found.setdefault(node["$id"][1:], node)
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return found


def _pointer(root: Any, pointer: str) -> Any:
    """RFC 6901 JSON pointer (the part after ``#``); None where it leads nowhere."""
    node = root
    for part in pointer.split("/")[1:] if pointer else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


_JSON_RULE = re.compile(r"%json\s*")


def _embedded_json(text: str) -> list[Any]:
    """The JSON schemas a Lark grammar embeds with llguidance's ``%json {...}``."""
    decoder = json.JSONDecoder()
    schemas = []
    for m in _JSON_RULE.finditer(text):
        try:
            schemas.append(decoder.raw_decode(text, m.end())[0])
        except RecursionError:
            raise ConstraintTooLarge("embeds a JSON schema nested too deeply to compile "
                                     "(--max-constraint-depth)") from None
        except ValueError:
            continue  # not JSON: the compiler names the error
    return schemas


_RULE_START = re.compile(r"^\s*[?!]?([A-Za-z_][\w.\-]*)(?:\{[^}]*\})?(?:\.-?\d+)?\s*(?:::=|:)", re.MULTILINE)
_LITERALS = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|/(?:[^/\\\n]|\\.)+/[imslux]*'
                       r'|\[(?:[^\]\\\n]|\\.)*\]|(?://|#)[^\n]*')
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")


def grammar_depth(text: str) -> int:
    """The longest chain of rule references in a Lark or GBNF grammar (each rule's bracket nesting
    added), a cycle counted once. Rules are found by their ``name:`` / ``name ::=`` heads."""
    heads = list(_RULE_START.finditer(text))
    bodies: dict[str, str] = {}
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        bodies[m.group(1)] = bodies.get(m.group(1), "") + " " + text[m.end():end]
    refs: dict[str, list[str]] = {}
    own: dict[str, int] = {}
    for name, body in bodies.items():
        bare = _LITERALS.sub(" ", body)
        own[name] = 1 + bracket_depth(bare)
        refs[name] = [r for r in dict.fromkeys(_NAME.findall(bare)) if r in bodies and r != name]
    depth: dict[str, int] = {}
    on_path: set[str] = set()
    for start in bodies:
        stack: list[tuple[str, bool]] = [(start, False)]
        while stack:
            name, done = stack.pop()
            if done:
                on_path.discard(name)
                depth[name] = own[name] + max((depth.get(r, 0) for r in refs[name]), default=0)
                continue
            if name in depth or name in on_path:
                continue
            on_path.add(name)
            stack.append((name, True))
            stack.extend((r, False) for r in refs[name] if r not in depth and r not in on_path)
    return max(depth.values(), default=bracket_depth(text))


def bracket_depth(text: str) -> int:
    """The deepest nesting of (), [] and {} in ``text`` (escaped brackets skipped)."""
    deepest = level = 0
    escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch in "([{":
            level += 1
            deepest = max(deepest, level)
        elif ch in ")]}":
            level = max(0, level - 1)
    return deepest
