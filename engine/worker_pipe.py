"""Reading a worker process's one-line JSON replies with a deadline (the grammar and template workers)."""

from __future__ import annotations

import os
import select
import subprocess
import time

CLOSED, TIMED_OUT = object(), object()  # why no line came from a worker


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
