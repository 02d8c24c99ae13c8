"""A client's constraint is compiled first in a worker process, where a crash or a stall of the grammar
library costs the worker, not the server.

The worker turns a constraint into the library's grammar text, builds a matcher from it and fills its
first token mask (the same calls the server makes), on a thread with the same stack the server's compile
threads get, and answers the grammar text and how much memory the matcher took. The server then builds
its own matcher from that text: the library is deterministic, so what the worker survived within its
deadline the server survives too. A worker that dies or overruns its deadline is replaced.

The wire: one JSON line each way. The first line to the worker is its tokenizer; then one job per line."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from engine.heap import release_freed_memory
from engine.worker_pipe import TIMED_OUT, read_line, start_worker, stop_worker, write_all

# Compile threads, here and in the server, get this much stack: only what a compile touches becomes
# resident, and the depth budget keeps every accepted constraint far inside it.
COMPILE_STACK_BYTES = 256 << 20


class WorkerFailed(Exception):
    """The worker died, overran its deadline or was stopped; the message completes "'<field>' ...".
    ``lasting``: the same constraint would fail again (a crash), unlike a deadline on a busy machine."""

    def __init__(self, reason: str, lasting: bool = True) -> None:
        super().__init__(reason)
        self.lasting = lasting


@dataclass(frozen=True, slots=True)
class Trial:
    grammar: str  # the grammar library's text of the constraint
    nbytes: int  # memory one compiled copy holds (the worker's resident growth while it built one)


def grammar_text(kind: str, value: str, whitespace_pattern: str | None) -> str:
    """The grammar library's text for a constraint; ValueError with the reason for a bad one."""
    import llguidance

    M = llguidance.LLMatcher
    if kind in ("regex", "grammar") and not value.strip():
        raise ValueError("is empty")
    try:
        if kind in ("json", "json_object"):
            schema = json.loads(value) if kind == "json" else {"type": "object"}
            if not isinstance(schema, dict):  # true / false schemas too: the compiler's options need an object
                raise ValueError("a JSON schema must be an object")
            options: Any = {"whitespace_flexible": whitespace_pattern is not None}
            if whitespace_pattern:
                options["whitespace_pattern"] = whitespace_pattern
            return M.grammar_from_json_schema(schema, defaults=options)
        if kind == "regex":
            return M.grammar_from_regex(value)
        if kind == "choice":
            choices = json.loads(value)
            if not choices or not all(isinstance(o, str) and o for o in choices):
                raise ValueError("choices must be a non-empty list of non-empty strings")
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in choices))
        if kind == "grammar":  # Lark as written, or GBNF / xgrammar-style EBNF (root ::= ...) converted
            from llguidance.gbnf_to_lark import any_to_lark

            try:
                lark = any_to_lark(value)
            except Exception as exc:  # GbnfToLarkError, and a bare Exception for a missing root or rule
                raise ValueError(str(exc) or type(exc).__name__) from None
            return M.grammar_from_lark(lark)
        if kind == "structural_tag":
            return _structural_tag(json.loads(value))
    except (ValueError, TypeError, KeyError, AssertionError, RecursionError) as exc:
        raise ValueError(f"cannot be used: {exc}") from None
    raise ValueError(f"has an unknown constraint kind {kind!r}")


def _structural_tag(spec: dict[str, Any]) -> str:
    """vLLM's structural tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]} -> text with
    tagged, schema-constrained segments wherever a trigger starts one."""
    import llguidance

    tags = []
    for s in spec["structures"]:
        trigger = next((t for t in spec.get("triggers", []) if s["begin"].startswith(t)), s["begin"])
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=s.get("schema") or {},
                                         end=s.get("end", "")))
    return llguidance.StructTag.to_grammar(tags, assume_special=False)


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "invalid"


def build_matcher(ll: Any, tokenizer: Any, grammar: str, executor: Any) -> Any:
    """A matcher of ``grammar`` with its first mask filled (the lexer's start state built), or ValueError
    with the library's reason."""
    import llguidance.numpy as lnp  # numpy, not torch: the worker stays small

    matcher = ll.LLMatcher(tokenizer, grammar, log_level=0)
    if not matcher.is_error():
        mask = lnp.allocate_token_bitmask(1, tokenizer.vocab_size)
        lnp.fill_next_token_bitmask_par(executor, [(matcher, 0)], mask)
    if matcher.is_error():
        raise ValueError(f"cannot be used: {first_line(matcher.get_error())}")
    return matcher


def _resident_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _serve() -> None:
    """The worker's loop: tokenizer first, then one job a line until stdin closes."""
    import llguidance

    setup = json.loads(sys.stdin.readline())
    tokenizer = llguidance.LLTokenizer(setup["tokenizer"], n_vocab=setup["n_vocab"], eos_token=setup["eos"])
    executor = llguidance.LLExecutor(1)
    # One compile before the first measured one, so what every compile sets up once is not charged to it.
    run_with_stack(lambda: build_matcher(llguidance, tokenizer, llguidance.LLMatcher.grammar_from_regex("a"),
                                         executor))
    print(json.dumps({"ready": True}), flush=True)

    def work(job: dict[str, Any], answer: dict[str, Any]) -> None:
        try:
            grammar = grammar_text(job["kind"], job["value"], job.get("whitespace_pattern"))
            before = _resident_bytes()
            matcher = build_matcher(llguidance, tokenizer, grammar, executor)
            answer.update(ok=True, grammar=grammar, nbytes=max(0, _resident_bytes() - before))
            del matcher
        except ValueError as exc:
            answer.update(ok=False, error=str(exc))
        except MemoryError:  # the worker's end, not the text's verdict: the server retries it later
            raise
        except Exception as exc:  # the compiler's own failure on this text: the job's answer, not the worker's end
            answer.update(ok=False, error=f"cannot be used: {str(exc) or type(exc).__name__}")

    for line in sys.stdin:
        answer: dict[str, Any] = {}
        run_with_stack(functools.partial(work, json.loads(line), answer))
        release_freed_memory()  # the next job's growth is measured from a heap without this one's leftovers
        print(json.dumps(answer), flush=True)


def start_compile_thread(target: Any, name: str, *args: Any) -> threading.Thread:
    """A started daemon thread with COMPILE_STACK_BYTES of stack (the size is process-wide state while a
    thread is made, hence the lock)."""
    with _STACK_LOCK:
        old = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=target, args=args, name=name, daemon=True)
            thread.start()
        finally:
            threading.stack_size(old)
    return thread


def run_with_stack(work: Any) -> None:
    start_compile_thread(work, "grammar-compile").join()


_STACK_LOCK = threading.Lock()


class GrammarWorker:
    """The server's handle on one worker process, started at the first job and after each failure.
    Owned by one compile thread; only ``stop`` may come from another (a request gone away)."""

    def __init__(self, setup_line: str) -> None:
        self._setup = setup_line
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # starting and closing the process
        self._job_lock = threading.Lock()  # which job the process runs, against a stop meant for another
        self._job: object = None
        self._stopped = False  # ``stop`` killed the process during the current job

    def trial(self, kind: str, value: str, whitespace_pattern: str | None, timeout_s: float,
              job: object = None) -> Trial:
        """Compile in the worker; ValueError for a constraint the library refuses, WorkerFailed when the
        worker dies, is stopped or overruns ``timeout_s``. ``job``: what ``stop`` names to end this one."""
        with self._job_lock:
            self._job, self._stopped = job, False
        try:
            return self._trial(kind, value, whitespace_pattern, timeout_s)
        finally:
            with self._job_lock:
                self._job, stopped = None, self._stopped
            if stopped:  # the kill may land after the answer was read: never hand the next job a dying worker
                self.close()

    def _trial(self, kind: str, value: str, whitespace_pattern: str | None, timeout_s: float) -> Trial:
        proc = self._started()
        line = json.dumps({"kind": kind, "value": value, "whitespace_pattern": whitespace_pattern})
        deadline = time.monotonic() + timeout_s
        try:
            write_all(proc, line.encode() + b"\n", deadline)
        except TimeoutError:
            self.close()
            raise WorkerFailed(f"took longer than {timeout_s:g} s to compile (--constraint-compile-timeout)",
                               lasting=False) from None
        except OSError:
            self.close()
            raise WorkerFailed("could not be compiled: the compiler's worker was gone", lasting=False) from None
        reply = read_line(proc, max(0.0, deadline - time.monotonic()))
        if not isinstance(reply, bytes):
            self.close()
            if reply is TIMED_OUT:
                raise WorkerFailed(f"took longer than {timeout_s:g} s to compile (--constraint-compile-timeout)",
                                   lasting=False)
            raise WorkerFailed("could not be compiled: the compiler failed on it (too complex)")
        answer = json.loads(reply)
        if not answer.get("ok"):
            raise ValueError(answer.get("error") or "could not be compiled")
        return Trial(answer["grammar"], int(answer["nbytes"]))

    def _started(self) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = start_worker("engine.grammar_worker", OMP_NUM_THREADS="1")
                assert self._proc.stdin is not None
                self._proc.stdin.write(self._setup.encode() + b"\n")
                self._proc.stdin.flush()
                ready = read_line(self._proc, 120.0)
                if not isinstance(ready, bytes):
                    self._proc.kill()
                    raise WorkerFailed("could not be compiled: the compiler's worker did not start", lasting=False)
            return self._proc

    def stop(self, job: object) -> None:
        """End the worker if it is still running ``job`` (a request gone away); safe from any thread. The
        compile thread then reads the end and cleans up (``close``); a later job is never hit."""
        with self._job_lock:
            proc = self._proc
            if self._job is job and proc is not None and proc.poll() is None:
                proc.kill()
                self._stopped = True

    def close(self) -> None:
        """Drop the worker process and its pipes; only the compile thread that owns this handle calls it."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            stop_worker(proc)


if __name__ == "__main__":
    _serve()
