"""The benchmarks as pass/fail checks (`make test-slow`): each exits non-zero when it misses its bar. The
profiling aids without a bar get a quick run so they do not rot: in `make test-slow` the two that start a
benchmark process and measure the machine's peaks first (seconds each before any load runs), in the default
suite the one that runs in-process and the two-builds comparison on a tiny shape."""

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


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_load_split_counts_the_load_and_its_ceiling_is_not_above_the_run():
    """bench_load_split is a profiling aid without a bar. Its accounting is checked: the prompt tokens and decode
    rows it recorded are exactly the load's (each request's first token comes from its prefill), and the
    ceiling it computed is not above the run's own time (work at the CPU's peaks cannot be beaten, so a ceiling
    far above the measured time means the work was overcounted). The load is tiny and mostly memory-bound, and
    the plain read the ceiling divides by moves with the machine's other tenants, so the check allows 1.5x:
    measured runs sit at 55-80% of the ceiling. A gross overcount fails it (the decoding rows' keys a
    thousandfold: tried); the tokens and rows themselves are checked exactly above."""
    requests, prompt, out = 3, 20, 4
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_load_split", "--streams", "2", "--requests",
                           str(requests), "--prompt-tokens", str(prompt), "--max-tokens", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout
    if "no peak to compare against" in text:
        pytest.skip("no native kernels with a fast path on this machine")
    prompt_tokens = [int(v) for v in re.findall(r"(\d+) prompt tokens", text)]
    decode_rows = [int(v) for v in re.findall(r"(\d+) decode rows", text)]
    assert sum(prompt_tokens) == requests * prompt, text
    assert sum(decode_rows) == requests * (out - 1), text
    overlapped, phased = (float(v) for v in re.search(r"ceiling: ([\d.]+) s .*; ([\d.]+) s", text).groups())
    wall = float(re.search(r"measured: ([\d.]+) s", text).group(1))
    assert 0 < overlapped <= phased <= 1.5 * wall, text


def test_the_layers_ab_leaves_the_loads_answers_as_they_are(monkeypatch):
    """bench_layers_ab runs each sampled step's layers several more times before the engine's real call, so it
    must put back everything those runs move: the answers of a greedy load with it in place are the answers
    without it. Two copies of the engine's own build stand in for the variants (no compile here); had the
    residual stream not been restored, every sampled step would run the layers on their own output (tried:
    the answers differ from the first step on). Each build's time is a time of this run."""
    from benchmarks.bench_layers_ab import Build, LayersAB
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from tests.engine.helpers import chat, run_all, tokens_of

    engine = LLMEngine(EngineConfig(max_num_seqs=4, kv_cache_space_gib=0.25))
    kernels = engine.runner.model.kernels
    if kernels is None:
        pytest.skip("no C compiler: the fused CPU kernels are not built")
    prompts = ["Name three colours.", "Count from one to five.", "What is the capital of France?"]

    def answers(prefix: str) -> list[list[int]]:
        outs = run_all(engine, [chat(f"{prefix}{i}", p, temperature=0, max_tokens=12) for i, p in enumerate(prompts)])
        return [tokens_of(outs[f"{prefix}{i}"]) for i in range(len(prompts))]

    plain = answers("plain")
    builds = [Build("engine's build", kernels.forward_layers), Build("again", kernels.forward_layers)]
    ab = LayersAB(builds, every=1, reps=2)
    monkeypatch.setattr(kernels, "forward_layers", ab)
    assert answers("ab") == plain
    assert ab.sampled["prefill"] >= 1 and ab.sampled["decode"] >= 1
    assert all(build.seconds[kind] > 0 for build in builds for kind in ("prefill", "decode"))


def test_two_builds_side_by_side_runs_and_compares_bits(tmp_path):
    """bench_linear_builds on one build against itself: it runs, and says the bits are the same."""
    from engine.kernels import installed_state, lib_dir, load_cpu_kernels

    if load_cpu_kernels() is None or installed_state()[0] != "current":
        pytest.skip("no current kernel library build here")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_linear_builds", str(lib_dir()), str(lib_dir()),
                           "--kinds", "u4,bf16", "--rows", "1,17", "--shapes", "48,64"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if "same bits:" in line]
    assert len(lines) == 4 and all(line.endswith("same bits: True") for line in lines), proc.stdout
