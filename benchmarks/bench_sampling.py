"""Random sampling: the fused kernel (csrc/sampling.c) against the torch path it replaced, same run.

    python -m benchmarks.bench_sampling

engine.sampler.sample over a 49,152-token vocabulary (the embedded model's) at 1, 8 and 32 rows, for the
parameter sets clients send: temperature alone, Spark's top-k, OpenAI's top-p, both, min-p. Logits are
drawn from a model-like spread (a few tokens well ahead of a long tail). Bar: the kernel is faster than the
torch path for every set at 32 rows, and a top-p step at 32 rows costs under a tenth of the torch path.
"""

from __future__ import annotations

import statistics
import time
import types
from typing import Any

import torch

from benchmarks.bench_kernels import cpu_model
from benchmarks.common import print_table, save, verdict
from engine.kernels import load_cpu_kernels
from engine.sampler import sample
from engine.sampling_params import SamplingParams

VOCAB = 49152
PARAM_SETS: dict[str, dict[str, Any]] = {
    "temperature 1.0": dict(temperature=1.0),
    "temperature 0.5, top-k 4 (Spark)": dict(temperature=0.5, top_k=4),
    "temperature 0.7, top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "temperature 0.8, top-k 50, top-p 0.95": dict(temperature=0.8, top_k=50, top_p=0.95),
    "temperature 1.0, min-p 0.05": dict(temperature=1.0, min_p=0.05),
}


def model_like_logits(rows: int, gen: torch.Generator) -> torch.Tensor:
    """A long Gaussian tail with a handful of tokens several units ahead, as a language model's are."""
    logits = torch.randn(rows, VOCAB, generator=gen) * 2.0
    lead = torch.randint(0, VOCAB, (rows, 8), generator=gen)
    logits.scatter_(1, lead, 8.0 + 4.0 * torch.rand(rows, 8, generator=gen))
    return logits


def time_sample(logits: torch.Tensor, seqs: list, draw, seconds: float = 1.5) -> float:
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        x = logits.clone()
        t0 = time.perf_counter()
        sample(x, seqs, [2], draw=draw)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    kern = load_cpu_kernels()
    if kern is None:
        print("no fused CPU kernels on this machine (no C compiler): nothing to measure")
        return 0
    model = cpu_model()
    print(f"CPU: {model}, {torch.get_num_threads()} threads")
    gen = torch.Generator().manual_seed(0)
    table, rows_out, checks = [], [], {}
    for name, params in PARAM_SETS.items():
        p = SamplingParams(max_tokens=128, **params)
        for rows in (1, 8, 32):
            seqs = [types.SimpleNamespace(params=p, num_output_tokens=1, token_ids=[1], output_token_ids=[1],
                                          generator=torch.Generator().manual_seed(i), pending_logprobs=[])
                    for i in range(rows)]
            logits = model_like_logits(rows, gen)
            torch_s = time_sample(logits, seqs, None)
            kernel_s = time_sample(logits, seqs, kern.sample)
            table.append([name, rows, f"{torch_s * 1e3:.3f}", f"{kernel_s * 1e3:.3f}", f"{torch_s / kernel_s:.1f}x"])
            rows_out.append({"params": params, "rows": rows, "torch_ms": torch_s * 1e3, "kernel_ms": kernel_s * 1e3})
            if rows == 32:
                checks[f"{name}: kernel faster at 32 rows"] = kernel_s < torch_s
                if "top_p" in params and "top_k" not in params:
                    checks[f"{name}: under a tenth of the torch path at 32 rows"] = kernel_s < torch_s / 10
    print_table(f"engine.sampler.sample, {VOCAB:,}-token vocabulary ({model})",
                ["parameters", "rows", "torch path ms", "kernel ms", "speed-up"], table)
    save("sampling", {"cpu": model, "vocab": VOCAB, "results": rows_out})
    return verdict(checks)


if __name__ == "__main__":
    raise SystemExit(main())
