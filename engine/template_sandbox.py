"""A request's own chat template (the ``chat_template`` field), rendered where it cannot hurt the server.

Any client may send one, so its Jinja text is untrusted. Jinja's sandbox (the same immutable sandbox
transformers renders model templates in) keeps it from reaching Python internals, but not from
spending time or memory: nested loops, ``'x' * 10**9``, a string doubled forty times. So it is rendered
in a worker process, with the environment transformers gives model templates (``tojson``,
``raise_exception``, ``strftime_now``, loop controls, the ``{% generation %}`` tag), and bounded:

- the template's size: the request schema's limit (1 MiB);
- time: ``RENDER_TIMEOUT_S`` per render, compile included; a worker past it is killed and replaced;
- memory: the worker's address space may grow ``WORKER_MEMORY_BYTES`` beyond what it holds at start;
  a template that needs more fails with a MemoryError, or the worker dies and is replaced;
- output: at most ``max_chars`` characters (the caller's: more than the context could ever hold);
- the CPU: the workers run at niceness ``WORKER_NICENESS``, so a template that loops for its whole time
  takes a small share of a core the engine's threads want, not half of it (docs/security.md has the
  measurement).

``WORKERS`` processes serve renders; a render that finds them all busy for ``RENDER_TIMEOUT_S`` is
refused as overload, so slow templates hold no serving thread longer than two of their renders. The
model's own template (or the operator's ``--chat-template``) is trusted and rendered in-process by
transformers; only a request's template comes here.

The wire: one JSON line each way per render.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from copy import deepcopy
from datetime import datetime
from functools import lru_cache
from typing import Any

from engine.errors import EngineOverloadedError, InvalidRequestError
from engine.worker_pipe import CLOSED, TIMED_OUT, read_line, start_worker, stop_worker, write_all

RENDER_TIMEOUT_S = 2.0
WORKER_MEMORY_BYTES = 256 << 20
WORKERS = 2
# CFS weighs nice 10 at about a tenth of nice 0: a looping template gets ~10% of a busy core, and a few
# milliseconds of honest rendering still finish far inside RENDER_TIMEOUT_S while the engine is busy.
WORKER_NICENESS = 10
FIELD = "chat_template"
# transformers' way to find where a continued final message ends in the rendered text
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


# ---- the worker --------------------------------------------------------------------------------


def _environment() -> Any:
    """Jinja's immutable sandbox, set up as transformers sets it up for model templates."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-token masks in training templates): here
        its body renders as written."""

        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a set and reads it from the class)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=16)
def _compiled(source: str) -> Any:
    return _environment().from_string(source)


def render_in_worker(source: str, variables: dict[str, Any], max_chars: int) -> str:
    """The worker's render: the output is counted as it is produced and cut off past ``max_chars``."""
    pieces: list[str] = []
    size = 0
    for piece in _compiled(source).generate(**variables):
        size += len(piece)
        if size > max_chars:
            raise ValueError(f"renders more than {max_chars} characters")
        pieces.append(piece)
    return "".join(pieces)


def _limit_memory() -> None:
    import resource

    with open("/proc/self/statm") as fh:
        size = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = size + WORKER_MEMORY_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _serve() -> None:
    try:
        os.nice(WORKER_NICENESS)
    except OSError:  # a platform without priorities: the time bound still holds
        pass
    _environment()  # imports and sets up before the memory limit and the first job
    try:
        _limit_memory()
    except (OSError, ValueError):  # no /proc or no rlimits: the time bound still holds
        pass
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        try:
            answer = {"ok": True, "text": render_in_worker(job["template"], job["variables"], job["max_chars"])}
        except MemoryError:
            answer = {"ok": False, "error": f"needs more than {WORKER_MEMORY_BYTES >> 20} MiB to render"}
        except RecursionError:
            answer = {"ok": False, "error": "nests too deeply"}
        except Exception as exc:  # Jinja's syntax and runtime errors, raise_exception, the sandbox's refusals
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)


# ---- the server's side -------------------------------------------------------------------------


class _Worker:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def started(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = start_worker("engine.template_sandbox")
            if not isinstance(read_line(self.proc, 60.0), bytes):
                self.close()
                raise EngineOverloadedError("request chat templates: the template sandbox did not start")
        return self.proc

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_worker(proc)


class TemplateSandbox:
    """Renders request templates in ``workers`` worker processes, started at first use (thread-safe)."""

    def __init__(self, workers: int = WORKERS, timeout_s: float = RENDER_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._free: list[_Worker] = [_Worker() for _ in range(workers)]
        self._available = threading.Semaphore(workers)
        self._lock = threading.Lock()

    def render(self, source: str, variables: dict[str, Any], max_chars: int) -> str:
        if not self._available.acquire(timeout=self.timeout_s):
            raise EngineOverloadedError("request chat templates: every template sandbox stayed busy; retry later")
        with self._lock:
            worker = self._free.pop()
        try:
            return self._render(worker, source, variables, max_chars)
        finally:
            with self._lock:
                self._free.append(worker)
            self._available.release()

    def _render(self, worker: _Worker, source: str, variables: dict[str, Any], max_chars: int) -> str:
        proc = worker.started()
        job = json.dumps({"template": source, "variables": variables, "max_chars": max_chars})
        deadline = time.monotonic() + self.timeout_s
        try:
            write_all(proc, job.encode() + b"\n", deadline)
            reply = read_line(proc, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            reply = TIMED_OUT
        except OSError:
            reply = CLOSED
        if not isinstance(reply, bytes):
            timed_out = proc.poll() is None
            worker.close()
            reason = (f"took longer than {self.timeout_s:g} s to render" if timed_out else
                      f"could not be rendered (its worker ended: more than {WORKER_MEMORY_BYTES >> 20} MiB?)")
            raise InvalidRequestError(f"'{FIELD}' {reason}", parameter=FIELD)
        answer = json.loads(reply)
        if not answer["ok"]:
            raise InvalidRequestError(f"'{FIELD}' cannot render this conversation: {answer['error']}",
                                      parameter=FIELD)
        return answer["text"]

    def close(self) -> None:
        with self._lock:
            for worker in self._free:
                worker.close()


_shared: TemplateSandbox | None = None
_shared_lock = threading.Lock()


def shared_sandbox() -> TemplateSandbox:
    """The process's one sandbox (its workers start at the first request template)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = TemplateSandbox()
        return _shared


def render_request_template(sandbox: TemplateSandbox, source: str, messages: list[dict[str, Any]], *,
                            special_tokens: dict[str, Any], add_generation_prompt: bool,
                            continue_final_message: bool, tools: list[dict] | None,
                            kwargs: dict[str, Any], max_chars: int) -> str:
    """A request's template over a conversation, with the variables transformers gives templates (the
    tokenizer's special tokens, then the request's chat_template_kwargs over them), and its handling of
    continue_final_message (the text ends where the last message's content ends)."""
    if continue_final_message:
        messages = deepcopy(messages)
        messages[-1]["content"] = str(messages[-1].get("content") or "") + _CONTINUE_TAG
    variables = {**special_tokens, "messages": messages, "tools": tools, "documents": None,
                 "add_generation_prompt": add_generation_prompt, **kwargs}
    try:
        json.dumps(variables)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"'chat_template_kwargs' must be JSON values: {exc}",
                                  parameter="chat_template_kwargs") from None
    text = sandbox.render(source, variables, max_chars)
    if continue_final_message:
        at = text.rfind(_CONTINUE_TAG.strip())
        if at < 0:
            raise InvalidRequestError(f"'{FIELD}' drops the final message, which continue_final_message continues",
                                      parameter=FIELD)
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text


if __name__ == "__main__":
    _serve()
