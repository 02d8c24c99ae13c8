"""Two builds of the kernel library, the packed linears side by side: each shape, format and row count timed
on both, alternating, best of several rounds, so a change to the kernels is judged against the build before
it in the same minutes (this host's speed drifts by a fifth from one hour to the next). It also says whether
both builds gave the same bits. A profiling aid with no bar; it prints one table and saves it.

    python engine/kernels/build.py --out /tmp/before        # before the change (e.g. from a checkout of it)
    python engine/kernels/build.py --out /tmp/after         # after it
    python -m benchmarks.bench_linear_builds /tmp/before /tmp/after --path fma --kinds u4,bf16,i8

Shapes: the embedded model's gate_up and down, and SmolLM2-1.7B's (``--shapes N,K;N,K`` for others).
``--path`` forces one of the builds' fast paths (``dot``, ``fma``) on both, whichever start-up would choose.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_kernels import cpu_model
from benchmarks.common import save
from engine.kernels import build, load_cpu_kernels, open_library
from engine.quant.formats import quantize_int4, quantize_int8
from engine.quant.packing import pack_bf16, pack_quantized

SHAPES = {"135M gate_up": (3072, 576), "135M down": (576, 1536), "1.7B gate_up": (16384, 2048),
          "1.7B down": (2048, 8192)}
ROWS = (1, 2, 3, 4, 8, 16, 32, 64, 256)
ROUNDS = 6
PASS_MACS = 2e8  # multiply-adds a timing covers (several calls of a small shape)


def _packed(kind: str, weight: torch.Tensor):
    if kind == "bf16":
        return pack_bf16(weight.to(torch.bfloat16))
    return pack_quantized(quantize_int4(weight) if kind == "u4" else quantize_int8(weight))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="a directory holding a kernel library build (build.py --out)")
    parser.add_argument("after")
    parser.add_argument("--path", default="", help="the fast path both run (dot or fma; default: the build's first)")
    parser.add_argument("--kinds", default="u4", help="weight formats: u4, i8, bf16")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default="", help="N,K;N,K instead of the default shapes")
    args = parser.parse_args(argv)
    target = (load_cpu_kernels() or sys.exit("no fused CPU kernels here")).target
    libs = [open_library(Path(d) / build.library_name(target), d) for d in (args.before, args.after)]
    for lib in libs:
        lib.num_threads = torch.get_num_threads()
    path = args.path or None
    shapes = ({f"{n}x{k}": (n, k) for n, k in (tuple(map(int, s.split(","))) for s in args.shapes.split(";"))}
              if args.shapes else SHAPES)
    print(f"CPU: {cpu_model()}; {torch.get_num_threads()} threads; target {target}, path {path or 'default'}")
    results = []
    gen = torch.Generator().manual_seed(0)
    for kind in args.kinds.split(","):
        for name, (n, k) in shapes.items():
            packed = _packed(kind, torch.randn(n, k, generator=gen) * 0.05)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
                outs = [torch.empty(m, n) for _ in libs]
                reps = max(1, int(PASS_MACS // (n * k * max(m, 4))))
                best = [float("inf")] * len(libs)
                for _ in range(ROUNDS):
                    for i, lib in enumerate(libs):
                        lib.linear(x, packed, None, outs[i], path=path)
                        start = time.perf_counter()
                        for _ in range(reps):
                            lib.linear(x, packed, None, outs[i], path=path)
                        best[i] = min(best[i], (time.perf_counter() - start) / reps)
                same = torch.equal(outs[0], outs[1])
                row = {"kind": kind, "shape": name, "rows": m, "before_ms": best[0] * 1e3, "after_ms": best[1] * 1e3,
                       "after_over_before": best[1] / best[0], "same_bits": same}
                results.append(row)
                print(f"{kind:5s} {name:14s} {m:4d} rows: before {row['before_ms']:8.3f} ms, after "
                      f"{row['after_ms']:8.3f} ms ({row['after_over_before']:.3f}x the time), "
                      f"{m * n * k / best[1] / 1e9:6.1f} G multiply-adds/s after; same bits: {same}", flush=True)
    save("linear_builds", {"cpu": cpu_model(), "target": target, "path": path, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
