"""Weights laid out for the CPU linear kernels (the layout is described in engine/kernels/cpu_linear.h).

Outputs are grouped in tiles of 16 (one fp32 vector of results); inside a tile, inputs come in pairs
(2j, 2j+1) at lanes (2i, 2i+1), the operand shape of AVX512-BF16's pairwise dot product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.quant.formats import QuantizedWeight

TILE = 16
FORMATS = {"bf16": 0, "u4": 1, "i8": 2}


@dataclass(frozen=True)
class PackedWeight:
    fmt: str  # "bf16" | "u4" | "i8"
    data: torch.Tensor  # uint8, the whole packed matrix
    out_features: int
    in_features: int
    group: int

    @property
    def fmt_code(self) -> int:
        return FORMATS[self.fmt]


def tile_group_bytes(fmt: str, group: int) -> int:
    """Bytes of one tile's group of ``group`` inputs in the packed layout, as the kernels lay it out
    (tile_group_bytes in engine/kernels/csrc/common.h): the codes, then the tile's scales (fp32, or fp16
    scales and mins for u4)."""
    if fmt == "bf16":
        return group * TILE * 2
    return (group * TILE // 2 if fmt == "u4" else group * TILE) + TILE * 4


def packable(fmt: str, in_features: int, group: int) -> bool:
    if in_features % group:
        return False
    return group % 32 == 0 if fmt == "u4" else group % 2 == 0


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, rows - t.shape[0])) if t.shape[0] != rows else t


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def pack_bf16(weight: torch.Tensor) -> PackedWeight:
    n, k = weight.shape
    if not packable("bf16", k, k):
        raise ValueError(f"in_features {k} must be even")
    tiles = -(-n // TILE)
    w = _pad_rows(weight.to(torch.bfloat16), tiles * TILE).view(tiles, TILE, k // 2, 2).permute(0, 2, 1, 3)
    return PackedWeight("bf16", _as_bytes(w).flatten(), n, k, k)


def pack_quantized(q: QuantizedWeight) -> PackedWeight:
    n, k = q.shape
    g = q.group
    if not packable(q.kind, k, g):
        raise ValueError(f"in_features {k} does not fit {q.kind} groups of {g}")
    tiles, groups = -(-n // TILE), k // g
    rows = tiles * TILE
    # scales [N, groups] -> [tiles, groups, 16]
    per_tile = lambda t: _pad_rows(t, rows).view(tiles, TILE, groups).transpose(1, 2)  # noqa: E731
    if q.kind == "u4":
        codes = _pad_rows(q.codes, rows).view(tiles, TILE, groups, g // 32, 16, 2)
        codes = codes.permute(0, 2, 3, 4, 1, 5).reshape(tiles, groups, g // 32, 16, 2 * TILE)
        nibbles = (codes[:, :, :, :8] | (codes[:, :, :, 8:] << 4)).reshape(tiles, groups, g * TILE // 2)
        parts = [nibbles, _as_bytes(per_tile(q.scales.to(torch.float16))),
                 _as_bytes(per_tile(q.mins.to(torch.float16)))]  # type: ignore[union-attr]
    elif q.kind == "i8":
        codes = _pad_rows(q.codes, rows).view(tiles, TILE, groups, g // 2, 2).permute(0, 2, 3, 1, 4)
        parts = [_as_bytes(codes).reshape(tiles, groups, g * TILE), _as_bytes(per_tile(q.scales.float()))]
    else:
        raise ValueError(f"unknown quantized kind {q.kind}")
    data = torch.cat([p.reshape(tiles, groups, -1) for p in parts], dim=2)
    return PackedWeight(q.kind, data.flatten().contiguous(), n, k, g)


def unpack_quantized(packed: PackedWeight, source: str) -> QuantizedWeight:
    """The codes and scales ``pack_quantized`` laid out, back in their plain form (exactly: packing only
    moves them). A packed linear keeps no second copy of its weight; the few uses of the plain form (the
    reference linears, a oneDNN fallback built at start) unpack it."""
    n, k, g = packed.out_features, packed.in_features, packed.group
    tiles, groups = -(-n // TILE), k // g
    data = packed.data.view(tiles, groups, -1)

    def per_tile(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [tiles, groups, 16] -> [N, groups]
        return t.contiguous().view(dtype).transpose(1, 2).reshape(tiles * TILE, groups)[:n].contiguous()

    if packed.fmt == "u4":
        code_bytes = g * TILE // 2
        nibbles = data[:, :, :code_bytes].reshape(tiles, groups, g // 32, 8, 2 * TILE)
        codes = torch.cat([nibbles & 15, nibbles >> 4], dim=3).view(tiles, groups, g // 32, 16, TILE, 2)
        codes = codes.permute(0, 4, 1, 2, 3, 5).reshape(tiles * TILE, k)[:n].contiguous()
        scales = per_tile(data[:, :, code_bytes:code_bytes + 2 * TILE], torch.float16)
        mins = per_tile(data[:, :, code_bytes + 2 * TILE:], torch.float16)
        return QuantizedWeight("u4", codes, scales, mins, g, source)
    if packed.fmt == "i8":
        code_bytes = g * TILE
        codes = data[:, :, :code_bytes].contiguous().view(torch.int8).view(tiles, groups, g // 2, TILE, 2)
        codes = codes.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, k)[:n].contiguous()
        return QuantizedWeight("i8", codes, per_tile(data[:, :, code_bytes:], torch.float32), None, g, source)
    raise ValueError(f"a {packed.fmt} packed weight holds no quantized codes")


def unpack_rows(packed: PackedWeight, source: str, index: torch.Tensor) -> QuantizedWeight:
    """Rows ``index`` of ``unpack_quantized(packed, source)``, gathered from their tiles' lanes alone (a row's
    codes sit at one lane of every pair row of its tile): the cost of the rows asked for, so a lookup of a
    few rows (an embedding's, a head's ties) reads a few rows."""
    n, k, g = packed.out_features, packed.in_features, packed.group
    tiles, groups = -(-n // TILE), k // g
    index = index.reshape(-1)
    tile, lane = index // TILE, index % TILE
    data = packed.data.view(tiles, groups, -1)
    rows = index.numel()

    def per_row(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [tiles, groups, 16 x size] -> [rows, groups]
        size = t.shape[2] // TILE
        return t.view(tiles, groups, TILE, size)[tile, :, lane].contiguous().view(dtype).reshape(rows, groups)

    if packed.fmt == "u4":
        code_bytes = g * TILE // 2
        nibbles = data[:, :, :code_bytes].view(tiles, groups, g // 32, 8, TILE, 2)
        picked = nibbles[tile, :, :, :, lane]  # [rows, groups, g / 32, 8, 2]: byte (j, e) holds inputs 2j+e, +16
        codes = torch.cat([picked & 15, picked >> 4], dim=3).reshape(rows, k)
        return QuantizedWeight("u4", codes, per_row(data[:, :, code_bytes:code_bytes + 2 * TILE], torch.float16),
                               per_row(data[:, :, code_bytes + 2 * TILE:], torch.float16), g, source)
    if packed.fmt == "i8":
        code_bytes = g * TILE
        codes = data[:, :, :code_bytes].view(torch.int8).view(tiles, groups, g // 2, TILE, 2)[tile, :, :, lane]
        return QuantizedWeight("i8", codes.reshape(rows, k), per_row(data[:, :, code_bytes:], torch.float32), None,
                               g, source)
    raise ValueError(f"a {packed.fmt} packed weight holds no quantized codes")
