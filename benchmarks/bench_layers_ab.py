"""Kernel builds against each other on the very steps of a serving load, in turn, in one process.

    python -m benchmarks.bench_layers_ab --variant NAME=FLAGS [--variant ...] [--split]
                                         [--streams 32] [--requests 64] [--prompt-tokens 230] [--max-tokens 128]
                                         [--loadgen-texts] [--every 5] [--reps 5]

Runs bench_load_split's closed loop on the engine's defaults. Every ``--every``-th step, the decoder layers'
one C call (csrc/forward.c) is run ``--reps`` more times by each build (the engine's own and one per
``--variant``: the benchmarks' library compiled with FLAGS added, e.g. ``-DFMA_WIDE_CHUNK=64``, any of
engine/kernels/csrc/tuning.h's switches), the builds in a shuffled
order each round and the step's residual stream put back before every run; then the engine's own build runs
it for real, so the load's answers are the ones it gives without this bench. Per build: the sum over the
sampled steps of each step's median time, for steps that prefill and decode-only steps, and its ratio to the
engine's build.

Server runs of the same change differ by 5-10% from one minute to the next on a shared machine; here both
builds see the same steps in the same seconds, and two identical builds came out within 0.4% of each other
(AMD EPYC, 42 sampled steps). ``--split`` adds runs of the benchmarks' layer loop that leave one group of
kernels out (enum spark_forward_skip in forward.h): one minus such a run's ratio is that group's share of the
layers' time.

A measuring aid, not a bar: no verdict.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from benchmarks.bench_kernels import cpu_model
from benchmarks.bench_load_split import add_load_arguments, run_load, warmed_engine
from benchmarks.kernel_bench import SKIP, bench_kernels, engine_march
from engine.kernels import CpuKernels, ForwardStep

SPLIT = [("without the linears", SKIP["linears"]),
         ("without decode attention", SKIP["decode attention"]),
         ("without prefill attention", SKIP["prefill attention"]),
         ("without norms, RoPE, SiLU", SKIP["elementwise"])]
KINDS = ("prefill", "decode")  # steps with a prompt chunk, decode-only steps


@dataclass
class Build:
    name: str
    # the build's own, bound before the engine's is replaced
    forward_layers: Callable[[ctypes.Array, ForwardStep], None]
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))


class LayersAB:
    """Stands in for the engine's ``forward_layers``: on sampled calls, every build runs the call in turn first."""

    def __init__(self, builds: list[Build], every: int, reps: int, seed: int = 0) -> None:
        self.real = builds[0].forward_layers  # the engine's build
        self.builds, self.every, self.reps = builds, every, reps
        self.rng = random.Random(seed)
        self.calls = 0
        self.sampled = dict.fromkeys(KINDS, 0)

    def __call__(self, layers: ctypes.Array, step: ForwardStep) -> None:
        self.calls += 1
        if self.calls % self.every == 0:
            self._compare(layers, step)
        self.real(layers, step)

    def _compare(self, layers: ctypes.Array, step: ForwardStep) -> None:
        # x, the residual stream, is updated in place; everything else the call writes it rewrites (its
        # scratch, and the KV of this step's own slots, which the real call writes last)
        size = step.tokens * step.hidden * 2
        saved = ctypes.create_string_buffer(size)
        ctypes.memmove(saved, step.x, size)
        self.real(layers, step)  # untimed: every scratch buffer holds real values before a build skips a kernel
        times: dict[str, list[float]] = {b.name: [] for b in self.builds}
        for _ in range(self.reps):
            for build in self.rng.sample(self.builds, len(self.builds)):
                ctypes.memmove(step.x, saved, size)
                start = time.perf_counter()
                build.forward_layers(layers, step)
                times[build.name].append(time.perf_counter() - start)
        ctypes.memmove(step.x, saved, size)
        kind = "prefill" if step.num_spans else "decode"
        self.sampled[kind] += 1
        for build in self.builds:
            build.seconds[kind] += statistics.median(times[build.name])


def variant_builds(engine_kernels: CpuKernels, variants: list[tuple[str, str]],
                   split: list[tuple[str, int]]) -> list[Build]:
    """The engine's own build first, then each variant (the benchmarks' library compiled with its flags for the
    engine's target), then each split run (the benchmarks' library leaving its groups out); all on the
    engine's linear path."""
    march = engine_march(engine_kernels)
    builds = [Build("engine's build", engine_kernels.forward_layers)]

    def on_engine_path(extra_flags: tuple[str, ...]):
        bench = bench_kernels(extra_flags, march)
        if engine_kernels.linear_path is not None:
            bench.kernels.set_linear_path(engine_kernels.linear_path)
        return bench

    for name, flags in variants:
        bench = on_engine_path(tuple(flags.split()))
        builds.append(Build(name, bench.forward_layers))
    if split:
        bench = on_engine_path(())
        for name, skip in split:
            builds.append(Build(name, partial(bench.forward_layers, skip=skip)))
    return builds


def parse_variant(text: str) -> tuple[str, str]:
    name, sep, flags = text.partition("=")
    if not sep or not name or not flags.strip():
        raise argparse.ArgumentTypeError(f"--variant takes NAME=FLAGS (got {text!r})")
    return name, flags


def report(builds: list[Build], sampled: dict[str, int]) -> list[str]:
    base = builds[0].seconds
    lines = [f"{'build':28s} {'steps that prefill':>22s} {'decode-only steps':>22s} {'all':>6s}"]
    for build in builds:
        cells = []
        for kind in KINDS:
            ratio = build.seconds[kind] / base[kind] if base[kind] else float("nan")
            cells.append(f"{build.seconds[kind] * 1e3:9.1f} ms ({ratio:.3f})")
        total = sum(build.seconds.values()) / max(sum(base.values()), 1e-12)
        lines.append(f"{build.name:28s} {cells[0]:>22s} {cells[1]:>22s} {total:6.3f}")
    lines.append(f"sampled steps: {sampled['prefill']} that prefill, {sampled['decode']} decode-only")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", type=parse_variant, action="append", default=[], metavar="NAME=FLAGS")
    ap.add_argument("--split", action="store_true", help="add the builds that leave one group of kernels out")
    add_load_arguments(ap)
    ap.add_argument("--every", type=int, default=5, help="sample every N-th step")
    ap.add_argument("--reps", type=int, default=5, help="runs per build of each sampled step")
    args = ap.parse_args()
    if not args.variant and not args.split:
        ap.error("nothing to compare: give --variant NAME=FLAGS or --split")
    if args.every < 1 or args.reps < 1:
        ap.error("--every and --reps are at least 1")
    engine = warmed_engine(args.streams, args.prompt_tokens)
    kernels = engine.runner.model.kernels
    if kernels is None:
        raise SystemExit("no native kernels here (no compiler, or SPARK_NATIVE_KERNELS=0): nothing to compare")
    builds = variant_builds(kernels, args.variant, SPLIT if args.split else [])
    ab = LayersAB(builds, args.every, args.reps)
    kernels.forward_layers = ab  # this instance only: the engine's calls go through the comparison
    try:
        run_load(engine, args.streams, args.requests, args.prompt_tokens, args.max_tokens, args.loadgen_texts)
    finally:
        del kernels.forward_layers
    if not any(ab.sampled.values()):
        raise SystemExit("no step ran the layers as one native call (the model needs Python between its kernels)")
    print(f"CPU: {cpu_model()}; {args.streams} streams, {args.requests} requests of {args.prompt_tokens} prompt + "
          f"{args.max_tokens} output tokens; one step in {args.every} run {args.reps} more times by each build, "
          "in turn")
    print("\n".join(report(builds, ab.sampled)))


if __name__ == "__main__":
    main()
