"""The reading of CPU contention that decides whether start-up's kernel timings are kept."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine import cpu_contention
from engine.cpu_contention import CpuContention, ThreadQueueing

pytestmark = pytest.mark.skipif(cpu_contention._thread_times() is None,
                                reason="no scheduler statistics (/proc/self/task/*/schedstat)")
SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass\n"


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@contextmanager
def _on_one_cpu() -> Iterator[int]:
    """This thread on one CPU of its set for the block (restored after); processes it starts meanwhile
    inherit the mask."""
    cpus = os.sched_getaffinity(0)
    cpu = min(cpus)
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError as exc:  # a sandbox that refuses even narrowing one's own mask
        pytest.skip(f"cannot set this thread's CPU: {exc}")
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, cpus)


def test_threads_queued_behind_spinning_neighbours_read_as_contended() -> None:
    """Two processes spinning on this thread's one CPU: it wants the CPU the whole window and gets about a
    third of it, whatever the machine's size and whatever runs on its other CPUs."""
    with _on_one_cpu():
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=1.0)]) for _ in range(2)]
        time.sleep(0.2)  # the spinners past their start-up
        with CpuContention() as contention:
            _spin(0.4)
        for child in spinners:
            assert child.wait() == 0
    assert contention.share is not None and contention.share > 0.3, contention
    assert contention.waited_s > 0.1 and contention.busy(0.1)


def test_one_stalled_thread_of_many_is_contention() -> None:
    """Judged thread by thread: one thread of a parallel kernel queued half its time while its siblings spun
    at the barrier (counted as running) is contention on any number of threads; a sum would read 1/N."""
    ms = 1_000_000
    stalled, spinning = (60 * ms, 60 * ms), (119 * ms, 0)
    for siblings in (1, 63):
        assert cpu_contention.worst_share([stalled] + [spinning] * siblings) == pytest.approx(0.5)
    # a helper thread's lone wake-up (a millisecond wanted, half of it queued) is not judged on its own
    assert cpu_contention.worst_share([(ms // 2, ms // 2), spinning]) == 0.0


def test_a_thread_started_in_the_window_counts() -> None:
    """A thread started inside the window counts from its start (all of its time is the window's), as long
    as it lives at the reading (as the kernels' worker threads do)."""
    done = threading.Event()

    def work() -> None:
        _spin(0.2)
        done.wait()

    worker = threading.Thread(target=work)
    with CpuContention() as contention:
        worker.start()
        time.sleep(0.3)
        contention.read()
    done.set()
    worker.join()
    # wanted for the whole spin: run or queued, however loaded the machine
    assert contention.share is not None and contention.ran_s + contention.waited_s >= 0.15, contention


def test_no_statistics_read_as_unknown(monkeypatch, tmp_path: Path) -> None:
    """Without the kernel's statistics the reading is unknown, and unknown is not contention."""
    monkeypatch.setattr(cpu_contention, "TASKS", tmp_path / "absent")
    with CpuContention() as contention:
        _spin(0.05)
    assert contention.share is None and not contention.busy(0.0, at_least_s=0.0)


def test_a_brief_wait_is_not_contention() -> None:
    reading = CpuContention(share=0.37, seconds=0.012, waited_s=0.009)  # one preemption in a short probe
    assert not reading.busy(0.1)
    assert CpuContention(share=0.5, seconds=0.2, waited_s=0.15).busy(0.1)


def test_the_engine_loop_warns_when_its_threads_keep_queueing(monkeypatch) -> None:
    """Totals stay monotone as threads come and go; a stretch where the threads queued for a CPU more than a
    fifth of the time they wanted one is warned about, at most once in WARN_EVERY_S, and a quiet stretch
    not at all."""
    second = 1_000_000_000
    readings = iter([
        {"1": (0, 0), "2": (0, 0)},  # at construction
        {"1": (30 * second, 0), "2": (29 * second, second // 2)},  # a quiet minute: 0.8% queued
        {"1": (50 * second, 10 * second), "3": (20 * second, 10 * second)},  # thread 2 gone, 3 new: a third queued
        {"1": (70 * second, 20 * second), "3": (40 * second, 20 * second)},  # as bad again, within ten minutes
        {"1": (90 * second, 30 * second), "3": (60 * second, 30 * second)},  # and again, ten minutes later
    ])
    monkeypatch.setattr(cpu_contention, "_thread_times", lambda: next(readings))
    queueing = cpu_contention.ThreadQueueing()
    start = time.monotonic()
    assert queueing.check(start + 1) is None  # the stretch has not passed: nothing read
    assert queueing.check(start + 61) is None
    assert queueing.ran_s == pytest.approx(59) and queueing.waited_s == pytest.approx(0.5)
    warning = queueing.check(start + 122)
    assert warning is not None and "33% of the time" in warning and "--num-threads" in warning
    assert queueing.ran_s == pytest.approx(59 + 20 + 20) and queueing.waited_s == pytest.approx(0.5 + 10 + 10)
    assert queueing.check(start + 183) is None  # warned a minute ago
    assert queueing.check(start + 122 + ThreadQueueing.WARN_EVERY_S) is not None
