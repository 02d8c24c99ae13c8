"""Linear layers with the fastest kernel the device offers.

``Linear``: dense weights. On CPU in bfloat16, oneDNN's prepacked weights (what torch.compile's CPU
backend uses) run the projections about 1.5-2x faster than plain ``F.linear``; the packing serves
any batch size.

``PackedLinear``: weights packed for the engine's own CPU kernels (engine/kernels/cpu_linear.h), in
bf16 or quantized (int8, int4, GGUF blocks). Decode steps are a few rows each and stream every weight
once, which the kernels do near memory speed. Where a dense fallback is kept (bf16 weights; quantized
weights where the start-up probe finds oneDNN much faster at large batches, as AMX makes it), batches
above ``max_kernel_rows`` (measured at start) go to oneDNN instead.

``TwoTermBf16Linear``: a quantized weight's oneDNN fallback, exact to ~2^-17 of each weight.

``ReferenceLinear``: the slow meaning of a quantized weight (dequantize to fp32, multiply in fp32),
for tests and for comparing paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import CpuKernels
from engine.quant.activations import linear_int8_activations
from engine.quant.formats import QuantizedWeight
from engine.quant.packing import PackedWeight, unpack_quantized, unpack_rows


def _mkldnn_packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _mkldnn_pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """oneDNN's prepacked layout of a bf16 weight [out, in], tried once on a zero row; None where torch
    cannot pack or run it."""
    if not _mkldnn_packing_available(weight.dtype, weight.device):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        _mkldnn_linear(torch.zeros(1, weight.shape[1], dtype=weight.dtype), packed, bias)
    except RuntimeError:
        return None
    return packed


def _mkldnn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [out, in], kept for reference paths (LoRA checks, tests)
        self.bias = bias
        self.out_features = weight.shape[0]
        self.in_features = weight.shape[1]
        self._packed = _mkldnn_pack(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return _mkldnn_linear(x, self._packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def weight_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Selected output rows of the weight, in fp32."""
        return self.weight[index].float()

    def weight_changed(self) -> None:
        """``weight`` was written in place (LoRA slots): the prepacked copy, where there is one, is remade."""
        if self._packed is not None:
            self._packed = _mkldnn_pack(self.weight, self.bias)

    @property
    def dense(self) -> bool:
        return True


class TwoTermBf16Linear:
    """x @ W^T for a quantized W as one oneDNN bf16 matmul, for large batches on CPUs where bf16
    matmuls run far faster than the packed kernels (AMX tiles).

    bf16 keeps 8 significant bits, and a 4-bit code times an fp16 scale, plus a min, needs more: the
    weights rounded to bf16 would no longer be the file's. So W is held as two bf16 terms, hi = bf16(W)
    and lo = bf16(W - hi) (~16 significant bits together, each weight within ~2^-17 of itself), side by
    side over 2 x in_features inputs that take [x, x]: one matmul, every product accumulated in fp32 as
    the packed kernels accumulate them. Twice a bf16 matmul's work, so it pays only where the start-up
    probe measures it clearly faster (``LinearBuilder.tune``)."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int, in_features: int) -> None:
        self._packed = packed  # oneDNN's blocked layout of [hi | lo], [out, 2 x in]
        self.bias = bias
        self.out_features = out_features
        self.in_features = in_features

    @classmethod
    def build(cls, quantized: QuantizedWeight, bias: torch.Tensor | None) -> TwoTermBf16Linear | None:
        """None where torch has no oneDNN bf16 weight packing (the fallback would have nothing to gain)."""
        if not _mkldnn_packing_available(torch.bfloat16, torch.device("cpu")):
            return None
        w = quantized.dequantize()
        hi = w.to(torch.bfloat16)
        lo = (w - hi.float()).to(torch.bfloat16)
        bias = bias.to(torch.bfloat16) if bias is not None else None
        packed = _mkldnn_pack(torch.cat([hi, lo], dim=1).contiguous(), bias)
        return cls(packed, bias, w.shape[0], w.shape[1]) if packed is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _mkldnn_linear(torch.cat([x, x], dim=1), self._packed, self.bias)


class PackedLinear:
    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None, kernels: CpuKernels,
                 quantized: QuantizedWeight | None = None, fallback: Linear | TwoTermBf16Linear | None = None,
                 max_kernel_rows: int | None = None, source: str | None = None) -> None:
        self.packed = packed
        self.bias = bias
        self._bias32 = bias.float().contiguous() if bias is not None else None
        self._bias_ptr = self._bias32.data_ptr() if self._bias32 is not None else None
        self.kernels = kernels
        self._quantized = quantized  # None: packed from bf16 weights (then ``fallback`` holds them), or not kept
        # what made the weight, for the log
        self.source = source or (quantized.source if quantized is not None else "bf16")
        self.fallback = fallback  # oneDNN, for batches over max_kernel_rows
        self.max_kernel_rows = max_kernel_rows
        # --linear-activations int8: 4-bit weights take x in int8 blocks (engine/quant/activations.py)
        self.int8_activations = False
        self.out_features = packed.out_features
        self.in_features = packed.in_features

    @property
    def bias_pointer(self) -> int:
        """Address of the fp32 bias the kernel adds, 0 when there is none."""
        return self._bias_ptr or 0

    def takes(self, rows: int) -> bool:
        """Whether a batch of ``rows`` runs on the packed kernel (else on the oneDNN fallback)."""
        return self.fallback is None or self.max_kernel_rows is None or rows <= self.max_kernel_rows

    def __call__(self, x: torch.Tensor, fp32_out: bool = False, int8: bool | None = None,
                 out: torch.Tensor | None = None, int8_rows: torch.Tensor | None = None) -> torch.Tensor:
        """y in x's dtype, or in fp32 (unrounded sums) when ``fp32_out`` and the kernel takes the batch;
        ``int8`` (4-bit weights) overrides ``int8_activations`` for this call; ``out`` (rows of x's dtype,
        contiguous) receives y where given. ``int8_rows`` (uint8 per row, where ``takes_int8_rows``): the
        flagged rows take int8 activations and the others exact ones, in one pass over the weight."""
        if not self.takes(x.shape[0]):
            assert self.fallback is not None
            y = self.fallback(x)
            return y if out is None else out.copy_(y)
        if x.stride(-1) != 1:
            x = x.contiguous()
        if x.dtype != torch.bfloat16 or x.shape[-1] != self.in_features:
            raise ValueError("packed linear takes bf16 rows of in_features")
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32 if fp32_out else torch.bfloat16)
        elif fp32_out or out.dtype != torch.bfloat16 or out.shape != (x.shape[0], self.out_features):
            raise ValueError("out takes bf16 rows of out_features, one per row of x")
        if int8_rows is not None:
            if not self.takes_int8_rows:
                raise ValueError("this linear takes no mode per row (4-bit weights on the dot path only)")
            self.kernels.linear_into(x, self.packed, self._bias_ptr, out, True, int8_rows=int8_rows)
            return out
        int8 = self.int8_activations if int8 is None else int8 and self.takes_int8_activations
        self.kernels.linear_into(x, self.packed, self._bias_ptr, out, int8)
        return out

    @property
    def quantized(self) -> QuantizedWeight | None:
        """The weight's codes and scales (None for bf16 weights): kept where the linear was given them, else
        unpacked from the packed layout."""
        if self._quantized is None and self.packed.fmt != "bf16":
            return unpack_quantized(self.packed, self.source)
        return self._quantized

    @property
    def takes_int8_activations(self) -> bool:
        return self.packed.fmt == "u4"

    @property
    def takes_int8_rows(self) -> bool:
        """Whether a call may give each row its own activation mode (``int8_rows``): 4-bit weights where the
        kernels' int8 and dot tiles run side by side (CpuKernels.takes_int8_rows)."""
        return self.takes_int8_activations and self.kernels.takes_int8_rows()

    @property
    def weight(self) -> torch.Tensor:
        """The whole weight in bf16 (reference paths and tests; the forward never needs it)."""
        quantized = self.quantized
        if quantized is not None:
            return quantized.dequantize().to(torch.bfloat16)
        assert isinstance(self.fallback, Linear)
        return self.fallback.weight

    def weight_rows(self, index: torch.Tensor) -> torch.Tensor:
        if self._quantized is not None:
            return self._quantized.rows(index)
        if self.packed.fmt != "bf16":
            return unpack_rows(self.packed, self.source, index).dequantize()
        assert isinstance(self.fallback, Linear)
        return self.fallback.weight_rows(index)

    @property
    def dense(self) -> bool:
        return self.packed.fmt == "bf16"


class ReferenceLinear:
    """x @ dequantize(W)^T in fp32, rounded to x's dtype once: what every packed kernel must equal.
    ``int8_activations`` (u4 weights): the code term takes x in int8 blocks, as the kernels' mode does."""

    def __init__(self, quantized: QuantizedWeight, bias: torch.Tensor | None = None,
                 int8_activations: bool = False) -> None:
        self.quantized = quantized
        self.w32 = quantized.dequantize()
        self.bias = bias
        self.int8_activations = int8_activations and self.takes_int8_activations
        self.out_features, self.in_features = quantized.shape

    def takes(self, rows: int) -> bool:
        return True

    @property
    def takes_int8_activations(self) -> bool:
        return self.quantized.kind == "u4"

    @property
    def takes_int8_rows(self) -> bool:
        return self.takes_int8_activations

    def __call__(self, x: torch.Tensor, fp32_out: bool = False, int8: bool | None = None,
                 out: torch.Tensor | None = None, int8_rows: torch.Tensor | None = None) -> torch.Tensor:
        if int8_rows is not None:  # each row as a call of its own mode computes it
            if not self.takes_int8_rows:
                raise ValueError("this linear takes no mode per row (4-bit weights only)")
            y = torch.where(int8_rows.bool()[:, None], self._y32(x, True), self._y32(x, False))
        else:
            y = self._y32(x, self.int8_activations if int8 is None else int8 and self.takes_int8_activations)
        if out is None:
            return y if fp32_out else y.to(x.dtype)
        if fp32_out or out.shape != y.shape:
            raise ValueError("out takes rows of out_features in x's dtype, one per row of x")
        return out.copy_(y)

    def _y32(self, x: torch.Tensor, int8: bool) -> torch.Tensor:
        """x @ W^T (+ bias) in fp32, x taken in int8 blocks where ``int8``."""
        if int8:
            y = linear_int8_activations(x, self.quantized)
            return y + self.bias.float() if self.bias is not None else y
        return F.linear(x.float(), self.w32, self.bias.float() if self.bias is not None else None)

    @property
    def weight(self) -> torch.Tensor:
        return self.w32

    def weight_rows(self, index: torch.Tensor) -> torch.Tensor:
        return self.w32[index]

    @property
    def dense(self) -> bool:
        return False
