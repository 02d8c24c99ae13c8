"""Large bodies validated in a worker process, so validation never holds the serving process's GIL.

Validating a large body is pure Python, linear in its messages and content blocks: a body of tens of
thousands of them takes a good fraction of a second. On a thread of the serving process that work holds the
GIL against the engine's thread and the event loop, so clients sending such bodies in a loop slowed other
clients' streams many times over (docs/security.md has the measurement). Here the parsed body goes as one
JSON line to a worker process (schemas/off_process.py, at a lower CPU priority, like the chat-template
sandbox), which answers with the first violation or none; the serving process's validation thread
(schemas.off_loop) waits on the pipe without the GIL. The wire: one JSON line each way per body. Valid
bodies no longer come here: the compiled validator clears them in the serving process in milliseconds
(schemas.is_valid), so the worker judges only bodies that break a rule, and says which.
"""

from __future__ import annotations

import json
import logging
import subprocess
import threading
import time
from typing import Any

import schemas
from engine.worker_pipe import read_line, start_worker, stop_worker, write_all

logger = logging.getLogger(__name__)

# A body the worker has not judged in this long is refused (and the worker replaced): validation is linear
# in the body, and the largest body takes seconds; judging it again on the serving process's thread would
# hold the GIL for as long.
ANSWER_TIMEOUT_S = 60.0

Violation = tuple[str, list[str | int]]  # schemas.describe's message, the offending field's path


class SchemaWorker:
    """One worker process, started on first use and again after it dies; one body at a time (its callers
    are the one validation thread, schemas.off_loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def first_violation(self, name: str, instance: Any) -> Violation | None:
        """The instance's first violation of schema ``name``, found in the worker. Where no worker can be
        started here, found on this thread; where the worker ends or hangs on this body, the body is refused
        (judging it here would hold the GIL for as long). A valid body is cleared here first by the compiled
        validator (``schemas.is_valid``: milliseconds, where jsonschema takes seconds); only a body it
        refuses goes to the worker, for jsonschema's verdict and message."""
        if schemas.is_valid(name, instance):
            return None
        line = json.dumps({"schema": name, "body": instance}, ensure_ascii=False).encode() + b"\n"
        with self._lock:
            try:
                proc = self._started()
            except OSError as exc:
                logger.warning("body validation worker unavailable (%s): validating on a thread", exc)
                self._close()
                proc = None
            if proc is not None:
                try:
                    deadline = time.monotonic() + ANSWER_TIMEOUT_S
                    write_all(proc, line, deadline)
                    reply = read_line(proc, max(0.0, deadline - time.monotonic()))
                    if isinstance(reply, bytes):
                        answer = json.loads(reply)["violation"]
                        return None if answer is None else (answer[0], answer[1])
                    why = "it ended" if proc.poll() is not None else f"no answer in {ANSWER_TIMEOUT_S:g} s"
                except TimeoutError:
                    why = f"no answer in {ANSWER_TIMEOUT_S:g} s"
                except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
                    why = str(exc) or type(exc).__name__
                logger.warning("body validation worker failed on a body (%s): refused, worker replaced", why)
                self._close()
                return "request body could not be validated (too large or too complex to check)", []
        error = schemas.first_error(name, instance)
        return None if error is None else (schemas.describe(error), list(error.absolute_path))

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._close()  # a worker that ended: its pipes closed
            self._proc = start_worker("schemas.off_process")
            if not isinstance(read_line(self._proc, ANSWER_TIMEOUT_S), bytes):
                raise OSError("the worker did not start")
        return self._proc

    def _close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_worker(proc)

    def close(self) -> None:
        with self._lock:
            self._close()


_SHARED = SchemaWorker()


def shared_worker() -> SchemaWorker:
    return _SHARED

