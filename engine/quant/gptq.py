"""Per-channel int8 rounding that compensates its own error (GPTQ: Frantar et al., 2022).

Rounding every weight to the nearest int8 step minimizes the error of the weights, not of the layer's
outputs. With H = E[x x^T] over the layer's inputs, the output error of a row is e^T H e; GPTQ rounds
one input column at a time and moves each rounding error onto the columns not yet rounded, in the
proportions H's inverse gives, so later columns absorb what earlier ones lost. The result is the same
format as round-to-nearest (int8 codes, one scale per output channel: ``absmax / 127``), only better
codes. Columns go in order of decreasing input energy (``diag(H)``), so the most-used inputs are
rounded while every other column can still absorb their error.
"""

from __future__ import annotations

import torch

from engine.quant.formats import QuantizedWeight, quantize_int8

# Added to H's diagonal, as a fraction of its mean: keeps the inverse well-conditioned and the error
# spreading moderate. Measured on the embedded model with plain-text calibration (KL divergence from bf16
# on the held-out texts): 0.01 fit the samples too closely (0.0099), 0.1 gave 0.0086-0.0088, 0.3-1.0
# 0.0094-0.0096.
DEFAULT_DAMP = 0.1
_BLOCK = 128  # columns whose error is spread lazily, as one matrix product, onto the columns after them
_SUB_BLOCK = 16  # inside a block, the same again: column by column only within 16 columns


@torch.no_grad()
def quantize_int8_gptq(weight: torch.Tensor, hessian: torch.Tensor, damp: float = DEFAULT_DAMP) -> QuantizedWeight:
    """``weight`` [out, in]; ``hessian`` [in, in], the mean of x x^T over calibration inputs."""
    weight = weight.detach()
    w = weight.float().clone()
    cols = w.shape[1]
    if hessian.shape != (cols, cols):
        raise ValueError(f"hessian is {tuple(hessian.shape)}, the weight has {cols} inputs")
    scale = quantize_int8(weight).scales  # [out, 1], absmax / 127 as round-to-nearest has it
    h = hessian.float().clone()
    unused = torch.diag(h) == 0  # inputs never active in calibration: nothing to compensate with
    h[unused, unused] = 1.0
    order = torch.argsort(torch.diag(h), descending=True)
    w, h = w.index_select(1, order), h.index_select(0, order).index_select(1, order)
    h += damp * torch.diag(h).mean() * torch.eye(cols, dtype=h.dtype)
    spread = _upper_cholesky_of_inverse(h)
    # Column-major from here (a column is a contiguous row of w_t), so each step touches contiguous memory.
    w_t = w.t().contiguous()
    codes_t = torch.empty_like(w_t)
    step = scale[:, 0]
    for start in range(0, cols, _BLOCK):
        end = min(start + _BLOCK, cols)
        block = w_t[start:end].clone()
        errors = torch.empty_like(block)  # scaled by the pivots: column i's error / spread[i, i]
        _round_block(block, spread[start:end, start:end], step, codes_t[start:end], errors)
        w_t[end:].addmm_(spread[start:end, end:].t(), errors, alpha=-1.0)
    codes = codes_t.t().index_select(1, torch.argsort(order))  # back to the inputs' own order
    return QuantizedWeight("i8", codes.to(torch.int8), scale, None, cols, "int8 gptq")


def _upper_cholesky_of_inverse(h: torch.Tensor) -> torch.Tensor:
    """U, upper triangular, with U^T U = H^-1: row i holds how column i's error moves onto columns i..
    onwards. With J the reversal, J H J = L L^T gives H = R R^T for the upper R = J L J, so U = R^-1 =
    J L^-1 J: one factorization and one triangular inverse, where factoring H, inverting it and factoring
    the inverse took twice the time. fp32 is enough with the damping (the GPTQ paper's own choice)."""
    lower = torch.linalg.cholesky(h.flip(0, 1))
    return _lower_triangular_inverse(lower).flip(0, 1)


_DIRECT_INVERSE = 128  # below this size a triangular solve against the identity; above it, halves


def _lower_triangular_inverse(lower: torch.Tensor) -> torch.Tensor:
    """L^-1 by halves: [[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]]. The work is then matrix
    products, about 2.5x faster than one triangular solve against the identity (LAPACK's trtri is not
    exposed by torch)."""
    n = lower.shape[0]
    if n <= _DIRECT_INVERSE:
        return torch.linalg.solve_triangular(lower, torch.eye(n, dtype=lower.dtype), upper=False)
    half = n // 2
    first, second = _lower_triangular_inverse(lower[:half, :half]), _lower_triangular_inverse(lower[half:, half:])
    inverse = torch.zeros_like(lower)
    inverse[:half, :half] = first
    inverse[half:, half:] = second
    inverse[half:, :half] = -(second @ lower[half:, :half]) @ first
    return inverse


def _round_block(block: torch.Tensor, local: torch.Tensor, step: torch.Tensor, codes: torch.Tensor,
                 errors: torch.Tensor) -> None:
    """Round ``block``'s columns (rows of the transposed weight) in order, each column's error moved onto
    the block's later columns. Within a sub-block that is column by column; onto the sub-blocks after
    it, once, as a matrix product (the columns wait for it: nothing reads them before)."""
    n = block.shape[0]
    inverse_pivots = torch.diag(local).reciprocal()
    for s in range(0, n, _SUB_BLOCK):
        e = min(s + _SUB_BLOCK, n)
        alphas = (-inverse_pivots[s:e]).tolist()
        # Five tensor ops a column: this loop runs once per input of every linear, so its op count is
        # int8's start-up time.
        for i in range(s, e):
            q = torch.div(block[i], step, out=codes[i]).round_().clamp_(-127, 127)
            err = torch.addcmul(block[i], q, step, value=-1.0, out=errors[i])
            if i + 1 < e:
                block[i + 1:e].addr_(local[i, i + 1:e], err, alpha=alphas[i - s])
        errors[s:e].mul_(inverse_pivots[s:e].unsqueeze(1))
        if e < n:
            block[e:].addmm_(local[s:e, e:].t(), errors[s:e], alpha=-1.0)
