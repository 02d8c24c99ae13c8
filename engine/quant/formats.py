"""Quantized weight formats and their one reference meaning (``dequantize``).

Two formats cover everything the kernels run:
  u4: 4-bit codes q in [0, 15], an fp16 scale d and min m per group of ``group`` inputs:
      w = d * q + m. GGUF's Q4_1 is exactly this; Q4_0 is m = -8 d; ``--quantization int4`` makes it.
  i8: int8 codes and an fp32 scale per group: w = d * q. ``--quantization int8`` is one group per
      output channel (group = in_features); GGUF's Q8_0 is groups of 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP = 32  # llama.cpp's block size: small groups keep 4-bit error low on small models


@dataclass(frozen=True)
class QuantizedWeight:
    kind: str  # "u4" | "i8"
    codes: torch.Tensor  # [out, in]: uint8 in [0, 15] (u4) or int8 (i8)
    scales: torch.Tensor  # [out, in // group]: fp16 (u4) or fp32 (i8)
    mins: torch.Tensor | None  # [out, in // group] fp16 (u4), None (i8)
    group: int
    source: str  # what made it, for the log: "int4", "int8", "gguf Q4_1", ...

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def nbytes(self) -> int:
        extra = self.mins.numel() * 2 if self.mins is not None else 0
        code_bytes = self.codes.numel() // 2 if self.kind == "u4" else self.codes.numel()
        return code_bytes + self.scales.numel() * self.scales.element_size() + extra

    def dequantize(self) -> torch.Tensor:
        """The weight in fp32: the reference every kernel is held to."""
        per_input = lambda t: t.float().repeat_interleave(self.group, dim=1)  # noqa: E731
        w = self.codes.float() * per_input(self.scales)
        if self.mins is not None:
            w = w + per_input(self.mins)
        return w

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Selected output rows in fp32 (embedding lookups, tie-breaking), without dequantizing the rest."""
        part = QuantizedWeight(self.kind, self.codes[index], self.scales[index],
                               self.mins[index] if self.mins is not None else None, self.group, self.source)
        return part.dequantize()

    def permute_rows(self, order: torch.Tensor) -> QuantizedWeight:
        return QuantizedWeight(self.kind, self.codes[order], self.scales[order],
                               self.mins[order] if self.mins is not None else None, self.group, self.source)


def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one format along the outputs (fused qkv and gate/up projections)."""
    first = parts[0]
    if any(p.kind != first.kind or p.group != first.group for p in parts):
        raise ValueError("cannot fuse weights of different formats")
    mins = torch.cat([p.mins for p in parts]) if first.mins is not None else None
    return QuantizedWeight(first.kind, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           mins, first.group, first.source)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8, one fp32 scale per output channel."""
    w = weight.float()
    absmax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    codes = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("i8", codes, scale, None, w.shape[1], "int8")


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> QuantizedWeight:
    """Asymmetric 4-bit per group of inputs: fp16 scale and min (GGUF Q4_1's arithmetic)."""
    w = weight.float()
    out_f, in_f = w.shape
    if in_f % group:
        raise ValueError(f"in_features {in_f} is not a multiple of the int4 group {group}")
    g = w.view(out_f, in_f // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    # stored precision first, then codes against the stored values, so dequantize() is what was meant
    mins = lo.to(torch.float16)
    scales = ((hi - mins.float()) / 15.0).to(torch.float16)
    if not (torch.isfinite(scales).all() and torch.isfinite(mins).all()):
        raise ValueError("weights outside fp16 range cannot be stored as int4 groups")
    safe = torch.where(scales.float() > 0, scales.float(), torch.ones_like(lo))
    codes = torch.round((g - mins.float()[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    return QuantizedWeight("u4", codes.view(out_f, in_f), scales, mins, group, "int4")
