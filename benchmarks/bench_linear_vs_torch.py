"""The packed linear kernels against torch's own linears (fp32 and bf16) on the embedded model's largest
projections, from one row (decode) to a prefill chunk: where the kernels win, and from which batch a
fallback to torch pays. A profiling aid with no bar; it prints one table and saves it.

    python -m benchmarks.bench_linear_vs_torch [--shape HIDDEN,INTERMEDIATE] [--rows 1,8,32,128,512]

``--shape 2048,8192`` (SmolLM2-1.7B) with ``--rows 64,256,1024,2048`` shows prefill-sized products at a
served size, with each one's rate in multiply-adds a second: what a bf16 model (vLLM's weights) gets from
torch against what the kernels get from the same shape's 4-bit and bf16 packings.

To see a CPU without AVX-512 on one that has it, hold torch and the kernels to AVX2 together:

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 SPARK_KERNELS_MARCH=x86-64-v3 \\
        python -m benchmarks.bench_linear_vs_torch
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.bench_kernels import best_of, cpu_model
from benchmarks.common import save
from engine.kernels import LINEAR_PATH_NAMES, load_cpu_kernels
from engine.quant.formats import quantize_int4, quantize_int8
from engine.quant.packing import pack_bf16, pack_quantized

SHAPES = [(3072, 576), (576, 1536), (49152, 576)]  # gate_up, down, the head
ROWS = (1, 8, 32, 128, 512)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="", help="HIDDEN,INTERMEDIATE: that model's gate_up and down "
                                                      "projections instead of the embedded model's")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts")
    args = parser.parse_args(argv)
    shapes = SHAPES
    if args.shape:
        hidden, intermediate = (int(v) for v in args.shape.split(","))
        shapes = [(2 * intermediate, hidden), (hidden, intermediate)]
    row_counts = [int(v) for v in args.rows.split(",")]
    kern = load_cpu_kernels()
    if kern is None:
        print("no fused CPU kernels (no C compiler)")
        return 1
    kern.num_threads = torch.get_num_threads()
    paths = " and ".join(LINEAR_PATH_NAMES[p] for p in kern.linear_paths) or "portable C"
    print(f"CPU: {cpu_model()}; torch {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
          f"kernels: {paths}")
    rows_out = []
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen) * 0.05
        wb = w.to(torch.bfloat16)
        packs = {"4-bit": pack_quantized(quantize_int4(w)), "int8": pack_quantized(quantize_int8(w)),
                 "bf16": pack_bf16(wb)}
        for rows in row_counts:
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            xf = x.float()
            fp32 = best_of(lambda: torch.nn.functional.linear(xf, w), 7)
            bf16 = best_of(lambda: torch.nn.functional.linear(x, wb), 7)
            mine = {name: best_of(lambda p=p: kern.linear(x, p), 7) for name, p in packs.items()}
            torch_best = min(fp32, bf16)
            macs = rows * n * k
            rates = {"torch bf16": macs / bf16 / 1e9, **{name: macs / t / 1e9 for name, t in mine.items()}}
            rows_out.append({"shape": f"{n}x{k}", "rows": rows,
                             **{f"{name.replace(' ', '_')}_gmacs": rate for name, rate in rates.items()},
                             "torch_fp32_ms": fp32 * 1e3, "torch_bf16_ms": bf16 * 1e3,
                             **{f"{name}_ms": t * 1e3 for name, t in mine.items()},
                             **{f"{name}_vs_torch": torch_best / t for name, t in mine.items()}})
            print(f"{n:>5}x{k:<5} {rows:>4} rows: torch fp32 {fp32 * 1e3:8.3f} ms, bf16 {bf16 * 1e3:8.3f} ms | "
                  + "  ".join(f"{name} {t * 1e3:8.3f} ({torch_best / t:4.2f}x)" for name, t in mine.items())
                  + " | G multiply-adds/s: " + ", ".join(f"{name} {rate:.0f}" for name, rate in rates.items()))
    print("(Nx): torch's faster linear over the kernel's time; over 1 the kernel wins")
    save("linear_vs_torch", {"cpu": cpu_model(), "torch_capability": torch.backends.cpu.get_cpu_capability(),
                             "kernel_paths": paths, "rows": rows_out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
