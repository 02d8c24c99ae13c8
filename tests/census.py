"""Which tests need the real model, and how long each file holds its worker: a pytest plugin, off unless asked.

    .venv/bin/python -m pytest -p tests.census --census=census.json [the usual options]

A test needs the real model when the embedded model is loaded (an engine built on it, or transformers'
reference of it) or a server process is started on it while the test or any fixture in its closure is set
up or runs. Session- and module-scoped fixtures load once, so a fixture that loaded the model marks every
test whose closure holds it. Models the tests make for themselves (tests/tiny_checkpoints.py, a GGUF written
to a temporary folder) are counted apart, as "own model". The report also gives, per xdist worker, the wall
time each test file held it (first setup to last teardown), which is what `--dist` has to balance.
"""

from __future__ import annotations

import functools
import json
import subprocess
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REAL, OWN = "real", "own"


def _model_kind(model: Any) -> str:
    """REAL for the embedded model (None, its names, its GGUF file or its converted folder), else OWN."""
    from engine.model_loader import EMBEDDED_MODEL_NAME, embedded_gguf_path, resolve_model_dir

    if model is None or str(model) in ("", "embedded", EMBEDDED_MODEL_NAME):
        return REAL
    try:
        path = Path(str(model)).expanduser().resolve()
        if path == embedded_gguf_path().resolve() or path == resolve_model_dir(None).resolve():
            return REAL
    except (OSError, FileNotFoundError):
        pass
    return OWN


def _server_model(argv: list[str]) -> str | None:
    """The kind of model a `spark_server serve` / `spark-server serve` command line loads; None if not one."""
    words = [str(a) for a in argv]
    if "serve" not in words or not any("spark_server" in w or "spark-server" in w for w in words):
        return None
    if "--help" in words or "-h" in words or "--engine-url" in words:
        return None  # a help text, or a front end whose engine is another server
    model = words[words.index("--model") + 1] if "--model" in words[:-1] else None
    return _model_kind(model)


class Census:
    def __init__(self) -> None:
        self.events: dict[str, int] = {REAL: 0, OWN: 0}
        self.fixtures: dict[tuple[str, str], set[str]] = {}  # (baseid, name) -> kinds it loaded
        self.tests: dict[str, set[str]] = defaultdict(set)  # nodeid -> kinds it loaded itself
        self.closure: dict[str, list[tuple[str, str]]] = {}
        self.spans: dict[str, list[float]] = {}  # file -> [first start, last end]
        self.started = time.monotonic()

    def record(self, kind: str) -> None:
        self.events[kind] += 1

    @staticmethod
    def diff(before: dict[str, int], after: dict[str, int]) -> set[str]:
        return {k for k in after if after[k] > before[k]}

    def install(self) -> None:
        """Wrap the places a model is loaded: the engine's loader (engine.loader.load, also under the name
        llm_engine imported it by), transformers' from_pretrained, and a server process started with subprocess."""
        from engine import llm_engine, loader

        census = self
        real_load = loader.load

        @functools.wraps(real_load)
        def counted_load(config: Any) -> Any:
            census.record(_model_kind(getattr(config, "model", None)))
            return real_load(config)

        loader.load = counted_load  # a counting wrapper of the same signature
        llm_engine.load = counted_load

        popen_init = subprocess.Popen.__init__

        @functools.wraps(popen_init)
        def counted_popen_init(proc: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
            argv = [str(a) for a in ([args] if isinstance(args, str | bytes) else args)]
            if len(argv) == 1:
                argv = argv[0].split()
            kind = _server_model(argv)
            if kind is not None:
                census.record(kind)
            popen_init(proc, args, *rest, **kwargs)

        setattr(subprocess.Popen, "__init__", counted_popen_init)  # noqa: B010 (a method swapped in)

        try:
            from transformers import AutoModelForCausalLM
        except ImportError:
            return
        from_pretrained = AutoModelForCausalLM.from_pretrained.__func__

        @functools.wraps(from_pretrained)
        def counted_from_pretrained(cls: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
            census.record(_model_kind(path))
            return from_pretrained(cls, path, *args, **kwargs)

        AutoModelForCausalLM.from_pretrained = classmethod(counted_from_pretrained)

    def report(self) -> dict[str, Any]:
        tests = {}
        for nodeid, closure in self.closure.items():
            kinds = set(self.tests.get(nodeid, set()))
            for key in closure:
                kinds |= self.fixtures.get(key, set())
            tests[nodeid] = sorted(kinds)
        spans = {f: round(end - start, 2) for f, (start, end) in self.spans.items()}
        return {"tests": tests, "files": spans, "elapsed": round(time.monotonic() - self.started, 2)}


_CENSUS = pytest.StashKey[Census]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--census", metavar="PATH", help="write which tests need the real model to PATH (JSON)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("census"):
        census = Census()
        config.stash[_CENSUS] = census
        if hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist") \
                or not getattr(config.option, "numprocesses", None):
            census.install()
        config.census_workers = {}  # type: ignore[attr-defined]


def _census(config: pytest.Config) -> Census | None:
    return config.stash.get(_CENSUS, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> Iterator[None]:
    census = _census(request.config)
    before = dict(census.events) if census else None
    yield
    if census and before is not None:
        kinds = census.diff(before, census.events)
        if kinds:
            census.fixtures.setdefault((fixturedef.baseid, fixturedef.argname), set()).update(kinds)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    census = _census(item.config)
    if census is None:
        yield
        return
    start = time.monotonic()
    before = dict(census.events)
    yield
    census.tests[item.nodeid] |= census.diff(before, census.events)
    info = getattr(item, "_fixtureinfo", None)
    closure: list[tuple[str, str]] = []
    if info is not None:
        for name in getattr(item, "fixturenames", ()):
            defs = info.name2fixturedefs.get(name)
            if defs:
                closure.extend((d.baseid, d.argname) for d in defs)
    census.closure[item.nodeid] = closure
    span = census.spans.setdefault(item.nodeid.split("::")[0], [start, start])
    span[1] = time.monotonic()


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    census = _census(config)
    if census is None:
        return
    if hasattr(config, "workerinput"):
        config.workeroutput["census"] = json.dumps(census.report())  # type: ignore[attr-defined]
        return
    workers = getattr(config, "census_workers", {})
    reports = workers or {"main": census.report()}
    tests: dict[str, list[str]] = {}
    for report in reports.values():
        tests.update(report["tests"])
    summary = {
        "functions": _functions(tests),
        "workers": {w: {"elapsed": r["elapsed"], "files": dict(sorted(r["files"].items(), key=lambda kv: -kv[1]))}
                    for w, r in reports.items()},
        "tests": tests,
    }
    Path(config.getoption("census")).write_text(json.dumps(summary, indent=1))


def _functions(tests: dict[str, list[str]]) -> dict[str, Any]:
    """Test functions (parametrized cases folded into their function) by what they need: a function needs the
    real model if any of its cases does."""
    functions: dict[str, set[str]] = defaultdict(set)
    for nodeid, kinds in tests.items():
        functions[nodeid.split("[")[0]] |= set(kinds)
    real = sorted(f for f, k in functions.items() if REAL in k)
    own = sorted(f for f, k in functions.items() if OWN in k and REAL not in k)
    return {"total": len(functions), "real": len(real), "own_model_only": len(own),
            "real_ratio": round(len(real) / max(1, len(functions)), 3), "real_list": real}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    out = getattr(node, "workeroutput", {}).get("census")
    if out:
        workers = node.config.census_workers
        workers[node.gateway.id] = json.loads(out)
