"""Where int8 activations cost accuracy: each projection group of the GGUF weights switched to int8
activations alone and in the groups a default could take, against bf16 weights with exact activations.

    python -m benchmarks.bench_int8_split

The same measure as ``bench_kernels``' accuracy table (teacher-forced next-token distributions over the
held-out texts in tests/data, mean KL divergence from the baseline and top-1 agreement), on one engine
whose 4-bit projections are switched group by group. A profiling aid with no bar: it says whether a
cheaper arithmetic on some projections (the ones with the most multiply-adds) could keep most of the
speed of ``--linear-activations int8`` at a fraction of its divergence.
"""

from __future__ import annotations

import torch

from benchmarks.bench_kernels import TEXTS, cpu_model, next_token_logprobs
from benchmarks.common import save
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

GROUPS = ("qkv", "o", "gate_up", "down")
CHOICES = {"exact": (), "all int8": GROUPS, "qkv + gate_up": ("qkv", "gate_up"), "all but down": GROUPS[:3],
           "qkv": ("qkv",), "o": ("o",), "gate_up": ("gate_up",), "down": ("down",)}


def main() -> None:
    texts = [(TEXTS / f"heldout_{lang}.txt").read_text() for lang in ("en", "zh")]

    def logprobs(engine: LLMEngine) -> torch.Tensor:
        return torch.cat([next_token_logprobs(engine, text)[0] for text in texts])

    baseline = logprobs(LLMEngine(EngineConfig(dtype="bfloat16", quantization="none", num_kv_blocks=80)))
    engine = LLMEngine(EngineConfig(dtype="bfloat16", quantization="gguf", linear_activations="int8",
                                    num_kv_blocks=80))
    engine.model.layers_in_one_call = False  # each projection on its own flag
    layer = engine.model.layers[0]
    macs = {g: getattr(layer, g).in_features * getattr(layer, g).out_features for g in GROUPS}
    rows = []
    print(f"CPU: {cpu_model()}\n{'int8 on':14} {'KLD':>7} {'top-1':>6} {'share of layer multiply-adds':>29}")
    for name, chosen in CHOICES.items():
        for lw in engine.model.layers:
            for group in GROUPS:
                lin = getattr(lw, group)
                if lin.takes_int8_activations:
                    lin.int8_activations = group in chosen
        got = logprobs(engine)
        kld = float((baseline.exp() * (baseline - got)).sum(-1).mean())
        top1 = float((baseline.argmax(-1) == got.argmax(-1)).float().mean())
        share = sum(macs[g] for g in chosen) / sum(macs.values())
        rows.append({"int8_on": list(chosen), "name": name, "kld": kld, "same_top1": top1, "mac_share": share})
        print(f"{name:14} {kld:7.4f} {top1:6.3f} {share:29.0%}")
    save("int8_split", {"cpu": cpu_model(), "rows": rows})


if __name__ == "__main__":
    main()
