"""Memory: 64 requests with 2,000-token contexts under a KV budget that holds 16 of them. Every
request must finish (queued, or preempted and recomputed), none fails, and afterwards no KV block
is in use.

    python -m benchmarks.bench_memory
"""

from __future__ import annotations

import asyncio
import sys
import time

from benchmarks.common import print_table, run_load, save, start_engine, token_requests, verdict

NUM_REQUESTS = 64
PROMPT_LEN = 1872
OUTPUT_LEN = 128
FITS = 16
BLOCK = 16


async def run() -> dict:
    num_blocks = FITS * (PROMPT_LEN + OUTPUT_LEN) // BLOCK
    engine = start_engine(num_kv_blocks=num_blocks, block_size=BLOCK, max_num_seqs=64)
    try:
        start = time.perf_counter()
        failures = 0
        try:
            _, timings = await run_load(engine, token_requests("mem", NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN),
                                           NUM_REQUESTS)
        except Exception as exc:  # any failed request fails the benchmark
            print(f"request failed: {exc!r}")
            failures += 1
            timings = []
        await asyncio.sleep(0.5)
        core = engine.engine
        return {"num_blocks": num_blocks, "finished": sum(1 for t in timings if t.num_tokens == OUTPUT_LEN),
                "failures": failures, "preemptions": core.scheduler.num_preemptions,
                "blocks_in_use_after": core.block_manager.num_used_blocks, "running_after": core.num_running,
                "wall_s": time.perf_counter() - start}
    finally:
        engine.shutdown()


def main() -> int:
    r = asyncio.run(run())
    print_table(f"Memory: {NUM_REQUESTS} requests x {PROMPT_LEN + OUTPUT_LEN}-token contexts, KV budget for {FITS}",
                ["KV blocks", "finished", "failed", "preemptions", "blocks in use after", "wall s"],
                [[r["num_blocks"], r["finished"], r["failures"], r["preemptions"], r["blocks_in_use_after"],
                  r["wall_s"]]])
    save("memory", r)
    return verdict({"all 64 requests finish with full output": r["finished"] == NUM_REQUESTS and not r["failures"],
                    "no KV block in use afterwards": r["blocks_in_use_after"] == 0 and r["running_after"] == 0})


if __name__ == "__main__":
    sys.exit(main())
