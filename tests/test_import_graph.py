"""Folder imports flow one way: the app (spark_server) -> the protocols (bridges) -> the LoRA store and
the fleet client -> the engine -> the schemas. Every import statement of every module in our packages
is read (ast: module level and inside functions alike) and checked against ``ALLOWED``; the folder
graph the imports draw must have no cycle. Restructuring moves code between folders: update the two
tables below in the same change, and the test says which import broke the flow and where."""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Each folder of ours and the folders it may import (itself always). A folder missing here fails the
# test: a new top-level package must take its place in the flow.
ALLOWED: dict[str, set[str]] = {
    "spark_server": {"bridges", "lora_store", "fleet", "engine", "schemas"},  # the app
    "bridges": {"lora_store", "fleet", "engine", "schemas"},  # the protocols
    "lora_store": {"engine", "schemas"},
    "fleet": {"engine", "schemas"},  # the fleet client (--engine-url)
    "engine": {"schemas"},
    "schemas": set(),
}

# Imports against the flow that exist and are still to be moved: "file -> imported module": why. An
# entry that no longer matches an import fails the test, so this list only shrinks.
KNOWN_UPWARD: dict[str, str] = {}


def our_folders() -> set[str]:
    """The top-level packages pyproject installs."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    return {name.split(".")[0] for name in packages}


def imports(folders: set[str]) -> list[tuple[str, str, int, str]]:
    """(importing folder, imported folder, line, "file -> module") for every absolute import between
    two different folders of ours."""
    found = []
    for folder in sorted(folders):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue  # relative imports stay inside their own folder
                for module in modules:
                    target = module.split(".")[0]
                    if target in folders and target != folder:
                        found.append((folder, target, node.lineno, f"{rel} -> {module}"))
    return found


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle in the folder graph, as the folders along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_every_folder_has_its_place_in_the_flow():
    assert our_folders() == set(ALLOWED), "add the new folder to ALLOWED (and remove a gone one)"
    assert cycle(ALLOWED) is None, "ALLOWED itself must be one-way"


def test_no_folder_imports_against_the_flow():
    found = imports(set(ALLOWED))
    upward = sorted(f"{where}:{line}" for src, dst, line, where in found
                    if dst not in ALLOWED[src] and where not in KNOWN_UPWARD)
    assert not upward, "imports against the flow (app -> protocols -> lora_store, fleet -> engine -> " \
                       "schemas):\n" + "\n".join(upward)
    stale = set(KNOWN_UPWARD) - {where for *_, where in found}
    assert not stale, f"KNOWN_UPWARD entries that no longer exist (remove them): {sorted(stale)}"


def test_the_folder_graph_has_no_cycle():
    edges: dict[str, set[str]] = defaultdict(set)
    for src, dst, _, _ in imports(set(ALLOWED)):
        edges[src].add(dst)
    assert cycle(edges) is None, f"folders import each other: {' -> '.join(cycle(edges) or [])}"


def test_the_checks_can_fail():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
