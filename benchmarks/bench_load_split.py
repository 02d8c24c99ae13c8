"""Where a serving load's time goes, against what its arithmetic and bytes could take on this CPU.

    python -m benchmarks.bench_load_split [--streams 32] [--requests 64] [--prompt-tokens 230] [--max-tokens 128]
                                          [--loadgen-texts]

Runs the shape of `../shared/peers/compare.py`'s closed loop in process: each of `--streams` clients sends its
next request when its last one finishes, `--requests` in all, distinct synthetic prompts (or, with
`--loadgen-texts`, compare.py's own texts as chat messages), greedy, ignore_eos, on the engine's defaults. Every
step is timed and its batch recorded, and the report gives

- the wall split: steps that prefill (with the decode rows they carry) against decode-only steps; a decoding
  sequence computes a row for its last token and one for each token of its draft, and each counts;
- the work: multiply-adds of the linears (every scheduled token through every projection), of the head (a
  row for each token that needs logits) and of attention (each query against the keys before it), and the
  bytes a step must read (weights, the KV of decoding rows);
- the ceiling: each step at the larger of its multiply-adds at this CPU's arithmetic peak for the kernels'
  own instructions (``spark_bench_dot_peak``: the linears' dot products or FMAs, the greedy head's vpdpbusd) and
  its bytes at the plain-read bandwidth, summed over the steps: the output tokens a second no kernel with
  these instructions and this arithmetic could beat here.

A profiling aid, not a bar: no verdict. It says how far the engine is from its own limits on this CPU, so a
target can be checked against what the machine allows before work goes into it.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.bench_kernels import best_of, cpu_model
from benchmarks.common import token_requests, wait_for_kv_pool
from benchmarks.kernel_bench import bench_kernels, engine_march
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import ChatMessage, ChatPrompt, GenerationRequest
from engine.sampling_params import SamplingParams

# compare.py's load generator, beside the checkout: its texts are what the peers are measured on
LOADGEN = Path(__file__).resolve().parents[2] / "shared" / "peers" / "loadgen.py"


@dataclass
class StepWork:
    """One engine step: what it computed and how long it took."""

    prefill_tokens: int = 0
    decode_rows: int = 0  # every row a decoding sequence computes: its last token and its draft's tokens
    draft_rows: int = 0
    logits_rows: int = 0
    prefill_query_keys: int = 0  # sum over the prompt tokens of the keys each attends to
    decode_keys: int = 0  # sum over the decoding rows of their context lengths
    seconds: float = 0.0


@dataclass
class ModelCosts:
    """Per-token and per-step costs read off the loaded model."""

    linear_macs_per_token: int
    head_macs_per_row: int
    attention_macs_per_query_key: int
    weight_bytes: int  # every projection, read once a step
    head_bytes: int  # read once by a step with logits rows
    kv_bytes_per_key: int
    head_kind: str  # the instruction the head's multiply-adds run on
    linear_kind: str


@dataclass
class Peaks:
    rates: dict[str, float] = field(default_factory=dict)  # multiply-adds a second by instruction kind
    read_bytes_per_s: float = 0.0


def _bytes(linear: object) -> int:
    packed = getattr(linear, "packed", None)
    if packed is not None:
        return packed.data.numel() * packed.data.element_size()
    weight = linear.weight  # type: ignore[attr-defined]
    return weight.numel() * weight.element_size()


def model_costs(engine: LLMEngine) -> ModelCosts:
    model = engine.runner.model
    kernels = model.kernels
    projections = [lin for layer in model.projections() for lin in layer.values()]
    head = model.lm_head
    greedy = model.greedy_head
    if greedy is not None:
        head_bytes = greedy.codes.numel() + greedy.meta.numel() * greedy.meta.element_size()
    else:
        head_bytes = _bytes(head)
    linear_kind = kernels.linear_path if kernels is not None and kernels.linear_path else "fma"
    return ModelCosts(
        linear_macs_per_token=sum(lin.in_features * lin.out_features for lin in projections),
        head_macs_per_row=head.in_features * head.out_features,
        attention_macs_per_query_key=2 * model.num_heads * model.head_dim * model.num_layers,
        weight_bytes=sum(_bytes(lin) for lin in projections),
        head_bytes=head_bytes,
        kv_bytes_per_key=model.kv_bytes_per_token(),
        head_kind="vnni" if greedy is not None else linear_kind,
        linear_kind=linear_kind,
    )


def measure_peaks(engine: LLMEngine, kinds: set[str]) -> Peaks:
    kernels = engine.runner.model.kernels
    peaks = Peaks()
    if kernels is None:
        return peaks
    bench = bench_kernels(march=engine_march(kernels))  # the measuring-only entry points (a compiled library)
    for kind in kinds:
        rate = bench.dot_peak(kind)
        if rate:
            peaks.rates[kind] = rate
    buffer = torch.ones(64 << 20, dtype=torch.float64)  # 512 MB: far past any cache
    peaks.read_bytes_per_s = buffer.numel() * 8 / best_of(lambda: kernels.read_sum(buffer), 5)
    return peaks


def step_phases(step: StepWork, costs: ModelCosts, peaks: Peaks) -> list[tuple[float, float]]:
    """(arithmetic seconds, memory seconds) of a step's three phases at this CPU's peaks: the linears, attention,
    the head."""
    tokens = step.prefill_tokens + step.decode_rows
    linear_rate = peaks.rates[costs.linear_kind]
    linears = (tokens * costs.linear_macs_per_token / linear_rate, costs.weight_bytes / peaks.read_bytes_per_s)
    attention = ((step.prefill_query_keys + step.decode_keys) * costs.attention_macs_per_query_key / linear_rate,
                 step.decode_keys * costs.kv_bytes_per_key / peaks.read_bytes_per_s)
    head = ((step.logits_rows * costs.head_macs_per_row / peaks.rates.get(costs.head_kind, linear_rate),
             costs.head_bytes / peaks.read_bytes_per_s) if step.logits_rows else (0.0, 0.0))
    return [linears, attention, head]


def ceilings(steps: list[StepWork], costs: ModelCosts, peaks: Peaks) -> tuple[float, float]:
    """Seconds of the whole load at the peaks: each step's arithmetic and bytes fully overlapped (a hard
    bound), and its phases one after another, each at the larger of its two (as the kernels run them)."""
    overlapped = phased = 0.0
    for step in steps:
        phases = step_phases(step, costs, peaks)
        overlapped += max(sum(a for a, _ in phases), sum(m for _, m in phases))
        phased += sum(max(a, m) for a, m in phases)
    return overlapped, phased


def loadgen_requests(requests: int, prompt_tokens: int, max_tokens: int) -> list[GenerationRequest]:
    """compare.py's own requests: loadgen's texts (seeds 0 ...) as chat messages, greedy, ignore_eos, min_tokens
    = max_tokens, as loadgen sends them. Their answers repeat their prompts less than the synthetic token
    prompts' do, so fewer drafts hold."""
    spec = importlib.util.spec_from_file_location("loadgen", LOADGEN)
    if spec is None or spec.loader is None or not LOADGEN.exists():
        raise SystemExit(f"--loadgen-texts needs {LOADGEN} (../shared beside the checkout)")
    loadgen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loadgen)
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return [GenerationRequest(f"load-{i}", ChatPrompt([ChatMessage("user", loadgen.build_prompt(prompt_tokens, i))]),
                              params) for i in range(requests)]


def run_load(engine: LLMEngine, streams: int, requests: int, prompt_tokens: int, max_tokens: int,
             loadgen_texts: bool = False) -> list[StepWork]:
    """The closed loop; returns every step's work and time."""
    scheduler = engine.scheduler
    schedule = scheduler.schedule
    steps: list[StepWork] = []

    def recording_schedule():  # what each step computes, read off its batch before it runs
        batch = schedule()
        current = steps[-1]
        for seq, n in batch.prefills:
            start = seq.num_computed_tokens
            current.prefill_tokens += n
            current.prefill_query_keys += n * start + n * (n + 1) // 2
            current.logits_rows += start + n >= len(seq.token_ids)
        for seq in batch.decodes:  # a draft row costs what a decode row does, kept or not
            rows = 1 + len(seq.draft_token_ids)
            current.decode_rows += rows
            current.draft_rows += rows - 1
            current.decode_keys += rows * (seq.num_computed_tokens + 1) + rows * (rows - 1) // 2
            current.logits_rows += rows
        return batch

    scheduler.schedule = recording_schedule
    pending = (loadgen_requests(requests, prompt_tokens, max_tokens) if loadgen_texts
               else token_requests("load", requests, prompt_tokens, max_tokens, temperature=0.0))
    pending.reverse()
    for _ in range(min(streams, len(pending))):
        engine.add_request(pending.pop())
    gc.collect()
    gc.freeze()  # as the server does after start-up
    try:
        while engine.has_unfinished():
            steps.append(StepWork())
            start = time.perf_counter()
            outputs = engine.step()
            steps[-1].seconds = time.perf_counter() - start
            for output in outputs:
                if output.finished and pending:
                    engine.add_request(pending.pop())
    finally:
        scheduler.schedule = schedule
        gc.unfreeze()
    return steps


def add_load_arguments(ap: argparse.ArgumentParser) -> None:
    """The closed loop's shape (run_load), as this bench and bench_layers_ab take it."""
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=230)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--loadgen-texts", action="store_true",
                    help="compare.py's prompts (../shared/peers/loadgen.py) instead of synthetic token ids")


def warmed_engine(streams: int, prompt_tokens: int) -> LLMEngine:
    """An engine on its defaults for ``streams`` streams, its KV pool resident and two short requests run
    (kernels built, pages touched), as a server that has been up a while."""
    engine = LLMEngine(EngineConfig(max_num_seqs=max(64, streams)))
    wait_for_kv_pool(engine)
    for request in token_requests("warm", 2, prompt_tokens, 4, first=10_000):
        engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_load_arguments(ap)
    args = ap.parse_args()
    engine = warmed_engine(args.streams, args.prompt_tokens)
    costs = model_costs(engine)
    steps = run_load(engine, args.streams, args.requests, args.prompt_tokens, args.max_tokens, args.loadgen_texts)
    if engine.runner.model.kernels is None:
        print("no native kernels here (SPARK_NATIVE_KERNELS=0 or no compiler): no peak to compare against")
        return
    peaks = measure_peaks(engine, {costs.linear_kind, costs.head_kind})
    if costs.linear_kind not in peaks.rates:
        print(f"no {costs.linear_kind} instruction in this build of the kernels: no peak to compare against")
        return
    wall = sum(s.seconds for s in steps)
    output_tokens = args.requests * args.max_tokens
    prefill_steps = [s for s in steps if s.prefill_tokens]
    decode_steps = [s for s in steps if not s.prefill_tokens]
    overlapped_s, phased_s = ceilings(steps, costs, peaks)
    print(f"CPU: {cpu_model()}; torch threads {torch.get_num_threads()}; {args.streams} streams, "
          f"{args.requests} requests of {args.prompt_tokens} prompt + {args.max_tokens} output tokens")
    print("peaks: " + ", ".join(f"{kind} {rate / 1e9:.0f} G multiply-adds/s"
                                for kind, rate in sorted(peaks.rates.items()))
          + f"; plain read {peaks.read_bytes_per_s / 1e9:.1f} GB/s")
    print(f"work: linears {costs.linear_macs_per_token / 1e6:.1f} M multiply-adds a token ({costs.linear_kind}), "
          f"head {costs.head_macs_per_row / 1e6:.1f} M a row ({costs.head_kind}), weights "
          f"{costs.weight_bytes / 1e6:.0f} MB + head {costs.head_bytes / 1e6:.0f} MB a step, "
          f"KV {costs.kv_bytes_per_key} B a key")
    for name, group in (("steps that prefill", prefill_steps), ("decode-only steps", decode_steps)):
        seconds = sum(s.seconds for s in group)
        print(f"{name}: {len(group)}, {seconds:.2f} s ({100 * seconds / wall:.0f}% of the wall), "
              f"{sum(s.prefill_tokens for s in group)} prompt tokens, {sum(s.decode_rows for s in group)} decode rows "
              f"({sum(s.draft_rows for s in group)} of them drafts)")
    speculator = engine.speculator
    if speculator is not None and speculator.num_drafted:
        kept = 100 * speculator.num_accepted / speculator.num_drafted
        print(f"drafts: {speculator.num_drafted} tokens drafted, {kept:.0f}%"
              " kept (the run's and the warm-up's)")
    print(f"ceiling: {overlapped_s:.3f} s with each step's arithmetic and bytes overlapped "
          f"({output_tokens / overlapped_s:.0f} output tok/s); {phased_s:.3f} s with its phases in sequence "
          f"({output_tokens / phased_s:.0f} output tok/s)")
    print(f"measured: {wall:.3f} s, {output_tokens / wall:.0f} output tok/s: "
          f"{100 * overlapped_s / wall:.0f}% / {100 * phased_s / wall:.0f}% of the ceilings")

if __name__ == "__main__":
    main()
