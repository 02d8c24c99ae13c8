"""Offline throughput: 64 requests (~200-token prompts, 128 output tokens, ignore_eos) at
concurrency 1, 8 and 32, beside transformers' sequential `generate` (fp32, batch 1) in the same run.

Bars (issue "Engine"): at concurrency 32 the aggregate output tokens/s is >= 20x the baseline;
at concurrency 1 the time per output token is <= 0.3x the baseline's.

This machine's speed drifts by tens of percent over minutes, so the single-stream part alternates:
two engine requests, then one baseline request, round after round; both medians come from the
same stretch of time.

    python -m benchmarks.bench_offline [--num-requests 64] [--baseline-requests 8]
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from benchmarks.common import (
    HFBaselineProcess,
    print_table,
    run_load,
    save,
    start_engine,
    summarize,
    synthetic_prompt,
    token_requests,
    verdict,
)

PROMPT_LEN = 200
OUTPUT_LEN = 128


async def engine_runs(args) -> tuple[dict[str, float], dict[int, dict[str, float]], str]:
    engine = start_engine(dtype=args.dtype, max_num_seqs=64)
    try:
        # warm-up: first-call kernel selection should not count against concurrency 1
        await run_load(engine, token_requests("warm", 2, PROMPT_LEN, 8), 2)
        baseline = HFBaselineProcess(engine.model_info.path)  # its own process: one OpenMP team here
        baseline.warm_up(PROMPT_LEN)
        results: dict[int, dict[str, float]] = {}
        single: list = []
        wall = 0.0
        for r in range(args.baseline_requests):
            w, timings = await run_load(engine, token_requests("c1", 2, PROMPT_LEN, OUTPUT_LEN, first=1000 + 2 * r), 1)
            wall += w
            single += timings
            await asyncio.to_thread(baseline.run, synthetic_prompt(r, PROMPT_LEN), OUTPUT_LEN)
        results[1] = summarize(wall, single)
        for c in (8, 32):
            requests = token_requests(f"c{c}", args.num_requests, PROMPT_LEN, OUTPUT_LEN, first=c * 1000)
            wall, timings = await run_load(engine, requests, c)
            results[c] = summarize(wall, timings)
        summary = baseline.summary()
        baseline.close()
        return summary, results, engine.model_info.dtype
    finally:
        engine.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--baseline-requests", type=int, default=8,
                        help="rounds of (2 engine requests at concurrency 1, 1 baseline request)")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    base, results, dtype = asyncio.run(engine_runs(args))

    rows = [["transformers generate (fp32, sequential)", 1, base["tok_s"], "1.00x", base["ttft_p50"] * 1e3, "-",
             base["tpot_p50"] * 1e3, base["tpot_p99"] * 1e3]]
    for c, r in results.items():
        rows.append([f"spark-server engine ({dtype})", c, r["tok_s"], f"{r['tok_s'] / base['tok_s']:.2f}x",
                     r["ttft_p50"] * 1e3, r["ttft_p99"] * 1e3, r["tpot_p50"] * 1e3, r["tpot_p99"] * 1e3])
    print_table(f"Offline: {args.num_requests} requests, {PROMPT_LEN}-token prompts, {OUTPUT_LEN} output tokens",
                ["engine", "concurrency", "output tok/s", "vs baseline", "TTFT p50 ms", "TTFT p99 ms",
                 "TPOT p50 ms", "TPOT p99 ms"], rows)
    speedup = results[32]["tok_s"] / base["tok_s"]
    tpot_ratio = results[1]["tpot_p50"] / base["tpot_p50"]
    print(f"\nthroughput at 32 concurrent: {speedup:.1f}x baseline; TPOT at concurrency 1: {tpot_ratio:.2f}x baseline")
    save("offline", {"baseline": base, "engine": results, "dtype": dtype, "speedup_c32": speedup,
                     "tpot_ratio_c1": tpot_ratio})
    return verdict({"throughput at 32 concurrent >= 20x transformers sequential": speedup >= 20,
                    "TPOT at concurrency 1 <= 0.3x transformers": tpot_ratio <= 0.3})


if __name__ == "__main__":
    sys.exit(main())
