"""The packed CPU linear kernels against the slow reference: dequantize to fp32, then matmul.

Random shapes include ragged output tiles (N not a multiple of 16), odd row counts on both sides of
the kernel's 8-row passes and 64-row chunks, biases, and both output dtypes. Each format runs on the
machine's fast path and on the portable C path, which CPUs without AVX512-BF16 use.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import pytest
import torch

from engine.kernels import KernelUnsupported, load_cpu_kernels
from engine.models import weights as weights_module
from engine.models.linear import Linear, PackedLinear, TwoTermBf16Linear, _mkldnn_packing_available
from engine.models.weights import attach_two_term_fallbacks
from engine.quant.activations import linear_int8_activations, quantize_blocks
from engine.quant.formats import QuantizedWeight, concat, quantize_int4, quantize_int8
from engine.quant.packing import PackedWeight, pack_bf16, pack_quantized
from tests.engine.helpers import QuietMachine
from tests.engine.threads import kernel_threads

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler: the fused CPU kernels are not built")


@pytest.fixture(autouse=True)
def split_over_threads():
    with kernel_threads(kernels):
        yield

# rows: one, a few, less than a 16-row block, a chunk of 64 and its 7-row tail, 16-row blocks with an
# 8-row and a 5-row rest (blocks that start mid-panel)
SHAPES = [(1, 64, 32), (5, 96, 70), (13, 576, 960), (64, 192, 17), (71, 128, 33), (8, 1536, 48), (3, 64, 1),
          (29, 128, 40), (40, 64, 48)]


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ w.T
    return y + bias if bias is not None else y


def _tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # fp32 rounding of sums of |x*w| (plus the u4 min term's sum of x), in any order: a few ulps of the
    # largest partial sum per output
    return (x.float().abs() @ w.abs().T) * 2e-6 + 1e-6


def _weights(kind: str, n: int, k: int, gen: torch.Generator) -> tuple[PackedWeight, torch.Tensor]:
    w = torch.randn(n, k, generator=gen) * 0.05
    if kind == "bf16":
        wb = w.to(torch.bfloat16)
        return pack_bf16(wb), wb.float()
    if kind == "i8-groups":  # GGUF's Q8_0: an fp32 scale per 32 inputs
        blocks = w.reshape(n, k // 32, 32)
        scales = blocks.abs().amax(-1).clamp_min(1e-8) / 127
        codes = torch.round(blocks / scales[..., None]).clamp_(-127, 127).to(torch.int8).reshape(n, k)
        q = QuantizedWeight("i8", codes, scales, None, 32, "test")
    else:
        q = quantize_int4(w) if kind == "u4" else quantize_int8(w)
    return pack_quantized(q), q.dequantize()


@contextmanager
def linear_path(path: str) -> Iterator[None]:
    """Runs the block on one of the kernels' fast paths (a process-wide choice), then restores the one before."""
    if path not in kernels.linear_paths:
        pytest.skip(f"this build has no {path!r} path (it has: {kernels.linear_paths})")
    with kernels.on_linear_path(path):
        yield


@pytest.mark.parametrize("path", ["dot", "fma", "portable"])
@pytest.mark.parametrize("kind", ["bf16", "i8", "i8-groups", "u4"])
def test_kernel_equals_dequantize_then_matmul(kind: str, path: str) -> None:
    """Each fast path (AVX512-BF16 dot products, fp32 FMAs) and the portable C one."""
    portable = path == "portable"
    with nullcontext() if portable else linear_path(path):
        _check_kernel_against_reference(kind, portable)


@pytest.mark.parametrize("path", ["dot", "fma", "portable"])
@pytest.mark.parametrize("kind", ["bf16", "i8", "i8-groups", "u4"])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(kind: str, path: str) -> None:
    """A row's output bits are the same whatever rows share its call and wherever it sits among them, so a
    request's answer never changes with the requests batched beside it: one row alone (four tiles a pass),
    two to seven (two-tile passes of that many rows), 8- and 4-row passes and what they leave, 7 tiles (a
    two-tile pass leaves one, a four-tile pass three); on `fma` also 16-row passes and the widened passes
    of 32 rows and more. Before each pass added a row's products in one
    order, a row of a 1-3-row pass split its sums over several chains, and a seeded answer of the embedded
    model changed with the requests beside it by its third token."""
    portable = path == "portable"
    gen = torch.Generator().manual_seed(17)
    with nullcontext() if portable else linear_path(path):
        # 7 tiles, 2 (with a bias), 1, and 13 (one-row passes of 4, 4, 4 and 1 on two threads)
        for n, with_bias in [(99, False), (32, True), (16, False), (208, False)]:
            packed, _ = _weights(kind, n, 576, gen)
            bias = torch.randn(n, generator=gen) if with_bias else None
            x = torch.randn(70, 576, generator=gen).to(torch.bfloat16)
            every = kernels.linear(x, packed, bias, torch.empty(70, n), portable=portable)
            # one row; two to seven; 8- and 4-row passes and one row left (9, 13, 17); a 64-row chunk and
            # a lone row after it (65)
            for start, m in [(0, 1), (5, 1), (69, 1), (0, 2), (3, 3), (1, 4), (2, 5), (0, 7), (9, 8), (3, 9),
                             (4, 12), (0, 13), (7, 16), (1, 17), (0, 65), (5, 65)]:
                part = kernels.linear(x[start:start + m], packed, bias, torch.empty(m, n), portable=portable)
                assert torch.equal(part, every[start:start + m]), (kind, n, start, m)


@pytest.mark.parametrize("path", ["dot", "fma", "portable"])
@pytest.mark.parametrize("kind", ["bf16", "i8"])
def test_an_odd_count_of_input_pairs(kind: str, path: str) -> None:
    """70 inputs are 35 pairs in one group: the FMA path walks the pair-rows one at a time into one chain a
    row, and the odd last one must still be summed, at every row count a one-tile pass takes."""
    portable = path == "portable"
    gen = torch.Generator().manual_seed(11)
    with nullcontext() if portable else linear_path(path):
        for m, n in [(1, 48), (2, 33), (3, 16), (5, 40), (9, 17)]:
            packed, w = _weights(kind, n, 70, gen)
            x = (torch.randn(m, 70, generator=gen) * 2).to(torch.bfloat16)
            got = kernels.linear(x, packed, None, torch.empty(m, n), portable=portable)
            assert ((got - _reference(x, w, None)).abs() <= _tolerance(x, w)).all(), (kind, m, n)


@pytest.mark.parametrize("path", ["dot", "fma", "portable"])
@pytest.mark.parametrize("kind", ["bf16", "i8", "u4"])
def test_no_rows_is_an_empty_answer(kind: str, path: str) -> None:
    """A step whose prompt chunks all stop short of their last token asks the head for no logits: zero rows
    must come back empty, not fault (the FMA path once divided by its zero panel width and killed the
    server on any lone prompt longer than a step's budget)."""
    portable = path == "portable"
    packed, _ = _weights(kind, 48, 256, torch.Generator().manual_seed(3))
    x = torch.empty(0, 256, dtype=torch.bfloat16)
    with nullcontext() if portable else linear_path(path):
        for out_dtype in (torch.bfloat16, torch.float32):
            y = kernels.linear(x, packed, None, torch.empty(0, 48, dtype=out_dtype), portable=portable)
            assert y.shape == (0, 48)


def _check_kernel_against_reference(kind: str, portable: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    for m, k, n in SHAPES:
        packed, w = _weights(kind, n, k, gen)
        x = (torch.randn(m, k + 6, generator=gen) * 2).to(torch.bfloat16)
        x = x[:, 3:3 + k] if m % 2 else x[:, :k].contiguous()  # odd row counts: rows strided in a wider buffer
        for bias in (None, torch.randn(n, generator=gen)):
            want = _reference(x, w, bias)
            got32 = kernels.linear(x, packed, bias, torch.empty(m, n), portable=portable)
            assert ((got32 - want).abs() <= _tolerance(x, w)).all(), (kind, m, k, n)
            got16 = kernels.linear(x, packed, bias, portable=portable)
            assert got16.dtype == torch.bfloat16
            # bf16 output: the fp32 result rounded once (within one bf16 ulp of the reference)
            assert torch.allclose(got16.float(), want, rtol=2 ** -8, atol=1e-5), (kind, m, k, n)


@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
@pytest.mark.parametrize("group", [32, 64])
def test_int8_activations_equal_their_reference(group: int, portable: bool) -> None:
    """--linear-activations int8: x in int8 blocks of 32 against u4 weights (VNNI where the CPU has it)."""
    gen = torch.Generator().manual_seed(17)
    for m, k, n, q, packed, x, bias in _int4_cases(SHAPES, group, gen):
        want = linear_int8_activations(x, q) + bias
        got = kernels.linear(x, packed, bias, torch.empty(m, n), portable=portable, int8_activations=True)
        assert ((got - want).abs() <= _tolerance(x, q.dequantize())).all(), (m, k, n)
        # the mode is not ignored: bf16 activations give measurably different sums
        plain = kernels.linear(x, packed, bias, torch.empty(m, n), portable=portable)
        assert (plain - want).abs().max() > 10 * _tolerance(x, q.dequantize()).max(), (m, k, n)


def _int4_cases(shapes: list[tuple[int, int, int]], group: int, gen: torch.Generator) -> Iterator[
        tuple[int, int, int, QuantizedWeight, PackedWeight, torch.Tensor, torch.Tensor]]:
    """(m, k, n, int4 weights, their packing, x, fp32 bias) for each shape whose k the group divides."""
    for m, k, n in shapes:
        if k % group:
            continue
        q = quantize_int4(torch.randn(n, k, generator=gen) * 0.05, group=group)
        x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16)
        yield m, k, n, q, pack_quantized(q), x, torch.randn(n, generator=gen)


def _row_modes(m: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Flags per row: none, all, alternating, a lone exact row inside int8 runs (a prompt chunk's logits
    row), an exact run across the 64-row chunk's edge, and a random draw."""
    rows = torch.arange(m)
    lone = torch.ones(m, dtype=torch.bool)
    lone[m // 2] = False
    modes = [torch.zeros(m, dtype=torch.bool), torch.ones(m, dtype=torch.bool), rows % 2 == 0, lone,
             (rows < 60) | (rows >= 67), torch.rand(m, generator=gen) < 0.5]
    return [mode.to(torch.uint8) for mode in modes]


@pytest.mark.parametrize("group", [32, 64])
def test_a_mode_per_row_gives_each_row_its_own_modes_sums(group: int) -> None:
    """--linear-activations int8-prompt: in one call, the flagged rows take int8 activations and the others
    exact ones, each row equal to its own mode's reference and measurably apart from the other mode's."""
    if not kernels.takes_int8_rows():
        pytest.skip("no mode per row on this build's path (it needs the VNNI int8 and AVX512-BF16 dot tiles)")
    gen = torch.Generator().manual_seed(31)
    for m, k, n, q, packed, x, bias in _int4_cases(SHAPES + [(130, 128, 48)], group, gen):
        want_int8, want_exact = linear_int8_activations(x, q) + bias, _reference(x, q.dequantize(), bias)
        tolerance = _tolerance(x, q.dequantize())
        every_exact = kernels.linear(x, packed, bias, torch.empty(m, n))
        for flags in _row_modes(m, gen):
            on = flags.bool()[:, None]
            got = kernels.linear(x, packed, bias, torch.empty(m, n), int8_activations=True, int8_rows=flags)
            assert ((got - torch.where(on, want_int8, want_exact)).abs() <= tolerance).all(), (m, k, n, flags)
            # an exact row's bits are those of a call where every row is exact (one order of sums per row)
            assert torch.equal(got[~flags.bool()], every_exact[~flags.bool()]), (m, k, n, flags)
            apart = (torch.where(on, want_exact, want_int8) - got).abs().amax(dim=1)
            assert (apart > 10 * tolerance.amax(dim=1)).all(), (m, k, n, flags)  # no row took the other mode
            # bf16 out, no bias: the same sums, rounded once
            rounded = kernels.linear(x, packed, int8_activations=True, int8_rows=flags)
            assert rounded.dtype == torch.bfloat16
            assert ((rounded.float() - (got - bias)).abs() <= (got - bias).abs() / 128 + tolerance).all(), (m, k, n)


def test_a_mode_per_row_is_refused_where_the_kernels_have_none() -> None:
    gen = torch.Generator().manual_seed(37)
    q = quantize_int4(torch.randn(16, 64, generator=gen) * 0.05)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    with pytest.raises(KernelUnsupported):
        kernels.linear(x, pack_quantized(q), portable=True, int8_activations=True,
                       int8_rows=torch.ones(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="one contiguous uint8 flag per row"):
        kernels.linear(x, pack_quantized(q), int8_activations=True, int8_rows=torch.ones(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="applies to int8 activations against 4-bit weights"):
        kernels.linear(x, pack_quantized(q), int8_rows=torch.ones(4, dtype=torch.uint8))  # int8 activations off


def test_int8_activation_codes_round_like_the_kernels() -> None:
    x = torch.tensor([[0.5, -1.0, 0.25, 0.75] + [0.0] * 28, [0.0] * 32, [0.5, 3000.0, -1.0] + [0.0] * 29],
                     dtype=torch.bfloat16)
    codes, scales, outliers = quantize_blocks(x)
    assert codes[0, :4].tolist() == [64.0, -127.0, 32.0, 95.0]  # 63.5 rounds to even; the largest is +-127
    assert scales[0, 0] == pytest.approx(1 / 127) and scales[1, 0] == 0 and not codes[1].any()
    assert not outliers[:2].any()  # -1.0 is not over twice 0.75
    # a massive value is kept exact and the rest of its block is coded at its own scale
    assert outliers[2].tolist() == [0.0, float(x[2, 1])] + [0.0] * 30  # 3000 in bf16 (3008)
    assert codes[2, :3].tolist() == [64.0, 0.0, -127.0] and scales[2, 0] == pytest.approx(1 / 127)


@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
def test_int8_activations_keep_a_massive_value_exact(portable: bool) -> None:
    """A value of thousands among values of about one: its block's others must still count."""
    gen = torch.Generator().manual_seed(29)
    q = quantize_int4(torch.randn(40, 96, generator=gen) * 0.05)
    x = torch.randn(6, 96, generator=gen)
    x[:, 37] = 3000.0  # block 1's input 5, every row
    x[2, 70] = -2500.0  # block 2, one row
    x = x.to(torch.bfloat16)
    got = kernels.linear(x, pack_quantized(q), None, torch.empty(6, 40), portable=portable, int8_activations=True)
    want = linear_int8_activations(x, q)
    # the kernels sum the code term and the min term apart (d q and m, each larger than w = d q + m),
    # so their fp32 rounding is a few ulps of x against |d q| + |m|
    per_input = lambda t: t.float().repeat_interleave(q.group, dim=1)  # noqa: E731
    parts = (q.codes.float() * per_input(q.scales)).abs() + per_input(q.mins).abs()
    assert ((got - want).abs() <= (x.float().abs() @ parts.T) * 2e-6 + 1e-6).all()
    exact = x.float() @ q.dequantize().T
    # close to the exact product: without the outlier, block 1's other 31 inputs would quantize to 0
    assert ((got - exact).abs() <= 0.02 * exact.abs().amax(1, keepdim=True)).all()


def test_int8_activations_leave_other_formats_alone() -> None:
    gen = torch.Generator().manual_seed(19)
    x = torch.randn(6, 128, generator=gen).to(torch.bfloat16)
    for packed, _ in (_weights("i8", 40, 128, gen), _weights("bf16", 40, 128, gen)):
        assert torch.equal(kernels.linear(x, packed, None, torch.empty(6, 40), int8_activations=True),
                           kernels.linear(x, packed, None, torch.empty(6, 40)))


def test_a_described_pass_equals_its_calls_one_by_one() -> None:
    """bench_kernels times a pass of projections in one C call: it must compute what the calls do."""
    gen = torch.Generator().manual_seed(23)
    packed = [_weights(kind, n, k, gen)[0] for kind, n, k in (("u4", 48, 64), ("i8", 17, 96), ("bf16", 33, 64))]
    x = {k: torch.randn(5, k, generator=gen).to(torch.bfloat16) for k in (64, 96)}
    for int8 in (False, True):
        outs = [torch.empty(5, p.out_features, dtype=torch.bfloat16) for p in packed]
        kernels.run_linear_calls(kernels.linear_calls([(x[p.in_features], p, o) for p, o in zip(packed, outs)], int8))
        for p, o in zip(packed, outs):
            assert torch.equal(o, kernels.linear(x[p.in_features], p, int8_activations=int8))


def test_gguf_style_groups_of_32_in_i8_and_strided_rows() -> None:
    """Q8_0-shaped int8 (a scale per 32 inputs), and x rows taken from a wider buffer."""
    gen = torch.Generator().manual_seed(3)
    n, k = 40, 128
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // 32, generator=gen) * 0.01
    q = QuantizedWeight("i8", codes, scales, None, 32, "gguf Q8_0")
    wide = (torch.randn(9, k + 10, generator=gen)).to(torch.bfloat16)
    x = wide[:, 4:4 + k]
    got = kernels.linear(x, pack_quantized(q), None, torch.empty(9, n))
    w = q.dequantize()
    assert ((got - _reference(x, w, None)).abs() <= _tolerance(x, w)).all()


def test_fused_projections_pack_like_their_parts() -> None:
    gen = torch.Generator().manual_seed(5)
    parts = [quantize_int4(torch.randn(n, 64, generator=gen)) for n in (48, 16, 16)]
    fused = concat(parts)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    got = kernels.linear(x, pack_quantized(fused), None, torch.empty(4, 80))
    want = torch.cat([_reference(x, p.dequantize(), None) for p in parts], dim=1)
    assert ((got - want).abs() <= _tolerance(x, fused.dequantize())).all()


def test_int4_and_int8_quantization_round_trip_closely() -> None:
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(64, 256, generator=gen) * 0.02
    for q, bound in ((quantize_int8(w), 0.5 / 127), (quantize_int4(w), 0.5 / 15)):
        # each weight within half a step of its group's (or channel's) range
        span = w.abs().amax(1, keepdim=True) if q.kind == "i8" else \
            (w.view(64, -1, 32).amax(-1) - w.view(64, -1, 32).amin(-1)).repeat_interleave(32, 1)
        assert ((q.dequantize() - w).abs() <= span * bound * 1.01 + 1e-6).all()


def test_refuses_what_it_cannot_compute() -> None:
    packed, _ = _weights("u4", 16, 64, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError):
        kernels.linear(torch.zeros(2, 64), packed)  # fp32 rows
    with pytest.raises(ValueError):
        kernels.linear(torch.zeros(2, 32, dtype=torch.bfloat16), packed)  # wrong width
    with pytest.raises(ValueError):
        pack_quantized(quantize_int4(torch.zeros(4, 48), group=16))  # u4 groups must be whole 32s


@pytest.mark.parametrize("kind", ["u4", "i8"])
def test_two_term_fallback_keeps_the_quantized_weights_exact(kind: str) -> None:
    """The oneDNN fallback for large batches (AMX) multiplies hi + lo, not the weights rounded to bf16:
    its bf16 outputs equal the fp32 reference's rounding nearly everywhere (elsewhere within the output's
    rounding plus ~2^-15 of the terms' magnitudes), where one bf16 term misses ~40% of them."""
    if not _mkldnn_packing_available(torch.bfloat16, torch.device("cpu")):
        pytest.skip("torch without oneDNN bf16 weight packing")
    gen = torch.Generator().manual_seed(11)
    for m, k, n in [(40, 576, 256), (96, 1536, 96), (7, 64, 33)]:
        w = torch.randn(n, k, generator=gen) * 0.05
        q = quantize_int4(w) if kind == "u4" else quantize_int8(w)
        x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16)
        bias = torch.randn(n, generator=gen).to(torch.bfloat16)
        want32 = x.float() @ q.dequantize().T + bias.float()
        want = want32.to(torch.bfloat16)
        fallback = TwoTermBf16Linear.build(q, bias)
        assert fallback is not None
        got = fallback(x)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        magnitude = x.float().abs() @ q.dequantize().abs().T + bias.float().abs()
        assert bool(((got.float() - want32).abs() <= want32.abs() * 2**-8 + magnitude * 2**-15).all())
        assert float((got == want).float().mean()) > 0.99
        one_term = Linear(q.dequantize().to(torch.bfloat16), bias)(x)
        assert float((one_term == want).float().mean()) < 0.8  # what the second term is for


def test_packed_linear_sends_batches_over_its_limit_to_the_fallback(monkeypatch) -> None:
    if not _mkldnn_packing_available(torch.bfloat16, torch.device("cpu")):
        pytest.skip("torch without oneDNN bf16 weight packing")
    assert kernels is not None  # the module is skipped without them
    gen = torch.Generator().manual_seed(5)
    layers = [PackedLinear(pack_quantized(q), None, kernels, quantized=q)
              for q in (quantize_int4(torch.randn(64, 128, generator=gen) * 0.05) for _ in range(2))]
    attach_two_term_fallbacks(layers, rows=8)
    calls = []

    def counted(inner, x):
        calls.append(x.shape[0])
        return inner(x)

    for lin in layers:
        monkeypatch.setattr(lin, "fallback", partial(counted, lin.fallback))
    for rows in (1, 8, 9, 40):
        x = (torch.randn(rows, 128, generator=gen)).to(torch.bfloat16)
        for lin in layers:
            want = (x.float() @ lin.quantized.dequantize().T).to(torch.bfloat16)
            assert float((lin(x) == want).float().mean()) > 0.97
    assert calls == [9, 9, 40, 40]  # up to 8 rows on the packed kernel, more on oneDNN
    assert layers[0].weight.shape == (64, 128)  # still the quantized weights' meaning, not [hi | lo]


@pytest.mark.parametrize("measured_limit", [64, 512])
def test_start_up_probe_decides_the_quantized_fallback(monkeypatch, measured_limit: int) -> None:
    """Where the probe finds oneDNN clearly faster above some batch (AMX), the layers' quantized linears
    take it there; where the packed kernels hold up to the largest probe (this class of machine),
    nothing is attached. The one-off matrix (the head) keeps its kernel either way."""
    if not _mkldnn_packing_available(torch.bfloat16, torch.device("cpu")):
        pytest.skip("torch without oneDNN bf16 weight packing")
    probed = []

    def measured(lin, fallback, probes, margin, rounds=3):  # the largest probe where the kernel still wins
        probed.append(probes)
        return max((rows for rows in probes if rows <= measured_limit), default=0)

    monkeypatch.setattr(weights_module, "_kernel_row_limit", measured)
    monkeypatch.setattr(weights_module, "_has_matrix_unit", lambda: True)  # the probe runs where AMX is
    builder = weights_module.LinearBuilder("int4", torch.bfloat16, torch.device("cpu"), kernels)
    gen = torch.Generator().manual_seed(2)
    layers = [builder.build([f"l{i}"], [torch.randn(64, 128, generator=gen)], None) for i in range(3)]
    head = builder.build(["head"], [torch.randn(96, 128, generator=gen)], None)
    summary = builder.tune()
    assert head.fallback is None
    if measured_limit == 64:
        assert "two-term bf16 oneDNN above 64 rows" in summary
        assert all(isinstance(lin.fallback, TwoTermBf16Linear) and lin.max_kernel_rows == 64 for lin in layers)
        assert layers[0].takes(64) and not layers[0].takes(65)
        assert len(probed) == 2  # the quick look at the largest batch, then the search
    else:
        assert "no oneDNN fallback" in summary
        assert all(lin.fallback is None and lin.takes(4096) for lin in layers)
        assert probed == [(512,)]  # the quick look sufficed


@pytest.mark.parametrize("measured_limit", [64, 256])
def test_bf16_weights_keep_the_kernels_at_every_batch_unless_onednn_is_clearly_faster(monkeypatch,
                                                                                       measured_limit: int) -> None:
    """bf16 weights switch to oneDNN above a row count only where it measured _FALLBACK_MARGIN faster there
    (AMX tiles); where the kernels hold to the largest probe (oneDNN on the same dot products, as here) they
    run every batch, so no row's bits change with the number of rows in its step. The choice survives the
    tuning cache: a warm start reads "every batch" back as such, not as the largest probe."""
    if not _mkldnn_packing_available(torch.bfloat16, torch.device("cpu")):
        pytest.skip("torch without oneDNN bf16 weight packing")
    margins = []

    def measured(lin, fallback=None, probes=weights_module._ROW_PROBES, margin=1.05, rounds=3):
        margins.append(margin)
        return max((rows for rows in probes if rows <= measured_limit), default=0)

    monkeypatch.setattr(weights_module, "_kernel_row_limit", measured)

    def build() -> tuple[weights_module.LinearBuilder, list[Any]]:
        builder = weights_module.LinearBuilder("none", torch.bfloat16, torch.device("cpu"), kernels)
        gen = torch.Generator().manual_seed(4)
        layers = [builder.build([f"l{i}"], [torch.randn(64, 128, generator=gen)], None) for i in range(3)]
        return builder, layers

    monkeypatch.setattr(weights_module, "CpuContention", QuietMachine)  # kept whatever the other worker does
    saved: dict = {}
    builder, layers = build()
    if not all(isinstance(lin, PackedLinear) for lin in layers):
        pytest.skip("bf16 weights stay with torch on this kernel build (no AVX512-BF16)")

    class Cache:  # the tuning cache's interface, in memory
        def load(self):
            return saved or None

        def save(self, results):
            saved.update(results)

    summary = builder.tune(Cache())  # type: ignore[arg-type]
    assert margins and set(margins) == {weights_module._FALLBACK_MARGIN}
    for start in ("cold", "warm"):
        if measured_limit == 64:
            assert all(lin.max_kernel_rows == 64 and lin.takes(64) and not lin.takes(65) for lin in layers), start
            assert "up to 64 rows (oneDNN above)" in summary
        else:
            assert all(lin.max_kernel_rows is None and lin.takes(100_000) for lin in layers), start
            assert "at every batch" in summary
        margins.clear()
        builder, layers = build()
        summary = builder.tune(Cache())  # type: ignore[arg-type]
        assert not margins  # read back, not probed
        assert "measured at an earlier start" in summary


@pytest.mark.parametrize("mode", ["int4", "none"])
def test_batch_invariant_attaches_no_fallback_where_onednn_would_win(monkeypatch, mode: str) -> None:
    """--batch-invariant: even where oneDNN is a matrix unit's (AMX) and would measure faster, no batch leaves
    the packed kernels, for quantized weights (the two-term fallback) and bf16 weights alike; nothing is
    probed for it."""
    if not _mkldnn_packing_available(torch.bfloat16, torch.device("cpu")):
        pytest.skip("torch without oneDNN bf16 weight packing")
    monkeypatch.setattr(weights_module, "_has_matrix_unit", lambda: True)
    monkeypatch.setattr(weights_module, "_kernel_row_limit", lambda *a, **k: pytest.fail("probed"))
    builder = weights_module.LinearBuilder(mode, torch.bfloat16, torch.device("cpu"), kernels, batch_invariant=True)
    gen = torch.Generator().manual_seed(2)
    layers = [builder.build([f"l{i}"], [torch.randn(64, 128, generator=gen)], None) for i in range(3)]
    if not all(isinstance(lin, PackedLinear) for lin in layers):
        pytest.skip("bf16 weights stay with torch on this kernel build (no AVX512-BF16)")
    summary = builder.tune()
    assert all(lin.takes(100_000) for lin in layers)
    assert "--batch-invariant" in summary


def test_batch_invariant_reaches_the_weights_from_the_command_line() -> None:
    from dataclasses import replace

    from engine.llm_engine import LLMEngine
    from spark_server.settings import Settings

    config = Settings(batch_invariant=True).engine_config()
    assert config.batch_invariant
    engine = LLMEngine(replace(config, kv_cache_space_gib=0.25))
    assert engine.model.builder.batch_invariant


def test_no_fallback_probe_without_a_matrix_unit(monkeypatch) -> None:
    """Without AMX the probe is skipped (oneDNN's bf16 matmul runs on the same dot products there)."""
    monkeypatch.setattr(weights_module, "_has_matrix_unit", lambda: False)
    monkeypatch.setattr(weights_module, "_kernel_row_limit", lambda *a, **k: pytest.fail("probed"))
    builder = weights_module.LinearBuilder("int4", torch.bfloat16, torch.device("cpu"), kernels)
    gen = torch.Generator().manual_seed(2)
    layers = [builder.build([f"l{i}"], [torch.randn(64, 128, generator=gen)], None) for i in range(2)]
    builder.tune()
    assert all(lin.fallback is None for lin in layers)


def test_the_linear_path_is_not_ignored() -> None:
    """Setting the path changes which kernel runs: the two sum in different orders, so a wide product
    differs in its last bits somewhere (and each stays within the reference's tolerance above)."""
    if len(kernels.linear_paths) < 2:
        pytest.skip("one fast path in this build")
    gen = torch.Generator().manual_seed(3)
    packed, _ = _weights("bf16", 960, 576, gen)
    x = (torch.randn(13, 576, generator=gen) * 2).to(torch.bfloat16)
    outs = {}
    for path in ("dot", "fma"):
        with linear_path(path):
            outs[path] = kernels.linear(x, packed, None, torch.empty(13, 960))
            assert kernels.linear_path == path
    assert not torch.equal(outs["dot"], outs["fma"])
    with pytest.raises(ValueError, match="not in this build"):
        kernels.set_linear_path("amx")


def _two_path_layers(seed: int) -> list[PackedLinear]:
    """Two small 4-bit layers for the kernel path probe's tests; skips where the build has one fast path."""
    if len(kernels.linear_paths) < 2:
        pytest.skip("one fast path in this build")
    assert kernels is not None and kernels.linear_path is not None  # built with both fast paths
    gen = torch.Generator().manual_seed(seed)
    return [PackedLinear(_weights("u4", 96, 64, gen)[0], None, kernels) for _ in range(2)]


@pytest.mark.parametrize("faster", ["dot", "fma"])
def test_start_up_keeps_the_faster_linear_path(monkeypatch, faster: str) -> None:
    """The start-up choice follows the timings (here made up: the path named ``faster`` takes half the
    time), and the fp32 FMA path must win by the margin to replace the default."""
    layers = _two_path_layers(5)
    assert kernels is not None and kernels.linear_path is not None  # for the type checker
    monkeypatch.setattr(weights_module, "_best_time",
                        lambda fn, reps=5: 1.0 if kernels.linear_path == faster else 2.0)
    with kernels.on_linear_path(kernels.linear_path):  # whatever it chooses is undone after
        phrase, doubt = weights_module.choose_linear_path(layers)
        assert doubt is None
        assert kernels.linear_path == faster
        assert ("fp32 FMAs (" if faster == "fma" else "AVX512-BF16 dot products (") in phrase
        # within the margin the default stays
        monkeypatch.setattr(weights_module, "_best_time",
                            lambda fn, reps=5: 1.0 if kernels.linear_path == "fma" else 1.02)
        weights_module.choose_linear_path(layers)
        assert kernels.linear_path == "dot"


def test_the_path_probe_stops_early_only_on_a_wide_lead(monkeypatch) -> None:
    """Two rounds where one path leads by more than _PATH_DECIDED; all five where the two are close."""
    layers = _two_path_layers(6)
    assert kernels is not None and kernels.linear_path is not None  # for the type checker
    per_round = 2 * len(weights_module._PATH_PROBE_ROWS)
    for fma_time, rounds in ((2.0, 2), (1.1, 5)):
        calls: list[str | None] = []

        def timed(fn, reps=5, fma_time=fma_time, calls=calls):
            calls.append(kernels.linear_path)
            return fma_time if kernels.linear_path == "fma" else 1.0

        monkeypatch.setattr(weights_module, "_best_time", timed)
        with kernels.on_linear_path(kernels.linear_path):
            weights_module.choose_linear_path(layers)
            assert kernels.linear_path == "dot"
        assert len(calls) == rounds * per_round


# Best-of timings a start took beside another engine's busy steps (AMD EPYC Zen 4, kept in its tuning cache):
# every sample of a path's 1- and 8-row passes held a scheduler tick or two; the 32-row pass of the same
# path did not. The fp32 FMA path won the sum and was kept, at half the dot products' speed.
_STALLED = {"dot": (7.99e-3, 15.97e-3, 0.34e-3), "fma": (0.05e-3, 0.18e-3, 0.62e-3)}
_DOT_FASTER = {"dot": (0.03e-3, 0.08e-3, 0.29e-3), "fma": (0.04e-3, 0.16e-3, 0.60e-3)}
_FMA_FASTER = {"dot": (0.04e-3, 0.10e-3, 0.60e-3), "fma": (0.04e-3, 0.09e-3, 0.29e-3)}  # as on an Intel Xeon


@pytest.mark.parametrize("then", ["dot", "fma", None])
def test_a_stalled_path_probe_does_not_choose_from_its_stalls(monkeypatch, then: str | None) -> None:
    """Timings where more rows of the same weights ran faster than fewer are stalls, not the path's speed:
    the probe goes on until its rounds give plausible times (then chooses from them: ``then`` is the path
    they favour) or its time is up (None: then it keeps the default, and says why, so that the timings are
    not kept for later starts)."""
    layers = _two_path_layers(7)
    assert kernels is not None and kernels.linear_path is not None  # for the type checker
    rows = weights_module._PATH_PROBE_ROWS
    stalled_rounds = 3
    calls: list[tuple[str | None, int]] = []

    def timed(fn, reps=5):
        x = fn.args[0]
        round_ = len(calls) // (2 * len(rows))
        calls.append((kernels.linear_path, x.shape[0]))
        plausible = {"dot": _DOT_FASTER, "fma": _FMA_FASTER, None: _STALLED}[then]
        table = _STALLED if round_ < stalled_rounds else plausible
        return table[kernels.linear_path][rows.index(x.shape[0])]

    monkeypatch.setattr(weights_module, "_best_time", timed)
    monkeypatch.setattr(weights_module, "_PATH_BUDGET_S", 0.05)
    monkeypatch.setattr(weights_module, "CpuContention", QuietMachine)  # the timings alone decide here
    with kernels.on_linear_path(kernels.linear_path):
        phrase, doubt = weights_module.choose_linear_path(layers)
        assert kernels.linear_path == (then or "dot")
    assert (doubt is None) == (then is not None)
    assert ("the default kept: timings were implausible" in phrase) == (then is None)
    assert len(calls) > stalled_rounds * 2 * len(rows)  # it went on past the stalled rounds


def test_a_contended_path_probe_keeps_the_default(monkeypatch) -> None:
    """Stalls that hit both paths alike pass the rows rule; a probe whose threads queued for a CPU keeps the
    default path whatever its timings say."""
    layers = _two_path_layers(9)
    assert kernels is not None and kernels.linear_path is not None  # for the type checker
    rows = weights_module._PATH_PROBE_ROWS
    monkeypatch.setattr(weights_module, "_best_time",
                        lambda fn, reps=5: _FMA_FASTER[kernels.linear_path][rows.index(fn.args[0].shape[0])])
    for share, expected in ((0.5, "dot"), (0.0, "fma")):
        monkeypatch.setattr(weights_module, "CpuContention", partial(QuietMachine, share))
        with kernels.on_linear_path(kernels.linear_path):
            phrase, doubt = weights_module.choose_linear_path(layers)
            assert kernels.linear_path == expected
        assert (doubt is not None) == (share > 0), phrase
        assert ("threads queued for a CPU (one waited 50%" in phrase) == (share > 0)


@pytest.mark.parametrize("quiet", [True, False])
def test_start_up_keeps_its_measurements_only_from_a_quiet_machine(monkeypatch, quiet: bool) -> None:
    """Where other work contended for the CPUs while start-up measured the kernels, the measurements serve
    this start but are not kept: the next start measures again, rather than every later start inheriting a
    neighbour's stalls."""
    gen = torch.Generator().manual_seed(8)
    builder = weights_module.LinearBuilder("int4", torch.bfloat16, torch.device("cpu"), kernels)
    layers = [builder.build([f"l{i}"], [torch.randn(64, 128, generator=gen)], None) for i in range(2)]
    if not all(isinstance(lin, PackedLinear) for lin in layers):
        pytest.skip("no packed kernels in this build")
    monkeypatch.setattr(weights_module, "CpuContention", lambda: QuietMachine(0.0 if quiet else 0.8))
    # the path probe's own verdict on its timings (implausible ones are not kept either) would follow how busy
    # the machine running the tests is: taken as trusted, so only the contention reading decides
    path_probe = weights_module.choose_linear_path
    monkeypatch.setattr(weights_module, "choose_linear_path", lambda packed: (path_probe(packed)[0], None))
    saved: list[dict] = []

    class Cache:
        def load(self):
            return None

        def save(self, results):
            saved.append(results)

    summary = builder.tune(Cache())  # type: ignore[arg-type]
    assert builder.rates is not None  # measured and used either way
    assert bool(saved) == quiet
    assert ("not kept: the probes' threads queued for a CPU (one waited 80%" in summary) == (not quiet)


@pytest.mark.parametrize("inputs", [256, 288])  # whole dequantized ranges of 128 inputs, and a ragged last one
@pytest.mark.parametrize("kind", ["bf16", "i8", "i8-groups", "u4"])
def test_fma_rows_give_the_same_bits_in_any_batch(kind: str, inputs: int) -> None:
    """The FMA path widens a tile's codes once (128 inputs at a time, a group's sums carried from one range
    to the next where the group is longer) when several 16-row passes share it, and in registers for a lone
    16-row pass; both sum the same products in the same order and fold each group alike. So a row's output
    does not depend on how many rows came with it: 80 or 32 rows at once (widened once), 16 at a time (not),
    bit for bit."""
    with linear_path("fma"):
        gen = torch.Generator().manual_seed(21)
        packed, _ = _weights(kind, 48, inputs, gen)
        x = torch.randn(80, inputs, generator=gen).to(torch.bfloat16)
        apart = torch.cat([kernels.linear(x[i:i + 16], packed, None, torch.empty(16, 48)) for i in range(0, 80, 16)])
        for rows in (80, 32):
            together = kernels.linear(x[:rows], packed, None, torch.empty(rows, 48))
            assert torch.equal(together, apart[:rows]), rows
