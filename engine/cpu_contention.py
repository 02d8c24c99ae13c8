"""Whether this process's threads waited for a CPU over a stretch of wall time.

A kernel timing taken while another process computes on the same cores is not the kernel's own. Worse than
noise, it can be consistently wrong: two threads of a parallel kernel that wait for each other at a barrier,
one of them descheduled in favour of a neighbour's spinning thread, lose a whole scheduler tick (4 ms at
250 Hz) on every call, so the best of many samples is still a tick. Start-up's kernel probes are kept for
later starts (engine/models/tuning.py); a measurement taken while the probes' threads queued for a CPU must
not be.

The reading, ``share``: of the time this process's threads wanted a CPU (ran or stood runnable in a queue),
the share they spent waiting for one, from each thread's scheduler statistics (/proc/self/task/*/schedstat:
run time and run-queue delay in nanoseconds). It covers exactly the cores the threads could run on and the
moments they wanted them: load on other cores of a large host does not count, nor does a neighbour that
waits for I/O. It also counts waiting behind this process's own threads where they outnumber the cores.
A thread that ended before the reading is not in it. Where the kernel keeps no such statistics (no
CONFIG_SCHED_INFO; not Linux) the reading is unknown.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

TASKS = Path("/proc/self/task")
# A quiet machine still preempts a thread now and then for a tick or two (a daemon, a timer): such a wait in
# a 12 ms window read 37% here once. A neighbour that stalls every sample of a best-of timing costs a tick a
# call, ~0.1 s a round of the path probe; less waiting than this in all is not called contention.
MIN_WAIT_S = 0.02


def _thread_times() -> dict[str, tuple[int, int]] | None:
    """(nanoseconds run, nanoseconds waited in a run queue) of each of this process's threads, by thread id;
    None where the kernel keeps no scheduler statistics."""
    times: dict[str, tuple[int, int]] = {}
    try:
        tids = os.listdir(TASKS)
    except OSError:
        return None
    for tid in tids:
        try:
            fields = (TASKS / tid / "schedstat").read_text().split()
            times[tid] = (int(fields[0]), int(fields[1]))
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    if not times or all(run == 0 for run, _ in times.values()):
        return None  # statistics not kept: every field reads zero
    return times


@dataclass
class CpuContention:
    """A context manager: on exit (or at ``read``), ``share`` is the reading for the time since entry (None
    where unknown) and ``seconds`` that time."""

    share: float | None = None
    seconds: float = 0.0
    waited_s: float = 0.0  # the threads' waiting, summed
    ran_s: float = 0.0  # and their running

    def __enter__(self) -> CpuContention:
        self._start = (time.perf_counter(), _thread_times())
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.read()

    def read(self) -> CpuContention:
        """Sets the reading for the time from entry until now; returns self."""
        wall0, before = self._start
        after = _thread_times()
        self.seconds = time.perf_counter() - wall0
        if before is None or after is None:
            return self
        ran = waited = 0
        for tid, (run, delay) in after.items():
            run0, delay0 = before.get(tid, (0, 0))  # a thread started since: all of its time is in the window
            ran, waited = ran + run - run0, waited + delay - delay0
        self.share = waited / (ran + waited) if ran + waited > 0 else 0.0
        self.waited_s, self.ran_s = waited / 1e9, ran / 1e9
        return self

    def busy(self, limit: float, at_least_s: float = MIN_WAIT_S) -> bool:
        """Whether the threads waited for a CPU more than ``limit`` of the time they wanted one, and at least
        ``at_least_s`` in all (False where unknown)."""
        return self.share is not None and self.share > limit and self.waited_s >= at_least_s
