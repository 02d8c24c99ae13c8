"""The benchmarks as pass/fail checks (`make test-slow`): each exits non-zero when it misses its bar. The
profiling aids without a bar get a quick run in the default suite, so they do not rot."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

BENCHES = ["offline", "multiturn", "interactivity", "memory", "startup", "online", "lora", "abuse", "kernels",
           "structured"]


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("name", BENCHES)
def test_benchmark_meets_its_bar(name):
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.bench_{name}"], capture_output=True, text=True)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_the_decode_step_split_runs_and_adds_up():
    """bench_decode_step is a profiling aid without a bar: it must run, and its parts must be times of
    this run (each non-negative, together the step)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_decode_step", "--streams", "2", "--context", "20",
                           "--steps", "3"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip().splitlines()[-1]
    total, parts = re.match(r"decode step ([\d.]+) ms: (.*)", line).groups()
    values = [float(v) for v in re.findall(r" ([\d.-]+)(?:,|$)", parts)]
    assert len(values) == 4 and all(v >= 0 for v in values), line
    assert abs(sum(values) - float(total)) < 0.05, line
