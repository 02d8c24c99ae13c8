"""The benchmarks' own kernel library: every unit of the engine's plus csrc/bench.c (entry points for
measuring only), compiled here with the system compiler and optional tuning switches (csrc/tuning.h). The
engine's installed libraries never carry these.

    bench = bench_kernels()                      # this CPU's target (-march=native)
    bench.dot_peak("fma")                        # multiply-adds a second at the instruction's ceiling
    bench.forward_layers(layers, step, skip)     # the layer loop with kernel groups left out
"""

from __future__ import annotations

import ctypes
import time

from engine.kernels import (
    CpuKernels,
    ForwardStep,
    LayerDesc,
    build,
    build_library,
    find_compiler,
)
from engine.kernels.signatures import I64, INT, Signature, bind

# bench.h's declarations (tests/engine/test_kernel_signatures.py checks them against it)
BENCH_SIGNATURES: dict[str, Signature] = {
    "spark_bench_dot_peak": (ctypes.c_double, [INT, I64, INT]),
    "spark_bench_forward_layers": (INT, [ctypes.POINTER(LayerDesc), I64, ctypes.POINTER(ForwardStep), INT, INT, INT]),
}
BENCH_RETURNS_STATUS = frozenset({"spark_bench_forward_layers"})
PEAK_KINDS = ("dot", "fma", "vnni")  # spark_bench_dot_peak's kinds: the linears' two paths, the greedy head's int8
# enum spark_forward_skip (forward.h): kernel groups a profiling run may leave out of the layer loop
SKIP = {"linears": 1, "decode attention": 2, "prefill attention": 4, "elementwise": 8}


class BenchKernels:
    """A benchmark library: ``kernels`` (its engine entry points) and the measuring-only ones."""

    def __init__(self, lib: ctypes.CDLL, origin: str) -> None:
        self.kernels = CpuKernels(lib, origin)
        fns = bind(lib, BENCH_SIGNATURES, BENCH_RETURNS_STATUS)
        self._dot_peak = fns["spark_bench_dot_peak"]
        self._forward_layers = fns["spark_bench_forward_layers"]

    def forward_layers(self, layers: ctypes.Array, step: ForwardStep, skip: int = 0) -> None:
        """The engine's forward_layers with the groups in ``skip`` (SKIP's bits) left out."""
        k = self.kernels
        self._forward_layers(layers, len(layers), ctypes.byref(step), k.path_code(), skip, k.num_threads)

    def dot_peak(self, kind: str, seconds: float = 0.2) -> float | None:
        """Multiply-adds a second that ``kind``'s instruction reaches on register-resident values, all threads
        ("dot": vdpbf16ps, "fma": fp32 FMAs, "vnni": vpdpbusd); best of three runs of ~``seconds`` each.
        None where this build lacks the instruction. The ceiling a kernel's arithmetic can approach."""
        code, threads = PEAK_KINDS.index(kind), self.kernels.num_threads
        if not self._dot_peak(code, 1, threads):
            return None
        rounds, best = 1 << 12, 0.0
        while True:  # grow until one run takes a fair share of the time asked for
            start = time.perf_counter()
            self._dot_peak(code, rounds, threads)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds / 4 or rounds >= 1 << 34:
                break
            rounds *= 2
        for _ in range(3):
            start = time.perf_counter()
            done = self._dot_peak(code, rounds, threads)
            best = max(best, done / (time.perf_counter() - start))
        return best


def engine_march(kernels: CpuKernels) -> str | None:
    """The flags that build the engine's library again: its install target's, or None (the developer build's
    own -march) where it was compiled at start. A benchmark library built with them compares like with like."""
    return " ".join(build.target_flags(kernels.target)) if kernels.origin.startswith("prebuilt") else None


def bench_kernels(extra_flags: tuple[str, ...] = (), march: str | None = None) -> BenchKernels:
    """The benchmark library for this CPU (or ``march``), with tuning switches (-D NAME=VALUE) where given."""
    cc = find_compiler()
    if cc is None:
        raise SystemExit("no C compiler: the benchmarks' kernel library cannot be built")
    path = build_library(cc, march, extra_flags=extra_flags, bench=True)
    return BenchKernels(ctypes.CDLL(str(path)), f"benchmark build {' '.join(extra_flags)}".strip())
