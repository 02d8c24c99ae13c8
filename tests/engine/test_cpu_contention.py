"""The reading of CPU contention that decides whether start-up's kernel timings are kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import cpu_contention
from engine.cpu_contention import CpuContention

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux's /proc/stat")
SPIN = "import time\nend = time.monotonic() + 0.6\nwhile time.monotonic() < end: pass\n"


def _spinners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]


@pytest.mark.parametrize("source", ["pressure", "stat"])
def test_more_spinning_processes_than_cpus_read_as_contended(monkeypatch, tmp_path: Path, source: str) -> None:
    """One more process spinning than this process may run on: some task always waits for a CPU, and the
    others' CPU time fills the CPUs, so either source reads busy, not quiet."""
    if source == "pressure" and cpu_contention._stalled_seconds() is None:
        pytest.skip("no pressure stall information here")
    if source == "stat":
        monkeypatch.setattr(cpu_contention, "PRESSURE", tmp_path / "absent")
    cpus = len(os.sched_getaffinity(0))
    with CpuContention() as contention:
        for child in _spinners(cpus + 1):
            assert child.wait() == 0
    assert contention.source == source and contention.seconds > 0.5
    assert contention.busy(0.3) and not contention.quiet(0.3), (contention.share, contention.error)


def test_nothing_to_read_answers_neither(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cpu_contention, "PRESSURE", tmp_path / "absent")
    monkeypatch.setattr(cpu_contention, "STAT", tmp_path / "absent")
    with CpuContention() as contention:
        pass
    assert contention.share is None and not contention.quiet(0.3) and not contention.busy(0.3)


def test_a_short_window_of_clock_ticks_is_not_certain(monkeypatch, tmp_path: Path) -> None:
    """Without pressure stall information, a window of a few clock ticks cannot tell either way."""
    monkeypatch.setattr(cpu_contention, "PRESSURE", tmp_path / "absent")
    with CpuContention() as contention:
        pass
    assert contention.source == "stat" and contention.error > 1
    assert not contention.quiet(0.3) and not contention.busy(0.3)
