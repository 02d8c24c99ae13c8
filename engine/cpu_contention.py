"""Whether this process's CPUs were contended over a stretch of wall time.

A kernel timing taken while another process computes on the same cores is not the kernel's own. Worse than
noise, it can be consistently wrong: two threads of a parallel kernel that wait for each other at a barrier,
one of them descheduled in favour of a neighbour's spinning thread, lose a whole scheduler tick (4 ms at
250 Hz) on every call, so the best of many samples is still a tick. Start-up's kernel probes are kept for
later starts (engine/models/tuning.py); a measurement taken beside such a neighbour must not be.

The reading, ``share``: the fraction of the window in which some task waited for a CPU, from the kernel's
pressure stall information (/proc/pressure/cpu, Linux 4.20+, in microseconds). Where that is missing, the
CPUs' worth of time other processes used on this process's CPUs stands in for it: the busy time /proc/stat
counts there (the hypervisor's steal included: another guest on the same cores is a neighbour too), less
this process's own CPU time. Those are kept in clock ticks, so a short window's reading carries an error of
a few ticks; ``quiet`` and ``busy`` each answer only where the reading is certain either way. Elsewhere than
Linux the reading is unknown, and neither answers.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

PRESSURE = Path("/proc/pressure/cpu")
STAT = Path("/proc/stat")
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (guest time is inside user)


def _stalled_seconds() -> float | None:
    """Seconds in which some task waited for a CPU, since boot; None without pressure stall information."""
    try:
        with PRESSURE.open() as pressure:
            some = pressure.readline()  # some avg10=... avg60=... avg300=... total=<microseconds>
        return int(some.rsplit("total=", 1)[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return None


def _busy_ticks(cpus: set[int]) -> int | None:
    """Busy clock ticks since boot, summed over ``cpus``; None where /proc/stat cannot be read."""
    total = 0
    try:
        with STAT.open() as stat:
            for line in stat:
                if not (line.startswith("cpu") and line[3:4].isdigit()):
                    continue
                name, *fields = line.split()
                if int(name[3:]) in cpus:
                    values = [int(v) for v in fields]
                    total += sum(values[i] for i in _BUSY_FIELDS if i < len(values))
    except (OSError, ValueError):
        return None
    return total


def _tick_seconds() -> float:
    try:
        return 1.0 / os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 0.01


def _own_seconds() -> float:
    times = os.times()
    return times.user + times.system  # every thread of this process; not its children


def _cpus() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


@dataclass
class CpuContention:
    """A context manager: on exit, ``share`` is the reading for the time it was open (None where unknown),
    ``error`` its uncertainty, ``source`` where it came from ("pressure" or "stat")."""

    share: float | None = None
    error: float = 0.0
    seconds: float = 0.0
    source: str | None = None

    def __enter__(self) -> CpuContention:
        self._set = _cpus()
        self._start = (time.perf_counter(), _stalled_seconds(), _busy_ticks(self._set), _own_seconds())
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.read()

    def read(self) -> CpuContention:
        """Sets the reading for the time from entry until now (``__exit__`` takes the last); returns self."""
        wall0, stalled0, busy0, own0 = self._start
        stalled1, busy1, own1 = _stalled_seconds(), _busy_ticks(self._set), _own_seconds()
        self.seconds = time.perf_counter() - wall0
        if self.seconds <= 0:
            return self
        if stalled0 is not None and stalled1 is not None:
            self.share, self.error, self.source = (stalled1 - stalled0) / self.seconds, 0.0, "pressure"
        elif busy0 is not None and busy1 is not None:
            tick = _tick_seconds()
            others = (busy1 - busy0) * tick - (own1 - own0)
            # each CPU's busy count and the process's own time may each be up to a tick off
            self.share, self.error, self.source = (max(0.0, others / self.seconds),
                                                   (len(self._set) + 1) * tick / self.seconds, "stat")
        return self

    def quiet(self, limit: float) -> bool:
        """Whether the reading is certainly at most ``limit``."""
        return self.share is not None and self.share + self.error <= limit

    def busy(self, limit: float) -> bool:
        """Whether the reading is certainly above ``limit``."""
        return self.share is not None and self.share - self.error > limit
