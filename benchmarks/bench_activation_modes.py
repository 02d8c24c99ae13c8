"""Prompt-heavy loads under each ``--linear-activations`` mode, in process, on one model file.

    python -m benchmarks.bench_activation_modes [--model FILE.gguf] [--loads 4x1000+16,8x200+32]
                                                [--modes bf16,int8-prompt,int8]

Each load is N distinct synthetic prompts of P tokens with O tokens out each (``NxP+O``), all submitted at
once, sampled at temperature 0.7 with ignore_eos; the prefix cache is off, so every prompt is computed. Each
mode gets a fresh engine (4-bit weights: ``--quantization gguf``), its KV pool resident and a short warm-up
answer, then the loads in order, on the same prompts as every other mode. A profiling aid with no bar: the
time of each load per mode, and its speed-up over the first mode.
"""

from __future__ import annotations

import argparse
import gc
import time

from benchmarks.bench_kernels import cpu_model
from benchmarks.common import save, token_requests, wait_for_kv_pool
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest


def parse_load(text: str) -> tuple[int, int, int]:
    count, rest = text.split("x")
    prompt, out = rest.split("+")
    return int(count), int(prompt), int(out)


def run(engine: LLMEngine, batch: list[GenerationRequest]) -> float:
    started = time.perf_counter()
    for request in batch:
        engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    parser.add_argument("--loads", default="4x1000+16,8x200+32")
    parser.add_argument("--modes", default="bf16,int8-prompt,int8")
    args = parser.parse_args()
    loads = [parse_load(text) for text in args.loads.split(",")]
    modes = args.modes.split(",")
    times: dict[str, list[float]] = {}
    for mode in modes:
        engine = LLMEngine(EngineConfig(model=args.model, dtype="bfloat16", quantization="gguf",
                                        linear_activations=mode, enable_prefix_caching=False))
        wait_for_kv_pool(engine)
        run(engine, token_requests("warm-up", 1, 100, 4, first=10_000))
        first = 0  # each load's prompts distinct from the others'
        times[mode] = []
        for i, (count, prompt, out) in enumerate(loads):
            times[mode].append(run(engine, token_requests(f"load{i}", count, prompt, out, first=first,
                                                          temperature=0.7, seed=0)))
            first += count
        del engine
        gc.collect()
    print(f"CPU: {cpu_model()}; model: {args.model or 'embedded'}")
    print(f"{'load':14}" + "".join(f"{mode:>22}" for mode in modes))
    for i, text in enumerate(args.loads.split(",")):
        base = times[modes[0]][i]
        print(f"{text:14}" + "".join(f"{times[m][i]:>12.2f} s ({base / times[m][i]:.2f}x)" for m in modes))
    save("activation_modes", {"cpu": cpu_model(), "model": args.model, "loads": args.loads.split(","),
                              "seconds": times})


if __name__ == "__main__":
    main()
