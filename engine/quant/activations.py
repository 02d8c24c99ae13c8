"""int8 activations for 4-bit weights: what the kernels' ``int8_activations`` mode computes, in torch.

llama.cpp multiplies its 4-bit formats against activations quantized per block of 32 inputs (Q8_1), so
the dot product runs on integers (AVX512-VNNI: 64 products an instruction, twice AVX512-BF16's 32).
The engine offers the same trade (``--linear-activations int8``): per row and block of 32 inputs,
s = max|x| / 127 and q = round(x / s) to nearest even. For a u4 weight w = d q_w + m,

    y = sum over blocks of d * s * (q_w . q_x)   +   m * sum(x)

the min term keeps the exact sum of x (llama.cpp takes it from the quantized values).

One outlier per block stays exact: when a block's largest |x| is over twice the next, it gets code 0,
the scale comes from the next largest, and its products are added in fp32 (LLM.int8's idea, per
block). Without it, a massive activation (this model's down projections see values in the
thousands) zeroes the other 31 inputs of its block.
"""

from __future__ import annotations

import torch

from engine.quant.formats import QuantizedWeight

BLOCK = 32
OUTLIER_RATIO = 2.0  # as cpu_linear.h: a block's largest is kept exact when over this many times the next


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) -> int8 codes as fp32 [M, K], scales [M, K / 32] and the exact
    outliers [M, K] (zero where none), with the kernels' rounding."""
    m, k = x.shape
    blocks = x.float().view(m, k // BLOCK, BLOCK)
    magnitude = blocks.abs()
    a1, top = magnitude.max(-1)  # the first largest
    is_top = torch.nn.functional.one_hot(top, BLOCK).bool()
    a2 = magnitude.masked_fill(is_top, 0.0).amax(-1)
    outlier = torch.isfinite(a1) & (a1 > OUTLIER_RATIO * a2)
    kept_exact = is_top & outlier[..., None]
    outliers = torch.where(kept_exact, blocks, 0.0)
    blocks = blocks.masked_fill(kept_exact, 0.0)
    amax = torch.where(outlier, a2, a1)
    usable = (amax > 0) & torch.isfinite(amax)
    # a true division (``127.0 / t`` is a reciprocal and a product in torch: it rounds differently)
    inv = torch.where(usable, torch.full_like(amax, 127.0) / torch.where(usable, amax, torch.ones_like(amax)), 0.0)
    codes = torch.round((blocks * inv[..., None]).clamp(-127.0, 127.0))
    return codes.view(m, k), amax / torch.full_like(amax, 127.0), outliers.view(m, k)


def linear_int8_activations(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """fp32 x @ W^T for a u4 weight with x's code term in int8 blocks (slow: for tests and references)."""
    assert weight.kind == "u4" and weight.mins is not None
    codes, scales, outliers = quantize_blocks(x)
    x_hat = codes * scales.repeat_interleave(BLOCK, dim=1) + outliers
    per_input = lambda t: t.float().repeat_interleave(weight.group, dim=1)  # noqa: E731
    code_term = x_hat @ (weight.codes.float() * per_input(weight.scales)).T
    return code_term + x.float() @ per_input(weight.mins).T
