"""The packed linears' AVX2 path (engine/kernels/cpu_linear_avx2.h), built here for x86-64-v3 (AVX2, FMA,
F16C, no AVX-512) whatever this CPU has beyond that, so the path CPUs without AVX-512 run is tested on
the AVX-512 machines CI runs on too. Against the slow reference (dequantize to fp32, then matmul), and
a row's output must not depend on how many rows came with it (a lone decode row and the same row in a
batch give the same bits).
"""

from __future__ import annotations

import platform

import pytest
import torch

from engine.kernels import CpuKernels, _cpu_flags, build_library, find_compiler, open_library
from engine.models import weights as weights_module
from engine.models.linear import PackedLinear, ReferenceLinear
from engine.quant.formats import quantize_int4
from engine.quant.packing import pack_quantized
from tests.engine.test_linear_kernels import SHAPES, _reference, _tolerance, _weights
from tests.engine.threads import kernel_threads

AVX2_MARCH = "-march=x86-64-v3"
KINDS = ["bf16", "i8", "i8-groups", "u4"]


def _avx2_capable() -> bool:
    flags = set(_cpu_flags().split())
    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= flags


@pytest.fixture(scope="module")
def avx2_kernels() -> CpuKernels:
    cc = find_compiler()
    if cc is None or not _avx2_capable():
        pytest.skip("needs a C compiler and an x86 CPU with AVX2, FMA and F16C")
    kern = open_library(build_library(cc, AVX2_MARCH))
    with kernel_threads(kern):
        yield kern


def test_the_build_has_the_avx2_path_and_no_other(avx2_kernels: CpuKernels) -> None:
    assert avx2_kernels.linear_isa == 1
    assert avx2_kernels.linear_paths == ("fma",)


@pytest.mark.parametrize("kind", KINDS)
def test_avx2_equals_dequantize_then_matmul(avx2_kernels: CpuKernels, kind: str) -> None:
    gen = torch.Generator().manual_seed(7)
    for m, k, n in SHAPES + [(4, 70, 33), (7, 70, 16)]:  # and an odd count of input pairs
        if kind in ("i8-groups", "u4") and k % 32:
            continue
        packed, w = _weights(kind, n, k, gen)
        x = (torch.randn(m, k + 6, generator=gen) * 2).to(torch.bfloat16)
        x = x[:, 3:3 + k] if m % 2 else x[:, :k].contiguous()  # odd row counts: rows strided in a wider buffer
        for bias in (None, torch.randn(n, generator=gen)):
            want = _reference(x, w, bias)
            got32 = avx2_kernels.linear(x, packed, bias, torch.empty(m, n))
            assert ((got32 - want).abs() <= _tolerance(x, w)).all(), (kind, m, k, n)
            got16 = avx2_kernels.linear(x, packed, bias)
            assert torch.allclose(got16.float(), want, rtol=2 ** -8, atol=1e-5), (kind, m, k, n)


@pytest.mark.parametrize("kind", KINDS)
def test_avx2_rows_give_the_same_bits_in_any_batch(avx2_kernels: CpuKernels, kind: str) -> None:
    """Every row count a pass can take (whole passes and each tail) sums a row's products in one order."""
    gen = torch.Generator().manual_seed(23)
    packed, _ = _weights(kind, 40, 256, gen)
    x = torch.randn(13, 256, generator=gen).to(torch.bfloat16)
    alone = torch.cat([avx2_kernels.linear(x[i:i + 1], packed, None, torch.empty(1, 40)) for i in range(13)])
    for rows in (2, 3, 4, 5, 6, 7, 13):
        together = avx2_kernels.linear(x[:rows], packed, None, torch.empty(rows, 40))
        assert torch.equal(together, alone[:rows]), (kind, rows)


def test_avx2_zero_rows_is_an_empty_answer(avx2_kernels: CpuKernels) -> None:
    packed, _ = _weights("u4", 48, 256, torch.Generator().manual_seed(3))
    y = avx2_kernels.linear(torch.empty(0, 256, dtype=torch.bfloat16), packed, None, torch.empty(0, 48))
    assert y.shape == (0, 48)


def test_avx2_large_batches_go_to_torchs_fp32_matmul_on_the_dequantized_weights(avx2_kernels: CpuKernels) -> None:
    """Above the row count where the start-up probe finds torch's fp32 matmul clearly faster, a quantized
    layer's batches take it; its answers are the weights' meaning (dequantize, then fp32) either way."""
    gen = torch.Generator().manual_seed(5)
    layers = [PackedLinear(pack_quantized(q), None, avx2_kernels, quantized=q)
              for q in (quantize_int4(torch.randn(64, 128, generator=gen) * 0.05) for _ in range(2))]
    assert weights_module.quantized_fallback_kind(avx2_kernels) == weights_module.FP32_DEQUANTIZED
    weights_module.attach_quantized_fallbacks(layers, 8, weights_module.FP32_DEQUANTIZED)
    calls = []
    for lin in layers:
        assert isinstance(lin.fallback, ReferenceLinear)
        inner = lin.fallback
        lin.fallback = lambda x, inner=inner: calls.append(x.shape[0]) or inner(x)
    for rows in (1, 8, 9, 40):
        x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)
        for lin in layers:
            w = lin.quantized.dequantize()
            got = lin(x).float()
            want = _reference(x, w, None)
            assert ((got - want).abs() <= want.abs() * 2 ** -8 + _tolerance(x, w)).all(), rows
    assert calls == [9, 9, 40, 40]  # up to 8 rows on the packed kernel, more on torch's fp32 matmul


def test_avx2_start_up_probe_decides_the_fp32_fallback(avx2_kernels: CpuKernels, monkeypatch) -> None:
    """The probe runs on an AVX2 build (no AMX needed): the layers take the fallback above the measured
    limit, the one-off matrix (the head) keeps its kernel."""
    probed = []

    def measured(lin, fallback, probes, margin, rounds=3):
        assert isinstance(fallback, ReferenceLinear)
        probed.append(probes)
        return max((rows for rows in probes if rows <= 16), default=0)

    monkeypatch.setattr(weights_module, "_kernel_row_limit", measured)
    monkeypatch.setattr(weights_module, "_has_matrix_unit", lambda: False)
    builder = weights_module.LinearBuilder("int4", torch.bfloat16, torch.device("cpu"), avx2_kernels)
    gen = torch.Generator().manual_seed(2)
    layers = [builder.build([f"l{i}"], [torch.randn(64, 128, generator=gen)], None) for i in range(3)]
    head = builder.build(["head"], [torch.randn(96, 128, generator=gen)], None)
    summary = builder.tune()
    assert f"{weights_module.FP32_DEQUANTIZED} above 16 rows" in summary
    assert all(isinstance(lin.fallback, ReferenceLinear) and lin.max_kernel_rows == 16 for lin in layers)
    assert head.fallback is None
    assert len(probed) == 2
