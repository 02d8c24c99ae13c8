"""Interactivity: while 16 streams decode, a 2,000-token prompt arrives. The running streams' token
gaps must stay even: p99 gap under 3x their median gap (chunked prefill, capped while decoding).

    python -m benchmarks.bench_interactivity [--temperature 0] [--stream-tokens N] [--streams S]

The streams' prompts are 200 tokens, then 1,500 (`--stream-tokens N`: that length alone): the long-prefill
cap counts each decoding stream's attention over its context (engine/scheduler.py), so beside streams deep
into long contexts it hands the arriving prompt more tokens a step, and the bar must hold there too.
`--temperature 0` makes the streams greedy: they then speculate (prompt lookup), so a decode step carries
their draft rows too and costs more, while the cap leaves draft rows out: the bar must hold both ways.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from benchmarks.common import percentile, print_table, save, start_engine, timed_request, token_requests, verdict

STREAMS = 16
LONG_PROMPT = 2000
STREAM_TOKENS = (200, 1500)  # the decoding streams' prompt lengths, one run each


async def run(temperature: float, stream_tokens: int = STREAM_TOKENS[0], num_streams: int = STREAMS) -> dict:
    engine = start_engine()
    try:
        await timed_request(engine, token_requests("warm", 1, 64, 4)[0])
        streams = token_requests("stream", num_streams, stream_tokens, 160, temperature=temperature)
        tasks = [asyncio.create_task(timed_request(engine, r)) for r in streams]
        scheduler = engine.engine.scheduler
        for _ in range(300):  # until every stream decodes (the arrival burst is prefilled first)
            await asyncio.sleep(0.1)
            if len(scheduler.running) == num_streams and all(s.num_uncomputed_tokens == 1 for s in scheduler.running):
                break
        await asyncio.sleep(0.2)
        long_req = token_requests("long", 1, LONG_PROMPT, 16, first=500)[0]  # shares no prefix
        long_sent = time.perf_counter()
        long_timing = await timed_request(engine, long_req)
        timings = await asyncio.gather(*tasks)
        # The bar is about the streams while they all decode: gaps from the moment the last of them
        # has its first token (the arrival burst before that is reported, not judged).
        steady_from = max(t.token_times[0] for t in timings)
        if steady_from > long_sent:
            raise RuntimeError("the long prompt arrived before all streams decoded; lengthen the wait")
        gaps = [g for t in timings for g, began in zip(t.gaps, t.gap_starts) if began >= steady_from]
        all_gaps = [g for t in timings for g in t.gaps]
        return {"median_gap": percentile(gaps, 50), "p99_gap": percentile(gaps, 99), "max_gap": max(gaps),
                "long_ttft": long_timing.ttft, "num_gaps": len(gaps),
                "all_gaps_ratio": percentile(all_gaps, 99) / percentile(all_gaps, 50),
                "threshold": engine.engine.scheduler.long_prefill_token_threshold}
    finally:
        engine.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--temperature", type=float, default=1.0, help="the decoding streams' (0: greedy)")
    ap.add_argument("--stream-tokens", type=int, default=None,
                    help=f"the decoding streams' prompt tokens (default: {' and '.join(map(str, STREAM_TOKENS))})")
    ap.add_argument("--streams", type=int, default=STREAMS, help="how many streams decode")
    args = ap.parse_args()
    lengths = (args.stream_tokens,) if args.stream_tokens else STREAM_TOKENS
    results = {n: asyncio.run(run(args.temperature, n, args.streams)) for n in lengths}
    rows = []
    for n, r in results.items():
        r["ratio"] = r["p99_gap"] / r["median_gap"]
        rows.append([n, r["median_gap"] * 1e3, r["p99_gap"] * 1e3, r["max_gap"] * 1e3, f"{r['ratio']:.2f}",
                     r["long_ttft"] * 1e3, f"{r['all_gaps_ratio']:.2f}"])
    threshold = next(iter(results.values()))["threshold"]
    print_table(f"Interactivity: {args.streams} decoding streams, a {LONG_PROMPT}-token prompt arrives "
                f"(long-prefill cap at least {threshold} tokens/step, streams at temperature {args.temperature:g})",
                ["stream prompt tokens", "median gap ms", "p99 gap ms", "max gap ms", "p99 / median",
                 "long prompt TTFT ms", "p99 / median incl. the arrival burst"], rows)
    save("interactivity" if args.temperature == 1.0 else f"interactivity-t{args.temperature:g}",
         {"temperature": args.temperature, "streams": args.streams, "runs": {str(n): r for n, r in results.items()}})
    return verdict({f"p99 token gap < 3x median while a 2,000-token prompt is prefilled beside {n}-token streams":
                    r["ratio"] < 3 for n, r in results.items()})


if __name__ == "__main__":
    sys.exit(main())
