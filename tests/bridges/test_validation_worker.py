"""Large bodies are validated in a worker process (bridges/validation_worker.py): the same verdicts as the
serving process's own check, none of its GIL, and the serving process's thread where the worker fails."""

from __future__ import annotations

import asyncio
import os

import pytest

import schemas
from bridges.common import check, checked_body
from bridges.errors import BridgeError
from bridges.validation_worker import SchemaWorker, shared_worker
from schemas.off_process import WORKER_NICENESS

MESSAGES = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i}"} for i in range(3000)]


def large(**fields):
    return {"model": "m", "messages": MESSAGES, "max_tokens": 4, **fields}


def verdict(body) -> tuple[str, str | None] | None:
    try:
        check("openai-chat", body)
    except BridgeError as exc:
        return exc.message, exc.param
    return None


@pytest.mark.parametrize("fields", [{}, {"max_tokens": -5}, {"temperature": "hot"}, {"stray": 1}],
                         ids=["valid", "bad-number", "bad-type", "unknown-field"])
def test_the_worker_judges_as_the_serving_process_does(fields, monkeypatch):
    body = large(**fields)
    expected = verdict(body)
    monkeypatch.setattr(schemas, "first_error", lambda *a: pytest.fail("validated in the serving process"))
    try:
        assert asyncio.run(checked_body(body, "openai-chat", large=True)) is body
        got = None
    except BridgeError as exc:
        got = exc.message, exc.param
    assert got == expected and (expected is None) == (fields == {})


def test_the_worker_runs_below_the_engines_priority():
    worker = shared_worker()
    assert worker.first_violation("openai-chat", large()) is None
    proc = worker._proc
    assert proc is not None and proc.poll() is None and proc.pid != os.getpid()
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, proc.pid) == min(19, own + WORKER_NICENESS)


def test_a_worker_that_cannot_start_or_dies_leaves_the_check_to_this_process(monkeypatch):
    """No worker here: this thread checks. A worker gone between bodies: a fresh one takes the next. A worker
    that hangs on a body: that body is refused (checking it here would hold the GIL as long) and the worker
    replaced."""
    import signal

    import bridges.validation_worker as module

    worker = SchemaWorker()
    try:
        assert worker.first_violation("openai-chat", large(messages=[{"role": "user", "content": "天気 ✓"}])) is None
        assert worker.first_violation("openai-chat", large(max_tokens=-5))[1] == ["max_tokens"]
        dead = worker._proc
        dead.kill()  # died between bodies: a fresh worker takes the next
        dead.wait()
        assert worker.first_violation("openai-chat", large(max_tokens=-5))[1] == ["max_tokens"]
        assert worker._proc is not None and worker._proc.pid != dead.pid
        hung = worker._proc
        os.kill(hung.pid, signal.SIGSTOP)
        monkeypatch.setattr(module, "ANSWER_TIMEOUT_S", 0.5)
        assert worker.first_violation("openai-chat", large()) is None  # a valid body is cleared here
        message, path = worker.first_violation("openai-chat", large(max_tokens=-5))
        assert "could not be validated" in message and path == [] and worker._proc is None and hung.poll() is not None
        monkeypatch.setattr(SchemaWorker, "_started", lambda self: (_ for _ in ()).throw(OSError("no processes")))
        assert worker.first_violation("openai-chat", large(stray=1)) is not None
        assert worker.first_violation("openai-chat", large()) is None
    finally:
        worker.close()


def test_a_job_a_worker_does_not_read_times_out_at_its_deadline():
    import subprocess
    import sys
    import time

    from engine.worker_pipe import write_all

    # a process that never reads its stdin: the pipe fills and a plain write would block for good
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            write_all(proc, b"x" * (8 << 20), started + 0.5)
        assert time.monotonic() - started < 5
    finally:
        proc.kill()
        proc.wait()
