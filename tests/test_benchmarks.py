"""The benchmarks as pass/fail checks (`make test-slow`): each exits non-zero when it misses its bar."""

from __future__ import annotations

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
