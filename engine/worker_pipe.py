"""The project's worker processes (grammar compiles, request templates, body validation): starting one, and
writing its jobs and reading its one-line JSON replies, each by a deadline."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

CLOSED, TIMED_OUT = object(), object()  # why no line came from a worker
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_worker(module: str, **env: str) -> subprocess.Popen[bytes]:
    """``python -m module`` from the project's root (importable whether or not the project is installed),
    its stdin and stdout piped; ``env``: variables set for it beside the server's own."""
    environ = {**os.environ, **env}
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (PROJECT_ROOT, environ.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            cwd=PROJECT_ROOT, env=environ)


def read_line(proc: subprocess.Popen[bytes], timeout_s: float) -> bytes | object:
    """One line from the worker, or CLOSED (it ended) or TIMED_OUT (``timeout_s`` passed first)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return TIMED_OUT
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return CLOSED
        chunks.append(chunk)
        if chunk.endswith(b"\n"):
            return b"".join(chunks)


def write_all(proc: subprocess.Popen[bytes], data: bytes, deadline: float) -> None:
    """All of ``data`` to the worker's stdin by ``deadline`` (``time.monotonic``), else TimeoutError. A worker
    that stopped reading fills the pipe, and a plain write would then block past any deadline."""
    assert proc.stdin is not None
    fd = proc.stdin.fileno()
    os.set_blocking(fd, False)
    view = memoryview(data)
    while view:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([], [fd], [], left)[1]:
            raise TimeoutError("the worker did not take the job in time")
        try:
            view = view[os.write(fd, view[:1 << 16]):]
        except BlockingIOError:
            continue


def stop_worker(proc: subprocess.Popen[bytes]) -> None:
    """Kill the worker if it still runs, reap it, and close the server's ends of its pipes (a worker is
    replaced many times over a server's life: each one left open would hold two descriptors)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:  # unflushed bytes to a worker that is gone
                pass
