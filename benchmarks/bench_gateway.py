"""Gateway overhead: what a model-less front end (`serve --engine-url`) adds in front of a replica.

One replica and one front end over it, both real `spark-server serve` processes. The same streamed
OpenAI chat load (ignore_eos, fixed length) goes to the replica directly and through the front end,
in alternating rounds so both see the same minutes of this shared machine. Reported: TTFT p50 of each
path and the difference, and CPU seconds per 1,000 streamed tokens of the front end (its own process)
beside the replica's.

    python -m benchmarks.bench_gateway [--rounds 3 --requests 16 --concurrency 4 --max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.common import percentile, print_table, save, verdict

QUESTIONS = ["Write a story about a lighthouse.", "Explain how a bicycle works.", "Describe a busy market.",
             "Tell me about the history of paper.", "Write a poem about rain.", "Describe a mountain hike."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(port: int, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "spark_server", "serve", "--port", str(port), "--log-level",
                             "warning", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server on {port} exited during start-up")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server on {port} not ready in 180 s")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (and its reaped children), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


async def one(client: httpx.AsyncClient, base: str, i: int, max_tokens: int) -> tuple[float, int]:
    body = {"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.7, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content") and ttft is None:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    assert ttft is not None
    return ttft, tokens


async def phase(base: str, n: int, concurrency: int, max_tokens: int, first: int) -> tuple[list[float], int]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:
        async def run(i: int):
            async with sem:
                return await one(client, base, i, max_tokens)
        out = await asyncio.gather(*(run(first + i) for i in range(n)))
    return [t for t, _ in out], sum(k for _, k in out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    rp, fp = free_port(), free_port()
    replica = start(rp)
    front = start(fp, "--engine-url", f"http://127.0.0.1:{rp}")
    direct_url, front_url = f"http://127.0.0.1:{rp}", f"http://127.0.0.1:{fp}"
    ttft: dict[str, list[float]] = {"direct": [], "front": []}
    tokens = {"direct": 0, "front": 0}
    cpu = {"front end": 0.0, "replica (direct)": 0.0}
    try:
        asyncio.run(phase(front_url, 4, 4, 8, 10_000))  # warm both
        for r in range(args.rounds):
            for path, base in (("direct", direct_url), ("front", front_url)):
                before = (cpu_seconds(front.pid), cpu_seconds(replica.pid))
                times, n = asyncio.run(phase(base, args.requests, args.concurrency, args.max_tokens,
                                             r * 1000 + (0 if path == "direct" else 500)))
                after = (cpu_seconds(front.pid), cpu_seconds(replica.pid))
                ttft[path] += times
                tokens[path] += n
                if path == "front":
                    cpu["front end"] += after[0] - before[0]
                else:
                    cpu["replica (direct)"] += after[1] - before[1]
    finally:
        for p in (front, replica):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    p50 = {k: percentile(v, 50) * 1e3 for k, v in ttft.items()}
    per_1k = {"front end": cpu["front end"] / tokens["front"] * 1000,
              "replica (direct)": cpu["replica (direct)"] / tokens["direct"] * 1000}
    print_table(f"Gateway overhead: {args.rounds} rounds x {args.requests} streams of {args.max_tokens} tokens, "
                f"concurrency {args.concurrency}",
                ["path", "TTFT p50 ms", "tokens", "CPU s / 1000 tokens"],
                [["direct to the replica", p50["direct"], tokens["direct"], per_1k["replica (direct)"]],
                 ["through the front end", p50["front"], tokens["front"], per_1k["front end"]]])
    added = p50["front"] - p50["direct"]
    print(f"\nadded TTFT p50: {added:.1f} ms; front end CPU per 1000 tokens: {per_1k['front end']:.3f} s "
          f"({per_1k['front end'] / per_1k['replica (direct)']:.1%} of the replica's)")
    save("gateway", {"ttft_p50_ms": p50, "added_ttft_p50_ms": added, "cpu_s_per_1k_tokens": per_1k,
                     "tokens": tokens, "args": vars(args)})
    return verdict({"the front end costs under a quarter of the replica's CPU per token":
                    per_1k["front end"] < 0.25 * per_1k["replica (direct)"],
                    "the front end adds under 50 ms to TTFT p50": added < 50.0})


if __name__ == "__main__":
    sys.exit(main())
