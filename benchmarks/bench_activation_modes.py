"""Prompt-heavy loads under each ``--linear-activations`` mode, in process, on one model file.

    python -m benchmarks.bench_activation_modes [--model FILE.gguf] [--loads 4x1000+16,8x200+32]
                                                [--modes bf16,int8-prompt,int8] [--next-turn 1000+64]

Each load is N distinct synthetic prompts of P tokens with O tokens out each (``NxP+O``), all submitted at
once, sampled at temperature 0.7 with ignore_eos; the prefix cache is off, so every prompt is computed. Each
mode gets a fresh engine (4-bit weights: ``--quantization gguf``), its KV pool resident and a short warm-up
answer, then the loads in order, on the same prompts as every other mode. A profiling aid with no bar: the
time of each load per mode, and its speed-up over the first mode.

``--next-turn H+A`` adds a conversation on an engine with the prefix cache on: a first turn of an H-token
prompt answered with A tokens, then the next turn (the history, that answer and a 20-token question),
timed to its first token. Under int8-prompt the cache shares only a prompt's own rows, so the next turn
computes the answer's tokens again; the default modes read them from the cache.
"""

from __future__ import annotations

import argparse
import gc
import time

from benchmarks.bench_kernels import cpu_model
from benchmarks.common import save, token_requests, wait_for_kv_pool
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams

QUESTION_TOKENS = 20


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


def next_turn_ttft(model: str | None, mode: str, history: int, answer: int) -> float:
    """Seconds to the next turn's first token, after a first turn answered ``answer`` tokens (sampled)."""
    engine = LLMEngine(EngineConfig(model=model, dtype="bfloat16", quantization="gguf", linear_activations=mode))
    wait_for_kv_pool(engine)
    run(engine, token_requests("warm-up", 1, 100, 4, first=10_000))
    first = token_requests("turn-1", 1, history, answer, first=20_000, temperature=0.7, seed=0)[0]
    engine.add_request(first)
    said: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            said += out.new_token_ids
    question = token_requests("q", 1, QUESTION_TOKENS, 1, first=30_000)[0].prompt
    assert isinstance(first.prompt, TokensPrompt) and isinstance(question, TokensPrompt)
    ids = first.prompt.token_ids + said + question.token_ids
    started = time.perf_counter()
    engine.add_request(GenerationRequest("turn-2", TokensPrompt(ids), SamplingParams(max_tokens=1)))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    parser.add_argument("--loads", default="4x1000+16,8x200+32")
    parser.add_argument("--modes", default="bf16,int8-prompt,int8")
    parser.add_argument("--next-turn", default=None, metavar="H+A",
                        help="also time a next turn over an H-token history and an A-token answer (cache on)")
    args = parser.parse_args()
    load_names = [text for text in args.loads.split(",") if text]  # --loads "": the next turn alone
    loads = [parse_load(text) for text in load_names]
    modes = args.modes.split(",")
    times: dict[str, list[float]] = {}
    for mode in modes if loads else ():
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
    if loads:
        print(f"{'load':14}" + "".join(f"{mode:>22}" for mode in modes))
    for i, text in enumerate(load_names):
        base = times[modes[0]][i]
        print(f"{text:14}" + "".join(f"{times[m][i]:>12.2f} s ({base / times[m][i]:.2f}x)" for m in modes))
    next_turn: dict[str, float] = {}
    if args.next_turn:
        history, answer = map(int, args.next_turn.split("+"))
        for mode in modes:
            next_turn[mode] = next_turn_ttft(args.model, mode, history, answer)
            gc.collect()
        print(f"next turn over {history} + {answer} tokens, to its first token: "
              + ", ".join(f"{m} {t:.3f} s" for m, t in next_turn.items()))
    save("activation_modes", {"cpu": cpu_model(), "model": args.model, "loads": load_names,
                              "seconds": times, "next_turn": args.next_turn, "next_turn_seconds": next_turn})


if __name__ == "__main__":
    main()
