"""The decoder layers in one C call (engine/kernels/csrc/forward.c) compute what the per-kernel Python loop
computes, bit for bit, step by step: decode-only steps, prefill chunks beside decoding streams, 4-bit,
bf16 and biased projections; and the forward leaves the one-call loop whenever a layer stops being the
fused kernels' own work (reference linears swapped in, a oneDNN fallback for large batches)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from engine.config import EngineConfig
from engine.kernels import load_cpu_kernels
from engine.llm_engine import LLMEngine
from engine.models.linear import ReferenceLinear
from engine.models.weights import attach_two_term_fallbacks
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams
from tests.engine.helpers import kernels_for_every_batch, run_all
from tests.engine.test_model_families import TINY, _save_tiny

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler: the fused CPU kernels are not built")


def _requests(prefix: str, lengths: list[int], max_tokens: int = 10) -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(len(prefix))
    return [GenerationRequest(f"{prefix}{i}", TokensPrompt(torch.randint(100, 40000, (n,), generator=gen).tolist()),
                              SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
            for i, n in enumerate(lengths)]


class _BothPaths:
    """Wraps the model's forward: every step runs the per-kernel loop, then the one-call loop, on the same
    inputs, and their logits must be equal. Both write the same KV slots, so the cache stays as either
    leaves it. Records the shape of each step the one-call loop ran."""

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.model = engine.model
        self.one_call_steps: list[tuple[int, int, int]] = []  # (tokens, decodes, prefill chunks)
        self.last_layer_rows: list[tuple[int, int]] = []  # (tokens, rows the last layer's o / MLP ran for)
        self.per_row_steps: list[tuple[int, int]] = []  # the same, of steps that flagged rows for int8
        forward, one_call = self.model.forward, self.model.kernels.forward_layers

        def forward_layers(layers, step):
            self.one_call_steps.append((step.tokens, step.decodes, step.num_spans))
            self.last_layer_rows.append((step.tokens, step.num_kept if step.trim_last_layer else step.tokens))
            flags = ctypes.string_at(step.row_int8, step.tokens) if step.row_int8 else None
            one_call(layers, step)
            if flags is not None:
                self.per_row_steps.append(self.last_layer_rows[-1])
                # the step is read only: a profiling harness replays it (benchmarks/bench_layers_ab.py)
                assert ctypes.string_at(step.row_int8, step.tokens) == flags, "the loop wrote the step's flags"

        def both(input_ids, positions, meta, cache, logits_indices, lora=None, greedy_bans=None):
            self.model.layers_in_one_call = False
            want = forward(input_ids, positions, meta, cache, logits_indices, lora, greedy_bans)
            self.model.layers_in_one_call = True
            got = forward(input_ids, positions, meta, cache, logits_indices, lora, greedy_bans)
            assert torch.equal(got, want), f"step of {input_ids.shape[0]} tokens: the two loops differ"
            return got

        monkeypatch.setattr(self.model.kernels, "forward_layers", forward_layers)
        monkeypatch.setattr(self.model, "forward", both)
        monkeypatch.setattr(self.model, "greedy_head", None)  # both loops' logits, not greedy picks


def _staggered(engine: LLMEngine, prefix: str) -> None:
    """Two streams decode while longer prompts arrive and prefill in chunks beside them."""
    for r in _requests(prefix + "a", [7, 30], max_tokens=24):
        engine.add_request(r)
    for _ in range(4):
        engine.step()
    for r in _requests(prefix + "b", [150, 90, 3], max_tokens=8):
        engine.add_request(r)
    for _ in range(1_000):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()


@pytest.fixture(scope="module")
def gguf_engine() -> LLMEngine:
    # a small step budget, so prompts prefill in chunks beside the decoding streams; those chunks stay in
    # the one-call loop on every CPU (AMX's oneDNN fallback would take them out of it)
    with kernels_for_every_batch():
        return LLMEngine(EngineConfig(device="cpu", dtype="bfloat16", quantization="gguf", max_num_seqs=8,
                                      max_num_batched_tokens=64, kv_cache_space_gib=0.25))


@pytest.mark.parametrize("path", ["dot", "fma"])
def test_the_one_call_loop_equals_the_per_kernel_loop_on_four_bit_blocks(gguf_engine, monkeypatch, path):
    """On each of the linear kernels' fast paths (AVX512-BF16 dot products, fp32 FMAs)."""
    if path not in kernels.linear_paths:
        pytest.skip(f"this build has no {path!r} path")
    both = _BothPaths(gguf_engine, monkeypatch)
    with kernels.on_linear_path(path):
        _staggered(gguf_engine, "q" + path)
    steps = both.one_call_steps
    assert any(decodes == tokens > 1 for tokens, decodes, _ in steps)  # decode-only batches
    assert any(decodes and spans for _, decodes, spans in steps)  # chunks beside decoding streams
    assert any(spans > 1 for _, _, spans in steps)  # two prompts' chunks in one step
    # the last layer's o / MLP ran for the logits rows alone (the decodes and each prompt's last row; the
    # per-kernel loop runs them for every row, and the logits stayed equal)
    assert any(0 < kept < tokens for tokens, kept in both.last_layer_rows)


def test_the_one_call_loop_takes_a_mode_per_row_as_the_per_kernel_loop_does(monkeypatch):
    """--linear-activations int8-prompt: a step whose prompt rows take int8 activations and whose other rows
    (decodes, each prompt's logits row) take exact ones stays in the one-call loop where the kernels take a
    mode per row, and computes what the per-kernel loop computes, bit for bit: the flags follow the rows
    the last layer keeps."""
    with kernels_for_every_batch():
        engine = LLMEngine(EngineConfig(device="cpu", dtype="bfloat16", quantization="gguf", max_num_seqs=8,
                                        max_num_batched_tokens=64, kv_cache_space_gib=0.25,
                                        linear_activations="int8-prompt"))
    if not engine.model.layers[0].down.takes_int8_rows:
        pytest.skip("no mode per row on this build's path (it needs the VNNI int8 and AVX512-BF16 dot tiles)")
    both = _BothPaths(engine, monkeypatch)
    _staggered(engine, "rows")
    steps = both.per_row_steps
    assert any(0 < kept < tokens for tokens, kept in steps)  # flagged steps whose last layer kept a few rows
    assert len(steps) < len(both.one_call_steps)  # decode-only steps flag nothing


@pytest.mark.parametrize("path", ["dot", "fma"])
def test_a_lone_prompt_over_several_steps_on_each_path(gguf_engine, monkeypatch, path):
    """Alone, a prompt longer than the step's budget prefills in chunks with no row asking for logits until
    its last one: every path must compute such steps and answer as it does when the prompt fits one step."""
    if path not in kernels.linear_paths:
        pytest.skip(f"this build has no {path!r} path")
    model, head_rows = gguf_engine.model, []
    logits = model._logits
    monkeypatch.setattr(model, "_logits", lambda h: head_rows.append(h.shape[0]) or logits(h))
    monkeypatch.setattr(gguf_engine.block_manager, "enable_prefix_caching", False)  # each run computes it all

    def answer(step_budget: int) -> list[int]:
        monkeypatch.setattr(gguf_engine.scheduler, "max_num_batched_tokens", step_budget)
        outs = run_all(gguf_engine, _requests("lone" + path, [150], max_tokens=6))["lone" + path + "0"]
        return [t for o in outs for t in o.new_token_ids]

    with kernels.on_linear_path(path):
        chunked = answer(64)
        assert 0 in head_rows  # steps that asked the head for no rows ran
        whole = answer(256)
    assert len(chunked) == 6 and chunked == whole


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_the_one_call_loop_equals_the_per_kernel_loop_on_other_weights(tmp_path, llm_engine, monkeypatch,
                                                                       quantization):
    """bf16 and int8 packed weights, and Qwen2's q/k/v biases, on a small random model."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from engine.quant import cache, calibration

    if quantization == "none" and kernels.linear_isa != 2:
        pytest.skip("bf16 weights are packed only with AVX512-BF16 (an AVX2 or AVX-512F build leaves them to torch)")
    monkeypatch.setattr(cache, "default_cache_dir", lambda: tmp_path)  # int8's weights cached here, not at home
    monkeypatch.setattr(calibration, "DEFAULT_SEQUENCES", 4)  # int8's calibration, small: the loop is under
    monkeypatch.setattr(calibration, "DEFAULT_LENGTH", 32)  # test here, not the rounding

    path = _save_tiny(tmp_path, llm_engine, Qwen2Config(**TINY))
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():  # transformers starts biases at zero: make them count
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    with kernels_for_every_batch():  # every step's rows on the kernels, however busy the machine
        engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="bfloat16", quantization=quantization,
                                        max_num_seqs=8, max_num_batched_tokens=64, kv_cache_space_gib=0.1))
    assert engine.model.layers[0].qkv.bias is not None
    assert {lw.down.packed.fmt for lw in engine.model.layers} == {"i8" if quantization == "int8" else "bf16"}
    both = _BothPaths(engine, monkeypatch)
    _staggered(engine, "w")
    assert any(decodes and spans for _, decodes, spans in both.one_call_steps)


def test_swapped_in_linears_and_fallbacks_take_the_forward_out_of_the_one_call_loop(gguf_engine, monkeypatch):
    model = gguf_engine.model
    calls = []
    one_call = model.kernels.forward_layers
    monkeypatch.setattr(model.kernels, "forward_layers", lambda layers, step: calls.append(step.tokens)
                        or one_call(layers, step))
    run_all(gguf_engine, _requests("s", [20], max_tokens=6))
    assert calls  # the one-call loop ran

    # large batches to the two-term oneDNN fallback: the one-call loop keeps the small ones only
    layers = [lin for lw in model.layers for lin in lw.linears()]
    saved = [(lin.fallback, lin.max_kernel_rows) for lin in layers]
    attach_two_term_fallbacks(layers, rows=4)
    try:
        calls.clear()
        run_all(gguf_engine, _requests("f", [20, 5, 9], max_tokens=6))
        assert calls and max(calls) <= 4
    finally:
        for lin, (fallback, rows) in zip(layers, saved):
            lin.fallback, lin.max_kernel_rows = fallback, rows

    # one projection swapped for its slow reference: every step goes through Python, which calls it
    lw = model.layers[3]
    packed, seen = lw.down, []
    reference = ReferenceLinear(packed.quantized)
    lw.down = lambda x: seen.append(x.shape[0]) or reference(x)
    try:
        calls.clear()
        run_all(gguf_engine, _requests("t", [20], max_tokens=6))
        assert not calls and seen
    finally:
        lw.down = packed
    calls.clear()
    run_all(gguf_engine, _requests("r", [12], max_tokens=2))
    assert calls  # back in the loop once the layer is its packed self again
