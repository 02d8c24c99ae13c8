"""Where a decode step's time goes: the layer loop, the greedy head, the rest of the runner, the engine.

    python -m benchmarks.bench_decode_step [--streams 32] [--context 300] [--steps 100]

`--streams` greedy requests with `--context`-token prompts are prefilled, then `--steps` decode steps are
timed with wall-clock timers around the kernels' layer loop (``forward_layers``) and the greedy head's
bounds (``greedy_head_bounds``), and around ``ModelRunner.run``. What the report calls

- layer loop: every decoder layer (linears, attention, norms, activation) in one C call;
- greedy head: the int8 head's logits with their bound (absent where the head is not int8 or the CPU
  lacks VNNI: then the full head runs inside "rest of the runner");
- rest of the runner: building the step's tensors, the final norm, the greedy picks' exact recompute;
- engine outside the runner: scheduling, detokenizing, stop checks, the outputs.

A profiling aid, not a bar: no verdict. Context grows by `--steps` tokens over the run. Speculation is
off, so every step is one row a stream (`bench_load_split` counts draft rows in a served load).
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.bench_kernels import cpu_model
from benchmarks.common import token_requests, wait_for_kv_pool
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


class Timed:
    """Wraps obj.name so that each call's wall time adds to ``seconds``."""

    def __init__(self, obj: Any, name: str) -> None:
        self.seconds = 0.0
        inner: Callable[..., Any] = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(obj, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--context", type=int, default=300, help="prompt tokens of each stream")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    # One row a stream: with prompt-lookup drafts a greedy stream would take several tokens a step and
    # finish its budget within the first steps, and the later steps would time an idle engine.
    engine = LLMEngine(EngineConfig(max_num_seqs=max(args.streams, 1), num_speculative_tokens=0))
    wait_for_kv_pool(engine)
    for request in token_requests("d", args.streams, args.context, args.steps + 20, temperature=0.0):
        engine.add_request(request)
    while engine.scheduler.waiting or any(s.num_computed_tokens < len(s.token_ids) - 1
                                          for s in engine.scheduler.running):
        engine.step()  # every prompt prefilled: from here on each step is decode only
    for _ in range(5):
        engine.step()
    gc.collect()
    gc.freeze()  # as the server does after start-up
    kernels = engine.runner.model.kernels
    layers = Timed(kernels, "forward_layers") if kernels is not None else None
    head = Timed(kernels, "greedy_head_bounds") if kernels is not None else None
    runner = Timed(engine.runner, "run")
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    total = (time.perf_counter() - start) / args.steps
    per_step = {name: (t.seconds / args.steps if t else 0.0) for name, t in
                (("layers", layers), ("head", head), ("runner", runner))}
    print(f"CPU: {cpu_model()}; torch threads {torch.get_num_threads()}; {args.streams} streams, "
          f"context {args.context} -> {args.context + args.steps} tokens")
    print(f"decode step {total * 1e3:.2f} ms: layer loop {per_step['layers'] * 1e3:.2f}, "
          f"greedy head {per_step['head'] * 1e3:.2f}, "
          f"rest of the runner {(per_step['runner'] - per_step['layers'] - per_step['head']) * 1e3:.2f}, "
          f"engine outside the runner {(total - per_step['runner']) * 1e3:.2f}")


if __name__ == "__main__":
    main()
