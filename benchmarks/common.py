"""Shared helpers for the benchmarks: engine set-up, load generation, statistics, reporting."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams

RESULTS_DIR = Path(__file__).parent / "results"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass
class RequestTiming:
    ttft: float
    tpot: float | None
    num_tokens: int
    gaps: list[float] = field(default_factory=list)
    text: str = ""
    token_times: list[float] = field(default_factory=list)  # perf_counter() of each output
    gap_starts: list[float] = field(default_factory=list)  # perf_counter() at which each gap began


def synthetic_prompt(i: int, length: int, vocab_lo: int = 200, vocab_hi: int = 40000) -> list[int]:
    """Distinct, deterministic token ids (no shared prefix between requests)."""
    span = vocab_hi - vocab_lo
    return [1] + [vocab_lo + (i * 7919 + j * 104729) % span for j in range(length - 1)]


def wait_for_kv_pool(engine: LLMEngine, timeout_s: float = 60.0) -> None:
    """Wait until the KV pool is resident (engine/resident.py) before measuring, as a server that has
    been up a few idle seconds has it: a load started at once faults fresh KV pages inside its steps
    (in process on AMD EPYC, 32 streams of ~500-token prompts: 422 tok/s against 497-510 once the
    pool was resident), which no served load after start-up pays."""
    prefault = engine.kv_prefault
    if prefault is None:
        return
    start = time.perf_counter()
    resident = prefault.wait(timeout_s)
    print(f"KV pool {'resident' if resident else 'still faulting in'} after {time.perf_counter() - start:.1f} s "
          f"of waiting", flush=True)


def start_engine(**overrides: Any) -> AsyncEngine:
    engine = AsyncEngine.from_config(EngineConfig(**overrides))
    wait_for_kv_pool(engine.engine)
    engine.start()
    return engine


async def timed_request(engine: AsyncEngine, request: GenerationRequest) -> RequestTiming:
    start = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    gap_starts: list[float] = []
    text: list[str] = []
    times: list[float] = []
    n = 0
    async for out in engine.generate(request):
        text.append(out.text_delta)
        if not out.new_token_ids:
            continue
        now = time.perf_counter()
        if first is None:
            first = now
        elif last is not None:
            gaps.append(now - last)
            gap_starts.append(last)
        last = now
        n += len(out.new_token_ids)
        times += [now] * len(out.new_token_ids)
    assert first is not None and last is not None
    tpot = (last - first) / (n - 1) if n > 1 else None
    return RequestTiming(ttft=first - start, tpot=tpot, num_tokens=n, gaps=gaps, text="".join(text),
                         token_times=times, gap_starts=gap_starts)


def steady_decode_rate(timings: list[RequestTiming]) -> float:
    """Tokens/s while every stream is decoding: from the last stream's first token to the first
    stream's last token (prefill of the others is outside this window)."""
    start = max(t.token_times[0] for t in timings)
    end = min(t.token_times[-1] for t in timings)
    if end <= start:
        raise ValueError("the streams never all decoded at once; lengthen the outputs")
    tokens = sum(1 for t in timings for x in t.token_times if start < x <= end)
    return tokens / (end - start)


async def run_load(engine: AsyncEngine, requests: list[GenerationRequest],
                   concurrency: int) -> tuple[float, list[RequestTiming]]:
    """Keep ``concurrency`` requests in flight; returns (wall seconds, per-request timings)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(r: GenerationRequest) -> RequestTiming:
        async with sem:
            return await timed_request(engine, r)

    start = time.perf_counter()
    timings = await asyncio.gather(*(one(r) for r in requests))
    return time.perf_counter() - start, list(timings)


def token_requests(prefix: str, num: int, prompt_len: int, max_tokens: int, first: int = 0,
                   **params: Any) -> list[GenerationRequest]:
    """``num`` requests with the distinct prompts ``first``, ``first + 1``, ... (no shared prefix)."""
    return [GenerationRequest(f"{prefix}-{i}", TokensPrompt(synthetic_prompt(i, prompt_len)),
                              SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))
            for i in range(first, first + num)]


class HFBaseline:
    """transformers `generate`, fp32, batch 1, one request after another (the reference server loop)."""

    def __init__(self, model_path: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.ttfts: list[float] = []
        self.tpots: list[float] = []
        self.tokens = 0
        self.decode_seconds = 0.0

    def run(self, ids: list[int], max_new_tokens: int) -> None:
        torch = self.torch
        x = torch.tensor([ids])
        mask = torch.ones_like(x)
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.model.generate(x, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)
            t1 = time.perf_counter()
            out = self.model.generate(x, attention_mask=mask, max_new_tokens=max_new_tokens,
                                      min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            t2 = time.perf_counter()
        n = out.shape[1] - x.shape[1]
        self.tokens += n
        self.ttfts.append(t1 - t0)
        self.tpots.append(((t2 - t1) - (t1 - t0)) / max(n - 1, 1))
        self.decode_seconds += t2 - t1

    def warm_up(self, prompt_len: int) -> None:
        self.run(synthetic_prompt(10_000, prompt_len), 4)
        self.ttfts, self.tpots, self.tokens, self.decode_seconds = [], [], 0, 0.0

    def summary(self) -> dict[str, float]:
        # throughput counts the long call only (the short one re-runs its prefill)
        return {"tok_s": self.tokens / self.decode_seconds, "ttft_p50": percentile(self.ttfts, 50),
                "tpot_p50": percentile(self.tpots, 50), "tpot_p99": percentile(self.tpots, 99),
                "requests": len(self.tpots)}


def _baseline_worker(model_path: str, conn) -> None:
    baseline = HFBaseline(model_path)
    while True:
        command, args = conn.recv()
        if command == "close":
            return
        conn.send(getattr(baseline, command)(*args))


class HFBaselineProcess:
    """HFBaseline in a child process, for runs beside an engine in this one. libgomp keeps one thread
    team per thread that enters a parallel region; with a second torch-using thread here it counts more
    threads than cores and turns every barrier's spin into a futex sleep, which slowed the engine *and*
    the baseline about 2x (the engine keeps its OpenMP work on its own thread for this reason)."""

    def __init__(self, model_path: str) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_baseline_worker, args=(model_path, child), daemon=True)
        self._proc.start()

    def _call(self, command: str, *args: Any) -> Any:
        self._conn.send((command, args))
        return self._conn.recv()

    def run(self, ids: list[int], max_new_tokens: int) -> None:
        self._call("run", ids, max_new_tokens)

    def warm_up(self, prompt_len: int) -> None:
        self._call("warm_up", prompt_len)

    def summary(self) -> dict[str, float]:
        return self._call("summary")

    def close(self) -> None:
        self._conn.send(("close", ()))
        self._proc.join(timeout=30)


def hf_sequential_baseline(model_path: str, prompts: list[list[int]], max_new_tokens: int) -> dict[str, float]:
    baseline = HFBaseline(model_path)
    for ids in prompts:
        baseline.run(ids, max_new_tokens)
    return baseline.summary()


def summarize(wall: float, timings: list[RequestTiming]) -> dict[str, float]:
    tokens = sum(t.num_tokens for t in timings)
    ttfts = [t.ttft for t in timings]
    tpots = [t.tpot for t in timings if t.tpot is not None]
    return {"tok_s": tokens / wall, "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
            "tpot_p50": percentile(tpots, 50), "tpot_p99": percentile(tpots, 99), "tokens": tokens,
            "wall_s": wall}


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [header] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n## {title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")


def save(name: str, data: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    data = dict(data, machine={"cpus": os.cpu_count()}, when=time.strftime("%Y-%m-%d %H:%M:%S"))
    path.write_text(json.dumps(data, indent=2,
                               default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)))
    return path


def verdict(checks: dict[str, bool]) -> int:
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    return 0 if all(checks.values()) else 1
