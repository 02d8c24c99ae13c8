"""Whether this process's threads waited for a CPU over a stretch of wall time.

A kernel timing taken while another process computes on the same cores is not the kernel's own. Worse than
noise, it can be consistently wrong: two threads of a parallel kernel that wait for each other at a barrier,
one of them descheduled in favour of a neighbour's spinning thread, lose a whole scheduler tick (4 ms at
250 Hz) on every call, so the best of many samples is still a tick. Start-up's kernel probes are kept for
later starts (engine/models/tuning.py); a measurement taken while the probes' threads queued for a CPU must
not be.

The reading, ``share``: of the time a thread of this process wanted a CPU (ran or stood runnable in a
queue), the share it spent waiting for one, for the thread that waited most (``worst_share``), from each
thread's scheduler statistics (/proc/self/task/*/schedstat: run time and run-queue delay in nanoseconds). It
covers exactly the cores the threads could run on and the moments they wanted them: load on other cores of a
large host does not count, nor does a neighbour that waits for I/O. It also counts waiting behind this
process's own threads where they outnumber the cores. A thread that ended before the reading is not in it. A
CPU quota below the thread count (a container's --cpus) shows as waiting too. Where the kernel keeps no such
statistics (no CONFIG_SCHED_INFO; not Linux) the reading is unknown.
"""

from __future__ import annotations

import os
import threading
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


def _deltas(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[tuple[int, int]]:
    """Each thread's (run, run-queue delay) between two ``_thread_times`` readings; a thread started since
    counts in full, one that ended is not in ``after``."""
    return [(run - before.get(tid, (0, 0))[0], delay - before.get(tid, (0, 0))[1])
            for tid, (run, delay) in after.items()]


# A thread that wanted a CPU for less than this in the window is not judged on its own (a helper thread's
# wake-up: one preemption is its whole share).
MIN_WANTED_NS = 2_000_000


def worst_share(deltas: list[tuple[int, int]]) -> float:
    """The largest share of its wanted time (run + run-queue delay, nanoseconds) any thread spent queued.
    Judged thread by thread, not summed: where one thread of a parallel kernel stands in a queue, its
    siblings spin at the barrier meanwhile and count as running, so a sum reads 1/N of the stall on N
    threads (a 64-thread engine beside one neighbour: about 1%)."""
    shares = [delay / (run + delay) for run, delay in deltas if run + delay >= MIN_WANTED_NS]
    return max(shares, default=0.0)


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
        deltas = _deltas(before, after)
        self.share = worst_share(deltas)
        self.ran_s, self.waited_s = sum(r for r, _ in deltas) / 1e9, sum(w for _, w in deltas) / 1e9
        return self

    def busy(self, limit: float, at_least_s: float = MIN_WAIT_S) -> bool:
        """Whether the threads waited for a CPU more than ``limit`` of the time they wanted one, and at least
        ``at_least_s`` in all (False where unknown)."""
        return self.share is not None and self.share > limit and self.waited_s >= at_least_s


class ThreadQueueing:
    """Running totals of this process's threads' CPU time and run-queue waiting, in seconds, monotone as
    threads come and go (an ended thread's time since the last update is not in them); and a check, called
    as the engine steps, that says when the waiting was a large share of a recent stretch: a server whose
    threads keep queueing for a CPU shares its cores with other work (or runs more threads than it has
    cores), and every step pays for it (docs/fleet.md). Thread-safe."""

    WINDOW_S = 60.0  # the stretch the check judges
    WARN_SHARE = 0.2  # of the threads' wanted time, spent queued
    WARN_MIN_S = 1.0  # and at least this much queueing in the stretch
    WARN_EVERY_S = 600.0  # at most one warning in this long

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = _thread_times()
        self.known = self._last is not None
        self.ran_s = self.waited_s = 0.0
        self._window = (time.monotonic(), 0.0, 0.0)  # (its start, ran_s and waited_s then)
        self._warned_at: float | None = None

    def update(self) -> None:
        with self._lock:
            now = _thread_times()
            if now is None or self._last is None:
                return
            deltas = _deltas(self._last, now)
            self._last = now
            self.ran_s += sum(r for r, _ in deltas) / 1e9
            self.waited_s += sum(w for _, w in deltas) / 1e9

    def check(self, now: float | None = None) -> str | None:
        """Once a WINDOW_S stretch has passed: a warning where its threads queued for a CPU more than
        WARN_SHARE of the time they wanted one (and WARN_MIN_S in all), at most once in WARN_EVERY_S."""
        now = time.monotonic() if now is None else now
        start, ran0, waited0 = self._window
        if not self.known or now - start < self.WINDOW_S:
            return None
        self.update()
        ran, waited = self.ran_s - ran0, self.waited_s - waited0
        self._window = (now, self.ran_s, self.waited_s)
        share = waited / (ran + waited) if ran + waited > 0 else 0.0
        if share <= self.WARN_SHARE or waited < self.WARN_MIN_S:
            return None
        if self._warned_at is not None and now - self._warned_at < self.WARN_EVERY_S:
            return None
        self._warned_at = now
        return (f"the engine's threads waited for a CPU {100 * share:.0f}% of the time they wanted one over the "
                f"last {now - start:.0f} s: other work is computing on the same cores, or --num-threads exceeds "
                "them; every step pays for it. Give this server cores of its own (--num-threads, and taskset or a "
                "cpuset); where cores must be shared, GOMP_SPINCOUNT=1000 in its environment shortens the wait")
