"""The fused CPU kernels against the torch ops they replace.

Elementwise kernels (norm, activation, RoPE, cache write) must give the torch path's bits exactly in
bf16 (in fp32, norm and activation may differ in the last bit: sum order, exp); decode and prefill
attention must match a plain (causal) softmax attention over the same paged context.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.kernels import KernelUnsupported, load_cpu_kernels, load_target
from engine.llm_engine import LLMEngine
from engine.models.llama import rms_norm
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams
from tests.engine.threads import kernel_threads

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler: the fused kernels are not built")
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module", params=["native", "portable"])
def kern(request):
    """The library the engine picked, and the portable one (what a CPU without AVX2 runs: the plain-C loops)."""
    if request.param == "native":
        lib = kernels
    elif platform.machine() != "x86_64":
        pytest.skip("the portable build is an x86-64 baseline")
    else:
        lib = load_target("portable")
    with kernel_threads(lib):
        yield lib


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_bit_identical(dtype, kern):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 576, generator=g) * 3).to(dtype)
    residual = torch.randn(7, 576, generator=g).to(dtype)
    weight = (torch.rand(576, generator=g) + 0.5).to(dtype)
    expected_x = x + residual
    expected_h = rms_norm(expected_x, weight, 1e-5)
    h = torch.empty_like(x)
    kern.add_rms_norm(x, residual, weight, h, 1e-5)
    assert torch.equal(x, expected_x)
    check_norm(h, expected_h)
    kern.add_rms_norm(x, None, weight, h, 1e-5)  # no residual: x untouched
    assert torch.equal(x, expected_x)
    check_norm(h, expected_h)


def check_norm(h: torch.Tensor, expected: torch.Tensor) -> None:
    if h.dtype == torch.bfloat16:  # the sum of squares may differ in its last fp32 bit; bf16 hides it
        assert torch.equal(h, expected)
    else:
        torch.testing.assert_close(h, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter,spread", [(5, 1536, 2.0), (12, 1000, 20.0)])  # 12 rows: split between threads
def test_silu_mul_is_bit_identical(dtype, kern, rows, inter, spread):
    """1000 leaves a ragged tail after the 16-value vectors; a spread of 20 reaches exp's clamped range."""
    gate_up = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(1)) * spread).to(dtype)
    out = torch.empty(rows, inter, dtype=dtype)
    kern.silu_mul(gate_up, out)
    expected = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    if dtype == torch.bfloat16:
        assert torch.equal(out, expected)
    else:  # expf and torch's vectorised exp may differ in the last bit
        torch.testing.assert_close(out, expected, rtol=5e-7, atol=1e-7)


def test_silu_mul_gives_torchs_bits_for_every_bf16_gate(kern):
    """All 65,536 bf16 gate values (the bf16 kernel reads silu from a table filled at load): torch's bits for
    each, NaN for NaN, +inf for +inf. Not at -88.5 and below, where the kernels clamp exp's argument (silu
    is then gate / (1 + e^87)) and torch's exp overflows to give -0.0: activations the model never has."""
    gate = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = (torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    out = torch.empty(1, 1 << 16, dtype=torch.bfloat16)
    kern.silu_mul(torch.cat([gate, up]).view(1, -1), out)
    expected = F.silu(gate) * up
    same = (out[0] == expected) | (out[0].isnan() & expected.isnan())
    clamped = gate <= -88.5
    assert same[~clamped].all(), gate[~clamped & ~same][:8]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_cache_write_match_the_torch_path(dtype, kern):
    H, Hkv, D, T = 9, 3, 64, 20
    g = torch.Generator().manual_seed(2)
    qkv = (torch.randn(T, (H + 2 * Hkv) * D, generator=g) * 2).to(dtype)
    positions = torch.randint(0, 100, (T,), generator=g)
    angles = torch.rand(100, D, generator=g) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qk = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
    expected = qk * cos[positions].unsqueeze(1) + torch.roll(qk, D // 2, dims=-1) * sin[positions].unsqueeze(1)
    v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D).clone()
    cache = torch.zeros(2 * Hkv, 64, D, dtype=dtype)
    slots = torch.randperm(64, generator=g)[:T]
    kern.rope_cache_write(qkv, positions, cos, sin, cache, slots, H, Hkv, D)
    roped = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
    assert torch.equal(roped, expected)
    assert torch.equal(cache[:Hkv, slots], expected[:, H:].transpose(0, 1))
    assert torch.equal(cache[Hkv:, slots], v.transpose(0, 1))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not cache[:, untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H, Hkv, D", [(9, 3, 64), (8, 2, 128), (4, 4, 32)])  # SmolLM2, Llama-like, no GQA
# ragged (one mid-block, one exactly 4 blocks; a task per KV head), and one long sequence (a task per query head)
@pytest.mark.parametrize("context_lens", [[1, 17, 130, 64, 45], [300]])
@pytest.mark.parametrize("block", [16, 32])  # the bf16 scores take 16 keys at a time: one and two groups a block
def test_decode_attention_matches_softmax_attention_over_paged_context(dtype, kern, H, Hkv, D, context_lens, block):
    g = torch.Generator().manual_seed(3)
    num_blocks = 40
    cache = torch.randn(2 * Hkv, num_blocks * block, D, generator=g).to(dtype)
    max_blocks = -(-max(context_lens) // block)
    # each sequence gets blocks scattered over the pool, in no particular order
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in context_lens:
        need = -(-n // block)
        tables.append(pool[:need] + [0] * (max_blocks - need))
        pool = pool[need:] + pool[:need]
    B = len(context_lens)
    qkv = torch.randn(B, (H + 2 * Hkv) * D, generator=g).to(dtype)
    out = torch.empty(B, H * D, dtype=dtype)
    scratch = torch.empty(B * H * max(context_lens), dtype=torch.float32)
    kern.decode_attention(qkv, cache, torch.tensor(tables), torch.tensor(context_lens), block, B, H, Hkv, D,
                             max(context_lens), scratch, out)
    for b, n in enumerate(context_lens):
        slots = torch.tensor([tables[b][p // block] * block + p % block for p in range(n)])
        k = cache[:Hkv, slots].float().repeat_interleave(H // Hkv, 0)  # [H, n, D]
        v = cache[Hkv:, slots].float().repeat_interleave(H // Hkv, 0)
        q = qkv[b, : H * D].float().view(H, 1, D)
        expected = F.scaled_dot_product_attention(q, k, v).view(H * D)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out[b].float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H, Hkv, D", [(9, 3, 64), (8, 2, 128)])
def test_decode_attention_rows_of_one_sequence_equal_the_rows_alone(dtype, kern, H, Hkv, D):
    """A sequence's decode row and its draft rows (one table, lengths one apart) run as one task per KV
    head; every row must come out bit for bit as when no row joins another (the same rows in reverse:
    lengths descending, no group). Two different sequences that share their first block (a cached
    prefix) with lengths one apart are grouped too, and must still read their own tables."""
    g = torch.Generator().manual_seed(7)
    block, num_blocks = 16, 160
    cache = torch.randn(2 * Hkv, num_blocks * block, D, generator=g).to(dtype)
    pool = torch.randperm(num_blocks, generator=g).tolist()
    rows: list[tuple[list[int], int]] = []  # (table, context length)
    for base, count in ((37, 4), (130, 1), (64, 6), (200, 2), (15, 3), (90, 5), (260, 1), (48, 2)):
        need = -(-(base + count) // block)
        table, pool = pool[:need], pool[need:]
        rows += [(table, base + r) for r in range(count)]
    shared = rows[0][0][0]  # a sequence on the first one's first block, one longer than its last row
    need = -(-(rows[3][1] + 1) // block)
    rows.insert(4, ([shared] + pool[:need - 1], rows[3][1] + 1))
    width = max(len(t) for t, _ in rows)
    tables = torch.tensor([t + [0] * (width - len(t)) for t, _ in rows])
    lens = torch.tensor([n for _, n in rows])
    B, longest = len(rows), int(lens.max())
    qkv = torch.randn(B, (H + 2 * Hkv) * D, generator=g).to(dtype)

    def attend(order: torch.Tensor) -> torch.Tensor:
        out = torch.empty(B, H * D, dtype=dtype)
        kern.decode_attention(qkv[order].contiguous(), cache, tables[order].contiguous(), lens[order].contiguous(),
                              block, B, H, Hkv, D, longest, torch.empty(B * H * longest, dtype=torch.float32), out)
        result = torch.empty_like(out)
        result[order] = out
        return result

    grouped, alone = attend(torch.arange(B)), attend(torch.arange(B - 1, -1, -1))
    assert torch.equal(grouped, alone)
    for b in (0, 3, 4, 5):  # and each against plain softmax attention over its own table
        slots = torch.tensor([rows[b][0][p // block] * block + p % block for p in range(rows[b][1])])
        k = cache[:Hkv, slots].float().repeat_interleave(H // Hkv, 0)
        v = cache[Hkv:, slots].float().repeat_interleave(H // Hkv, 0)
        expected = F.scaled_dot_product_attention(qkv[b, : H * D].float().view(H, 1, D), k, v).view(H * D)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(grouped[b].float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top, second", [(3, 20), (20, 40), (40, 44)])  # whole 16-key groups, both, the ragged tail
def test_decode_attention_takes_the_maximum_of_every_score(dtype, kern, top, second):
    """Two keys far above the rest, the second 127 below the first: the softmax is the first key's alone.
    The exponent is clamped at 88, so a maximum that missed both keys would weigh them equally."""
    H, Hkv, D, block, n = 9, 3, 64, 16, 45
    g = torch.Generator().manual_seed(5)
    u = torch.randn(D, generator=g)
    u /= u.norm()
    cache = torch.randn(2 * Hkv, 3 * block, D, generator=g) * 0.1
    cache[:Hkv, top] = 100 * u  # score 30 * 100 / sqrt(64) = 375
    cache[:Hkv, second] = 66 * u  # 247.5
    cache = cache.to(dtype)
    qkv = torch.zeros(1, (H + 2 * Hkv) * D)
    qkv[0, : H * D] = (30 * u).repeat(H)
    qkv = qkv.to(dtype)
    out = torch.empty(1, H * D, dtype=dtype)
    kern.decode_attention(qkv, cache, torch.tensor([[0, 1, 2]]), torch.tensor([n]), block, 1, H, Hkv, D, n,
                          torch.empty(H * n, dtype=torch.float32), out)
    want = cache[Hkv:, top].float().repeat_interleave(H // Hkv, 0).reshape(H * D)
    torch.testing.assert_close(out[0].float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("H, Hkv, D", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 64)])  # + one KV head for all
# whole prompts; a chunk continuing a cached context (tiles of several lengths, ragged, over a block edge);
# one long chunk (several query tiles per KV head, keys beyond one 32-key score pass); many short chunks
# over long cached contexts (a new turn of 40 conversations: more packed K/V than one call shares, so
# each tile packs its own); a long prompt's capped chunk (too few queries for the threads: smaller tiles)
@pytest.mark.parametrize("spans", [[(1, 1), (7, 7)], [(40, 100), (5, 5), (33, 301)], [(130, 130)],
                                   [(2, 1100)] * 40, [(32, 700)]])
@pytest.mark.parametrize("block", [16, 32])
# bf16 products on AVX512-BF16 dot products or on fp32 FMAs (the linears' path, chosen at start, picks both);
# fp32 caches have the one path
@pytest.mark.parametrize("dtype, path", [(torch.bfloat16, "dot"), (torch.bfloat16, "fma"), (torch.float32, "dot")])
def test_prefill_attention_is_causal_softmax_attention_over_paged_context(dtype, kern, H, Hkv, D, spans, block, path):
    if path not in (kern.linear_paths or ("dot",)):
        pytest.skip(f"no {path!r} path in this build")
    with kern.on_linear_path(path) if kern.linear_paths else nullcontext():
        _check_prefill_attention(dtype, kern, H, Hkv, D, spans, block)


def _check_prefill_attention(dtype, kern, H, Hkv, D, spans, block):
    g = torch.Generator().manual_seed(5)
    num_blocks = max(64, max(-(-ctx // block) for _, ctx in spans))
    cache = torch.randn(2 * Hkv, num_blocks * block, D, generator=g).to(dtype)
    pool = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-ctx // block) for _, ctx in spans)
    tables, rows = [], []
    for q_len, ctx in spans:
        need = -(-ctx // block)
        tables.append(pool[:need] + [0] * (width - need))
        pool = pool[need:] + pool[:need]
        rows.append([sum(r[1] for r in rows), q_len, ctx])
    T = sum(q for q, _ in spans)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    out = torch.full((T, H * D), float("nan"), dtype=dtype)
    kern.prefill_attention(qkv, cache, torch.tensor(rows), torch.tensor(tables), block, H, Hkv, D, out)
    for (start, q_len, ctx), table in zip(rows, tables):
        slots = torch.tensor([table[p // block] * block + p % block for p in range(ctx)])
        k = cache[:Hkv, slots].float().repeat_interleave(H // Hkv, 0)  # [H, ctx, D]
        v = cache[Hkv:, slots].float().repeat_interleave(H // Hkv, 0)
        q = qkv[start:start + q_len, : H * D].float().view(q_len, H, D).transpose(0, 1)
        causal = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal).transpose(0, 1).reshape(q_len, H * D)
        # bf16: the probabilities are rounded to bf16 before P @ V, as torch's bf16 matmuls do
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out[start:start + q_len].float(), expected, rtol=tol, atol=tol)


def test_fused_forward_equals_torch_forward_on_mixed_batches(tmp_path):
    """Decodes, a prompt continuing from cached blocks and a chunked fresh prompt share fp32 steps;
    every step runs both paths from the same cache and their logits must agree. On a 2-layer model of the
    embedded one's family (its head size, grouping, vocabulary): the paths, not the weights, are compared."""
    from tests.tiny_checkpoints import save_tiny_llama

    model = save_tiny_llama(tmp_path / "tiny")
    with kernel_threads(kernels):  # the model sets the shared library's count from torch's when built
        engine = LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_num_batched_tokens=64,
                                        long_prefill_token_threshold=0, num_kv_blocks=64))
        _fused_equals_torch_on_mixed_batches(engine)


def _fused_equals_torch_on_mixed_batches(engine: LLMEngine) -> None:
    model, fused_kernels = engine.model, engine.model.kernels
    assert fused_kernels is not None
    model.greedy_head = None  # logits from both paths, not the greedy head's picks (test_greedy_head.py)
    run = engine.runner.run
    mixed_steps = 0

    def run_both(batch):
        nonlocal mixed_steps
        cache = engine.runner.cache.kv
        before = cache.clone()
        model.kernels = None
        try:
            torch_logits = run(batch).logits
        finally:
            model.kernels = fused_kernels
        torch_cache = cache.clone()
        cache.copy_(before)
        out = run(batch)
        torch.testing.assert_close(out.logits, torch_logits, rtol=1e-4, atol=1e-4)
        # assert_close's bound over the whole cache, in four tensor ops (its isclose took a quarter of
        # the test's time): |a - b| <= atol + rtol * |b| everywhere
        excess = (cache - torch_cache).abs_().sub_(torch_cache.abs().mul_(1e-4)).max().item()
        assert excess <= 1e-4, f"the fused step's KV cache is off by {excess:.2e} beyond the bound"
        mixed_steps += bool(batch.decodes and batch.prefills)
        return out

    engine.runner.run = run_both
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for i, n in enumerate((30, 51)):
        engine.add_request(GenerationRequest(f"d{i}", TokensPrompt(list(range(100 + i, 100 + i + n))), greedy))
    for _ in range(4):
        engine.step()
    # shares d0's first 16-token block through the prefix cache; the other needs several chunks
    engine.add_request(GenerationRequest("p0", TokensPrompt(list(range(100, 116)) + list(range(900, 940))), greedy))
    engine.add_request(GenerationRequest("p1", TokensPrompt(list(range(2000, 2150))), greedy))
    while engine.has_unfinished():
        engine.step()
    assert mixed_steps >= 2


def test_engine_runs_without_the_kernels_when_disabled(tmp_path):
    """Disabled, or neither an installed library nor a compiler: no kernels, and the engine still starts."""
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout);"
            "from engine.kernels import load_cpu_kernels; print('KERNELS', load_cpu_kernels())")
    no_libs = {"CC": "/bin/false", "SPARK_CACHE_DIR": str(tmp_path), "SPARK_KERNELS_LIB_DIR": str(tmp_path / "none")}
    for env in ({"SPARK_NATIVE_KERNELS": "0"}, no_libs):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, **env, "PATH": "/nonexistent" if "CC" in env else os.environ["PATH"]})
        assert proc.returncode == 0, proc.stderr
        assert "KERNELS None" in proc.stdout


@pytest.mark.parametrize("with_kernels", [True, False])
def test_logits_tied_by_bf16_rounding_are_resolved_in_fp32(with_kernels):
    """Two candidates 0.03 apart both round to 25.25 in bf16; greedy must still see which is larger."""
    from types import SimpleNamespace

    from engine.models.linear import Linear
    from engine.models.llama import LlamaForCausalLM

    weight = torch.tensor([[6.3125] * 4, [6.3125, 6.3125, 6.3125, 6.34375], [1.0] * 4], dtype=torch.bfloat16)
    model = SimpleNamespace(lm_head=Linear(weight), dtype=torch.bfloat16, kernels=kernels if with_kernels else None)
    h = torch.ones(2, 4, dtype=torch.bfloat16)
    logits = LlamaForCausalLM._logits(model, h)
    assert logits.dtype == torch.float32
    assert logits.argmax(-1).tolist() == [1, 1]
    assert logits[0, 1].item() == pytest.approx(25.28125) and logits[0, 0].item() == 25.25
    assert logits[0, 2].item() == 4.0  # rows below the top are left as the linear gave them


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_expand_applies_each_tokens_own_adapter(dtype, kern):
    """Two projections (like gate/up) of 5000 and 700 outputs (past one accumulator chunk), 3 slots of
    rank 4; tokens on slots 2, -1 (base only), 0, 2."""
    g = torch.Generator().manual_seed(5)
    S, r, n_in_y, outs = 3, 4, 5700, [5000, 700]
    slots = torch.tensor([2, -1, 0, 2])
    T = len(slots)
    y = torch.randn(T, n_in_y + len(outs) * S * r, generator=g).to(dtype)
    b = [torch.randn(S, r, o, generator=g).to(dtype) for o in outs]
    out = torch.empty(T, n_in_y, dtype=dtype)
    kern.lora_expand(y, y[:, n_in_y:], n_in_y, out, slots, torch.cat([x.flatten() for x in b]), torch.tensor(outs),
                     S, r)
    expected = y[:, :n_in_y].float().clone()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        off = 0
        for p, o in enumerate(outs):
            u = y[t, n_in_y + (p * S + s) * r: n_in_y + (p * S + s + 1) * r].float()
            expected[t, off:off + o] += u @ b[p][s].float()
            off += o
    assert torch.equal(out[1], y[1, :n_in_y])
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [70, 576])
def test_lora_shrink_computes_each_tokens_own_slot_alone(dtype, kern, K):
    """Three projections (like q/k/v) of a 4-slot, rank-4 A stack; runs of tokens on one slot longer and
    shorter than a block of 8, a token of no slot, lone tokens. Each token's own slot's columns are x @ A_s^T;
    no other column is written; and a token's columns are the same bits alone (copied to another buffer) as
    in any run (K 70: a ragged tail after 16-lane steps)."""
    g = torch.Generator().manual_seed(9)
    P, S, r = 3, 4, 4
    a = torch.randn(P * S * r, K, generator=g).to(dtype)
    slots = torch.tensor([3] * 11 + [-1] + [0] * 3 + [1] + [2] * 9 + [3])
    T = len(slots)
    x = torch.randn(T, K, generator=g).to(dtype)
    u = torch.full((T, P * S * r), 7.0, dtype=dtype)
    kern.lora_shrink(x, a, slots, P, S, r, u)
    want = (x.float() @ a.float().T).to(dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for t, s in enumerate(slots.tolist()):
        own = [c for p in range(P) for c in range((p * S + s) * r, (p * S + s + 1) * r)] if s >= 0 else []
        others = [c for c in range(P * S * r) if c not in own]
        assert (u[t, others] == 7.0).all(), t
        torch.testing.assert_close(u[t, own].float(), want[t, own].float(), rtol=tol, atol=tol)
        alone = torch.full((1, P * S * r), 7.0, dtype=dtype)
        kern.lora_shrink(x[t:t + 1].clone(), a, slots[t:t + 1].clone(), P, S, r, alone)
        assert torch.equal(alone[0], u[t]), t
    with pytest.raises(KernelUnsupported, match="lora_shrink"):  # a slot the stack does not hold
        kern.lora_shrink(x[:2], a, torch.tensor([0, S]), P, S, r, u[:2])


def test_argmax_equals_torch_first_maximum_and_nan() -> None:
    """Greedy picks: the first of tied maxima, the first NaN where a row has one, -inf rows, ragged vocab."""
    gen = torch.Generator().manual_seed(3)
    for rows, vocab in [(1, 1), (3, 17), (24, 49152), (5, 1000)]:
        x = torch.randn(rows, vocab, generator=gen)
        if vocab > 8:
            x[0, 5] = x[0, 7] = x[0].max() + 1  # tie: the first wins
            x[-1] = float("-inf")
            x[1 % rows, vocab // 2] = float("nan")
            x[1 % rows, vocab - 1] = float("nan")
        assert torch.equal(kernels.argmax(x), x.argmax(-1)), (rows, vocab)
    strided = torch.randn(4, 64, generator=gen)[:, ::2]
    assert torch.equal(kernels.argmax(strided), strided.argmax(-1))
    # the scan tests chunks of 256 before looking inside one: maxima and NaNs on either side of a boundary
    edges = torch.randn(6, 777, generator=gen)
    edges[0, 255] = edges[0, 256] = 9.0
    edges[1, 256] = edges[1, 770] = 9.0
    edges[2, 776] = 9.0
    edges[3, 511] = float("nan")
    edges[4, 512] = edges[4, 3] = float("nan")
    assert torch.equal(kernels.argmax(edges), edges.argmax(-1))
