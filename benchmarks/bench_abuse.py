"""One client must not stall the server: a steady Spark stream runs beside each abusive request, and
we report the stream's largest gap between frames while the abuse is in flight, the server's peak
RSS against its idle RSS, and how fast the abuse was answered (and with which code). Then the attack
corpus (tests/fuzz/attacks.py), one row per attack beside a steady streamed completion: the answer,
seconds, the victim's largest gap, and the server's (and its grammar worker's) peak RSS against idle.

Bars: largest gap under 1 s (the corpus: 1 s plus the victim's own largest gap alone), peak RSS under
1.5x idle (the corpus: RSS back within 10% after each attack), every abusive request answered with its
documented code within 2 s.

    python -m benchmarks.bench_abuse
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import websockets

from benchmarks.common import print_table, save, verdict
from tests.fuzz import attacks as attack_corpus

MODEL = "SmolLM2-135M-Instruct"
MAX_GAP_S, MAX_RSS_RATIO, MAX_ANSWER_S = 1.0, 1.5, 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _settled_rss(pid: int) -> int:
    """The server's RSS once it has stopped growing: after start its KV pool is made resident on idle CPU
    time (engine/resident.py), which is the idle state abuse is measured against, not abuse's doing."""
    return await attack_corpus.settled_rss(pid, limit_s=90.0, step_bytes=8 << 20)


class RssSampler:
    """The server's (and its grammar worker's) peak RSS between start() and stop(), sampled every 5 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.peak = attack_corpus.tree_rss(self.pid)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, attack_corpus.tree_rss(self.pid))
            time.sleep(0.005)

    def stop(self) -> int:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        return self.peak


def _spark(content: Any, **chat: Any) -> dict[str, Any]:
    return {"header": {"traceId": "bench-abuse"}, "parameter": {"chat": {"top_k": 1, **chat}},
            "payload": {"message": {"text": content if isinstance(content, list) else
                                    [{"role": "user", "content": content}]}}}


@dataclass
class Abuse:
    name: str
    send: Callable[[str, str], Awaitable[tuple[int, str]]]  # (base url, ws url) -> (code or status, message)
    expected: int


def _http(path: str, body: bytes) -> Callable[[str, str], Awaitable[tuple[int, str]]]:
    async def send(base: str, _: str) -> tuple[int, str]:
        async with httpx.AsyncClient(timeout=120) as client:
            resp = await client.post(base + path, content=body, headers={"Content-Type": "application/json"})
        return resp.status_code, resp.text[:160]
    return send


def _ws(frame: str) -> Callable[[str, str], Awaitable[tuple[int, str]]]:
    async def send(_: str, ws_url: str) -> tuple[int, str]:
        async with websockets.connect(ws_url, max_size=None) as ws:
            await ws.send(frame)
            last = json.loads([m async for m in ws][-1])
        return last["header"]["code"], last["header"]["message"][:160]
    return send


def abuses() -> list[Abuse]:
    ids_3_9m = [i % 10 for i in range(3_900_000)]  # single digits, compact: 7.4 MiB, under the 8 MiB body limit
    bad_message = {"role": 1, "content": 2}
    return [
        Abuse("/v1/completions, 3.9M-id prompt", _http("/v1/completions", json.dumps(
            {"model": MODEL, "prompt": ids_3_9m, "max_tokens": 4}, separators=(",", ":")).encode()), 400),
        Abuse("Spark frame, 140k invalid messages", _ws(json.dumps(_spark([bad_message] * 140_000))), 10000),
        Abuse("Triton /infer, 1M ids", _http(f"/v2/models/{MODEL}/infer", json.dumps(
            {"inputs": [{"name": "input0", "shape": [1, 1 << 20], "datatype": "UINT32", "data": ids_3_9m[:1 << 20]}],
             "outputs": [{"name": "output0"}]}).encode()), 400),
        Abuse("chat, 100k bad words", _http("/v1/chat/completions", json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
             "bad_words": [f"w{i}" for i in range(100_000)]}).encode()), 400),
        Abuse("Spark content, 4.4 MiB", _ws(json.dumps(_spark("word " * (int(4.4 * (1 << 20)) // 5)))), 10003),
    ]


async def steady_stream(ws_url: str, frame_times: list[float], stop: asyncio.Event) -> None:
    """Spark sessions one after another, recording when each frame arrives, until ``stop``."""
    question = "Count from one to two hundred, one number per line."
    while not stop.is_set():
        async with websockets.connect(ws_url) as ws:
            await ws.send(json.dumps(_spark(question, max_tokens=400)))
            async for _ in ws:
                frame_times.append(time.perf_counter())
                if stop.is_set():
                    break


async def measure(abuse: Abuse, base: str, ws_url: str, rss: RssSampler) -> dict[str, Any]:
    frames: list[float] = []
    stop = asyncio.Event()
    streamer = asyncio.create_task(steady_stream(ws_url, frames, stop))
    while len(frames) < 20:  # the stream is decoding
        await asyncio.sleep(0.01)
    rss.start()
    sent = time.perf_counter()
    code, message = await abuse.send(base, ws_url)
    answered = time.perf_counter()
    await asyncio.sleep(0.5)  # the stream after the answer
    peak = rss.stop()
    stop.set()
    await streamer
    window = [t for t in frames if sent - 0.2 <= t <= answered + 0.5]
    gaps = [b - a for a, b in itertools.pairwise(window)]
    return {"answer_s": answered - sent, "code": code, "message": message, "max_gap_s": max(gaps, default=float("inf")),
            "frames_in_window": len(window), "peak_rss": peak}


def main() -> int:
    port = _free_port()
    base, ws_url = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/turing/v3/gpt"
    proc = subprocess.Popen([sys.executable, "-m", "spark_server", "serve", "--port", str(port),
                             "--log-level", "warning", *attack_corpus.SERVER_ARGS], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("server did not start")
            time.sleep(0.1)
        cases = abuses()
        rss = RssSampler(proc.pid)

        async def run() -> tuple[int, list[dict[str, Any]], float, list[attack_corpus.Outcome]]:
            frames: list[float] = []
            stop = asyncio.Event()
            warm = asyncio.create_task(steady_stream(ws_url, frames, stop))  # warm up, then read idle RSS
            while len(frames) < 40:
                await asyncio.sleep(0.01)
            stop.set()
            await warm
            idle = await _settled_rss(proc.pid)
            results = [await measure(c, base, ws_url, rss) for c in cases]
            victim = attack_corpus.Victim(base)
            await victim.start()
            alone = time.perf_counter()
            await asyncio.sleep(3.0)
            baseline = victim.largest_gap(alone, time.perf_counter())
            outcomes = await attack_corpus.run_corpus(attack_corpus.corpus(), base, ws_url, proc.pid, victim)
            await victim.stop()
            return idle, results, baseline, outcomes

        idle, results, baseline_gap, outcomes = asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    rows, checks = [], {}
    for case, r in zip(cases, results):
        ratio = r["peak_rss"] / idle
        rows.append([case.name, r["code"], f"{r['answer_s']:.2f}", f"{r['max_gap_s']:.3f}", r["frames_in_window"],
                     f"{r['peak_rss'] / (1 << 20):.0f}", f"{ratio:.2f}"])
        checks[f"{case.name}: answered {case.expected} within {MAX_ANSWER_S:g} s"] = (
            r["code"] == case.expected and r["answer_s"] < MAX_ANSWER_S)
        checks[f"{case.name}: largest stream gap under {MAX_GAP_S:g} s"] = r["max_gap_s"] < MAX_GAP_S
        checks[f"{case.name}: peak RSS under {MAX_RSS_RATIO:g}x idle"] = ratio < MAX_RSS_RATIO
    print_table(f"Abuse beside a steady Spark stream (idle RSS {idle / (1 << 20):.0f} MiB)",
                ["abusive request", "code", "answered in s", "largest gap s", "frames", "peak RSS MiB", "x idle"],
                rows)
    corpus_rows = []
    for o in outcomes:
        a = o.attack
        corpus_rows.append([a.name, a.budget, o.reply.status, f"{o.answer_s:.2f}", f"{o.victim_gap_s:.3f}",
                            f"{o.rss_peak / (1 << 20):.0f}", f"{o.rss_peak / idle:.2f}",
                            f"{o.rss_after / o.rss_before:.3f}"])
        checks[f"{a.name}: answered {'/'.join(map(str, a.expect_status))}"] = (
            o.reply.status in a.expect_status and a.expect_text.lower() in o.reply.text.lower())
        checks[f"{a.name}: victim's largest gap under 1 s + {baseline_gap:.2f} s"] = o.victim_gap_s < 1 + baseline_gap
        checks[f"{a.name}: RSS back within 10%"] = o.rss_after <= 1.1 * o.rss_before
    print_table(f"The attack corpus beside a steady streamed completion (its largest gap alone {baseline_gap:.3f} s)",
                ["attack", "budget", "answer", "answered in s", "victim's largest gap s", "peak RSS MiB",
                 "peak / idle", "after / before"], corpus_rows)
    save("abuse", {"idle_rss": idle, "results": [dict(name=c.name, **r) for c, r in zip(cases, results)],
                   "corpus_baseline_gap_s": baseline_gap,
                   "corpus": [{"name": o.attack.name, "budget": o.attack.budget, "status": o.reply.status,
                               "message": o.reply.text[:200], "answer_s": o.answer_s, "victim_gap_s": o.victim_gap_s,
                               "rss_before": o.rss_before, "rss_peak": o.rss_peak, "rss_after": o.rss_after}
                              for o in outcomes]})
    return verdict(checks)


if __name__ == "__main__":
    sys.exit(main())
