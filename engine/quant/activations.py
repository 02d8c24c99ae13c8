"""int8 activations for 4-bit weights: what the kernels' ``int8_activations`` mode computes, in torch.

llama.cpp multiplies its 4-bit formats against activations quantized per block of 32 inputs (Q8_1), so
the dot product runs on integers (AVX512-VNNI: 64 products an instruction, twice AVX512-BF16's 32).
The engine offers the same trade (``--linear-activations int8``): per row and block of 32 inputs,
s = max|x| / 127 and q = round(x / s) to nearest even. For a u4 weight w = d q_w + m,

    y = sum over blocks of d * s * (q_w . q_x)   +   m * sum(x)

the min term keeps the exact sum of x (llama.cpp takes it from the quantized values).
"""

from __future__ import annotations

import torch

from engine.quant.formats import QuantizedWeight

BLOCK = 32


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) -> int8 codes as fp32 [M, K] and scales [M, K / 32], the kernels' rounding."""
    m, k = x.shape
    blocks = x.float().view(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)
    usable = (amax > 0) & torch.isfinite(amax)
    # a true division (``127.0 / t`` is a reciprocal and a product in torch: it rounds differently)
    inv = torch.where(usable, torch.full_like(amax, 127.0) / torch.where(usable, amax, torch.ones_like(amax)), 0.0)
    codes = torch.round((blocks * inv[..., None]).clamp(-127.0, 127.0))
    return codes.view(m, k), amax / torch.full_like(amax, 127.0)


def linear_int8_activations(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """fp32 x @ W^T for a u4 weight with x's code term in int8 blocks (slow: for tests and references)."""
    assert weight.kind == "u4" and weight.mins is not None
    codes, scales = quantize_blocks(x)
    x_hat = codes * scales.repeat_interleave(BLOCK, dim=1)
    per_input = lambda t: t.float().repeat_interleave(weight.group, dim=1)  # noqa: E731
    code_term = x_hat @ (weight.codes.float() * per_input(weight.scales)).T
    return code_term + x.float() @ per_input(weight.mins).T
