"""Online: the offline load through the Spark WebSocket (a real `spark-server serve` process, real
websockets clients in this one).
Spark has no ignore_eos, so answers end where the model stops; throughput counts completion_tokens
from each session's usage. Concurrency 1, 8 and 32.

    python -m benchmarks.bench_online [--num-requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time

import websockets

from benchmarks.common import percentile, print_table, save, verdict
from benchmarks.plots import plot_file

QUESTIONS = ["Write a long story about a lighthouse keeper.", "Explain how airplanes fly, in detail.",
             "Describe the history of the printing press.", "Write a detailed recipe for bread.",
             "请详细介绍一下中国的四大发明。", "Give me a long list of tips for learning a language."]


async def session(url: str, i: int) -> tuple[float, float | None, int]:
    body = {"header": {"traceId": f"bench-{i}"},
            "parameter": {"chat": {"max_tokens": 128, "temperature": 0.8, "top_k": 6}},
            "payload": {"message": {"text": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}]}}}
    start = time.perf_counter()
    first: float | None = None
    last: float | None = None
    frames = 0
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps(body, ensure_ascii=False))
        async for message in ws:
            frame = json.loads(message)
            assert frame["header"]["code"] == 0, frame
            now = time.perf_counter()
            first = first or now
            last = now
            frames += 1
            if frame["header"]["status"] == 2:
                tokens = frame["payload"]["usage"]["text"]["completion_tokens"]
    if first is None or last is None:
        raise RuntimeError(f"session {i}: the stream ended before its first frame")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return first - start, tpot, tokens


async def start_server(port: int) -> subprocess.Popen:
    """`spark-server serve` in its own process, as deployed: the clients here do not share its GIL."""
    import httpx

    # Popen returns at once (the server starts in the background): nothing here blocks the loop.
    proc = subprocess.Popen([sys.executable,  # noqa: ASYNC220 "-m", "spark_server", "serve", "--port", str(port), "--max-num-seqs",
                             "64", "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError("the server exited during start-up")
            try:
                if (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                    return proc
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server was not ready in 180 s")


async def run(args) -> dict:
    from spark_server.app import SPARK_WS_PATH

    proc = await start_server(args.port)
    url = f"ws://127.0.0.1:{args.port}{SPARK_WS_PATH}"
    results = {}
    try:
        for c in (1, 8, 32):
            n = args.c1_requests if c == 1 else args.num_requests
            sem = asyncio.Semaphore(c)

            async def one(i: int):
                async with sem:
                    return await session(url, i)

            start = time.perf_counter()
            out = await asyncio.gather(*(one(i) for i in range(n)))
            wall = time.perf_counter() - start
            tokens = sum(t for _, _, t in out)
            results[c] = {"tok_s": tokens / wall, "ttft_p50": percentile([a for a, _, _ in out], 50),
                          "ttft_p99": percentile([a for a, _, _ in out], 99),
                          "tpot_p50": percentile([b for _, b, _ in out if b], 50),
                          "tpot_p99": percentile([b for _, b, _ in out if b], 99), "tokens": tokens}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--c1-requests", type=int, default=8)
    parser.add_argument("--port", type=int, default=9993)
    args = parser.parse_args()
    results = asyncio.run(run(args))
    rows = [[c, r["tok_s"], r["tokens"], r["ttft_p50"] * 1e3, r["ttft_p99"] * 1e3, r["tpot_p50"] * 1e3,
             r["tpot_p99"] * 1e3] for c, r in results.items()]
    print_table("Online: Spark WebSocket sessions (max_tokens 128, temperature 0.8, top_k 6)",
                ["concurrency", "output tok/s", "tokens", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                 "TPOT p99 ms"], rows)
    path = save("online", {"results": results})
    for picture in plot_file(path, "Spark WebSocket sessions, max_tokens 128"):
        print(f"wrote {picture}")
    return verdict({"online throughput grows with concurrency": results[32]["tok_s"] > results[1]["tok_s"] * 4})


if __name__ == "__main__":
    sys.exit(main())
