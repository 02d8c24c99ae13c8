"""The packed linears' AVX2 path (engine/kernels/csrc/linear_avx2.inc), in the avx2 target's library (x86-64-v3:
AVX2, FMA, F16C, no AVX-512) whatever this CPU has beyond that, so the path CPUs without AVX-512 run is tested
on the AVX-512 machines CI runs on too. Against the slow reference (dequantize to fp32, then matmul), and
a row's output must not depend on how many rows came with it (a lone decode row and the same row in a
batch give the same bits).
"""

from __future__ import annotations

import platform
from collections.abc import Iterator

import pytest
import torch

from engine.kernels import CpuKernels, _cpu_flags, find_compiler, installed_state, load_target
from tests.engine.test_linear_kernels import SHAPES, _reference, _tolerance, _weights
from tests.engine.threads import kernel_threads

KINDS = ["bf16", "i8", "i8-groups", "u4"]


def _avx2_capable() -> bool:
    flags = set(_cpu_flags().split())
    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= flags


@pytest.fixture(scope="module")
def avx2_kernels() -> Iterator[CpuKernels]:
    have_library = "avx2" in installed_state()[1] or find_compiler() is not None
    if not have_library or not _avx2_capable():
        pytest.skip("needs the avx2 kernel library (or a C compiler) and an x86 CPU with AVX2, FMA and F16C")
    kern = load_target("avx2")
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

