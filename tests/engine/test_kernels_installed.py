"""The kernel libraries built at install (engine/kernels/build.py; `make install`) serve without a compiler:
a process whose PATH has no cc / gcc / clang and no CC loads the prebuilt library for its CPU and runs a
kernel. And the pick by CPU: the highest target built that this CPU runs, capped by SPARK_KERNELS_TARGET."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.kernels import TARGET_ENV, build, installed_state, loader

LOAD_AND_RUN = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
import torch
from engine.kernels import find_compiler, load_cpu_kernels
assert find_compiler() is None, find_compiler()
k = load_cpu_kernels()
logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 5.0]])
print("KERNELS", k.origin, "|", k.target, "|", ",".join(k.linear_paths), "|", k.argmax(logits).tolist())
"""


@pytest.fixture(scope="module")
def installed() -> list[str]:
    state, targets = installed_state()
    if state == "absent":
        pytest.fail("no kernel libraries installed: `make install` (or `make kernels`) builds them")
    if state == "stale":
        pytest.skip("the kernel sources changed since the libraries were built: `make kernels` rebuilds them")
    return targets


def test_a_machine_without_a_compiler_serves_the_prebuilt_kernels(installed, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "SPARK_KERNELS_BUILD", "SPARK_KERNELS_MARCH",
                                                            TARGET_ENV, "SPARK_NATIVE_KERNELS")}
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    env.update(PATH=str(empty_bin), SPARK_CACHE_DIR=str(tmp_path / "cache"))  # no compiler, no cached build
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_RUN], capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("KERNELS"))
    origin, target, _, picks = (part.strip() for part in line.removeprefix("KERNELS").split("|"))
    assert origin == f"prebuilt {target}" and target in installed
    assert picks == "[1, 0]"
    assert "fused CPU kernels: prebuilt" in proc.stdout
    assert not list((tmp_path / "cache").glob("**/*.so"))  # nothing was compiled
    if build.is_x86_64():  # the CPU's best: this CI's x86 machines all run at least the AVX2 library
        assert target != "portable"


@pytest.mark.parametrize("cap", ["portable", "avx2", "avx512", "avx512bf16"])
def test_the_pick_is_the_best_target_built_up_to_the_cap(installed, monkeypatch, cap) -> None:
    monkeypatch.setenv(TARGET_ENV, cap)
    picked = loader.best_installed_target(installed)
    monkeypatch.delenv(TARGET_ENV)
    unlimited = loader.best_installed_target(installed)
    order = list(loader.TARGETS)
    assert picked == min(unlimited, cap, key=order.index)
    monkeypatch.setenv(TARGET_ENV, "sse9")
    with pytest.raises(ValueError, match=TARGET_ENV):
        loader.best_installed_target(installed)


def test_libraries_older_than_their_sources_are_not_current(installed, monkeypatch) -> None:
    monkeypatch.setattr(build, "sources_digest", lambda: "edited since")
    assert installed_state()[0] == "stale"
