"""Where int8 activations cost accuracy, against bf16 weights with exact activations: each projection group
of the GGUF weights switched to int8 activations alone and in the groups a default could take; then by
row, int8 on a prompt's rows that give no logits (they only write the KV cache) and exact activations on
the rows whose next-token distributions are read.

    python -m benchmarks.bench_int8_split [--window 512] [--tail 256]

The same measure as ``bench_kernels``' accuracy table (teacher-forced next-token distributions over the
held-out texts in tests/data, mean KL divergence from the baseline and top-1 agreement), on one engine
whose 4-bit projections are switched group by group. A profiling aid with no bar: it says whether a
cheaper arithmetic on some projections (the ones with the most multiply-adds) could keep most of the
speed of ``--linear-activations int8`` at a fraction of its divergence, and whether a prompt's KV computed
on int8 activations moves the answers that read it.

The by-row table cuts the held-out texts into windows of ``--window`` tokens: the first ``window - tail``
are prefilled as one chunk in the row's prompt mode, the last ``tail`` as a second chunk continuing the
cached context in its tail mode, and only the tail's distributions are compared.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_kernels import TEXTS, cpu_model, next_token_logprobs
from benchmarks.common import save
from engine.attention import AttentionMetadata, PrefillSpan
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

GROUPS = ("qkv", "o", "gate_up", "down")
CHOICES = {"exact": (), "all int8": GROUPS, "qkv + gate_up": ("qkv", "gate_up"), "all but down": GROUPS[:3],
           "qkv": ("qkv",), "o": ("o",), "gate_up": ("gate_up",), "down": ("down",)}


def set_int8(engine: LLMEngine, groups: tuple[str, ...]) -> None:
    for lw in engine.model.layers:
        for group in GROUPS:
            lin = getattr(lw, group)
            if lin.takes_int8_activations:
                lin.int8_activations = group in groups


def chunk_logprobs(engine: LLMEngine, ids: list[int], start: int) -> torch.Tensor:
    """``ids`` prefilled as one chunk at positions ``start``.. (the cache holding positions before it), on the
    fused prefill attention as the engine's steps run it; the chunk's next-token log-probabilities."""
    t, context = len(ids), start + len(ids)
    meta = AttentionMetadata(slot_mapping=torch.arange(start, context), num_decodes=0, decode_gather=None,
                             decode_mask=None, decode_max_len=0, prefills=[PrefillSpan(0, t, context, None, None)])
    meta.prefill_spans = torch.tensor([[0, t, context]])
    meta.prefill_block_tables = torch.arange(-(-context // engine.runner.cache.block_size))[None]
    logits = engine.model.forward(torch.tensor(ids), torch.arange(start, context), meta, engine.runner.cache,
                                  torch.arange(t))
    return logits.float().log_softmax(-1)


def tail_logprobs(engine: LLMEngine, texts: list[str], window: int, tail: int, prompt_int8: bool,
                  tail_int8: bool) -> torch.Tensor:
    out = []
    for text in texts:
        ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - window + 1, window):
            chunk = ids[start:start + window]
            set_int8(engine, GROUPS if prompt_int8 else ())
            chunk_logprobs(engine, chunk[:window - tail], 0)
            set_int8(engine, GROUPS if tail_int8 else ())
            out.append(chunk_logprobs(engine, chunk[window - tail:], window - tail))
    return torch.cat(out)


def divergence(baseline: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """Mean KL(baseline || got) per position, and the share of positions with the same top token."""
    return (float((baseline.exp() * (baseline - got)).sum(-1).mean()),
            float((baseline.argmax(-1) == got.argmax(-1)).float().mean()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--tail", type=int, default=256)
    args = parser.parse_args()
    if not 0 < args.tail < args.window:
        parser.error("--tail must be between 0 and --window")
    texts = [(TEXTS / f"heldout_{lang}.txt").read_text() for lang in ("en", "zh")]

    def logprobs(engine: LLMEngine) -> torch.Tensor:
        return torch.cat([next_token_logprobs(engine, text)[0] for text in texts])

    exact_bf16 = LLMEngine(EngineConfig(dtype="bfloat16", quantization="none", num_kv_blocks=80))
    baseline = logprobs(exact_bf16)
    tail_baseline = tail_logprobs(exact_bf16, texts, args.window, args.tail, False, False)
    del exact_bf16
    engine = LLMEngine(EngineConfig(dtype="bfloat16", quantization="gguf", linear_activations="int8",
                                    num_kv_blocks=80))
    engine.model.layers_in_one_call = False  # each projection on its own flag
    layer = engine.model.layers[0]
    macs = {g: getattr(layer, g).in_features * getattr(layer, g).out_features for g in GROUPS}
    rows = []
    print(f"CPU: {cpu_model()}\n{'int8 on':14} {'KLD':>7} {'top-1':>6} {'share of layer multiply-adds':>29}")
    for name, chosen in CHOICES.items():
        set_int8(engine, chosen)
        kld, top1 = divergence(baseline, logprobs(engine))
        share = sum(macs[g] for g in chosen) / sum(macs.values())
        rows.append({"int8_on": list(chosen), "name": name, "kld": kld, "same_top1": top1, "mac_share": share})
        print(f"{name:14} {kld:7.4f} {top1:6.3f} {share:29.0%}")
    by_row = []
    print(f"\nby row: windows of {args.window} tokens, the last {args.tail} compared ({tail_baseline.shape[0]} "
          f"positions)\n{'prompt':7} {'tail':7} {'KLD':>7} {'top-1':>6}")
    for prompt_int8, tail_int8 in ((False, False), (True, False), (False, True), (True, True)):
        kld, top1 = divergence(tail_baseline, tail_logprobs(engine, texts, args.window, args.tail, prompt_int8,
                                                             tail_int8))
        modes = ["int8" if on else "exact" for on in (prompt_int8, tail_int8)]
        by_row.append({"prompt": modes[0], "tail": modes[1], "kld": kld, "same_top1": top1})
        print(f"{modes[0]:7} {modes[1]:7} {kld:7.4f} {top1:6.3f}")
    save("int8_split", {"cpu": cpu_model(), "groups": rows, "by_row": by_row, "window": args.window,
                        "tail": args.tail, "positions": int(tail_baseline.shape[0])})


if __name__ == "__main__":
    main()
