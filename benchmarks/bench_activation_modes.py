"""Prompt-heavy loads under each ``--linear-activations`` mode, in process, on one model file.

    python -m benchmarks.bench_activation_modes [--model FILE.gguf] [--loads 4x1000+16,8x200+32]
                                                [--modes bf16,int8-prompt,int8]

Each load is N prompts of P random tokens with O tokens out each (``NxP+O``), all submitted at once, sampled
at temperature 0.7 with ignore_eos; the prefix cache is off, so every prompt is computed. Each mode gets a fresh
engine (4-bit weights: ``--quantization gguf``), a short warm-up answer, then the loads in order. A profiling
aid with no bar: the time of each load per mode, and its speed-up over the first mode.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from benchmarks.bench_kernels import cpu_model
from benchmarks.common import save
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams


def parse_load(text: str) -> tuple[int, int, int]:
    count, rest = text.split("x")
    prompt, out = rest.split("+")
    return int(count), int(prompt), int(out)


def requests(tag: str, count: int, prompt: int, out: int, generator: torch.Generator) -> list[GenerationRequest]:
    def tokens() -> list[int]:
        return torch.randint(100, 40000, (prompt,), generator=generator).tolist()

    return [GenerationRequest(f"{tag}{i}", TokensPrompt(tokens()),
                              SamplingParams(max_tokens=out, temperature=0.7, ignore_eos=True, seed=i))
            for i in range(count)]


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
        generator = torch.Generator().manual_seed(0)  # the same prompts for every mode
        run(engine, requests("warm-up", 1, 100, 4, generator))
        times[mode] = [run(engine, requests(f"{i}-", *load, generator)) for i, load in enumerate(loads)]
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
