"""Greedy picks without the full head: int8 logits with a proven bound, then the few tokens the bound cannot
rule out computed exactly (engine/kernels/csrc/greedy_head.c has the arithmetic and the proof).

At 32 decode rows the head (49,152 x 576) is ~10% of a step on the FMA path; greedy rows need only their
largest logit. The kernel's int8 x int8 logits cost a quarter of the arithmetic; every token whose bound
reaches the best lower bound is then recomputed in fp32 from its dequantized weights (the reference's own
definition: dequantize, then multiply), and the row's token is the first maximum among those. A token left
out cannot be the largest logit of any fp32 evaluation, so the pick is the reference's argmax; only exact
ties inside fp32 rounding can fall either way, as they already do between the kernels' paths.

Built only for an int8 head (GGUF Q8_0, ``--quantization int8``) on a CPU with AVX512-VNNI; elsewhere, or
when a row's candidates overflow, the full head runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels import CpuKernels
from engine.models.linear import PackedLinear
from engine.quant.formats import QuantizedWeight

TILE = 16
BLOCK = 32
CANDIDATES_CAP = 256  # per row; more (a nearly flat row) and the step takes the full head
_ROWS_AT_ONCE = 4096  # tokens whose codes are widened together while the head is built


@dataclass(frozen=True, slots=True)
class GreedyPicks:
    """A forward pass's answer when the greedy head took the step: each logits row's token, not its logits."""

    token_ids: torch.Tensor  # int64 [rows]


class GreedyHead:
    def __init__(self, quantized: QuantizedWeight, kernels: CpuKernels) -> None:
        codes, scales = quantized.codes, quantized.scales.float()
        n, k = codes.shape
        self.kernels = kernels
        self.out_features = n
        blocks = k // BLOCK
        tiles = -(-n // TILE)
        # codes stored as q + 128: vpdpbusd's unsigned operand (x, quantized per row, is the signed one)
        padded = torch.full((tiles * TILE, k), 128, dtype=torch.uint8)
        # per token and block of 32: d (the group's scale) and A = d * sum of |codes|
        d = scales.repeat_interleave(quantized.group // BLOCK, dim=1)  # build(): group is a multiple of 32
        meta = torch.zeros(tiles * TILE, blocks, 2, dtype=torch.float32)
        meta[:n, :, 0] = d
        # a slice of tokens at a time: the widened codes of a whole head would be several times its size
        for start in range(0, n, _ROWS_AT_ONCE):
            part = codes[start:start + _ROWS_AT_ONCE].to(torch.int16)
            padded[start:start + part.shape[0]] = (part + 128).to(torch.uint8)
            sums = part.view(-1, blocks, BLOCK).abs().sum(-1, dtype=torch.int32).float()
            meta[start:start + part.shape[0], :, 1] = d[start:start + part.shape[0]] * sums
        # codes: [tile, block, quad j, token i, 4 inputs]; meta: [tile, block, (d | A), 16]
        self.codes = (padded.view(tiles, TILE, blocks, 8, 4).permute(0, 2, 3, 1, 4).contiguous())
        self.meta = meta.view(tiles, TILE, blocks, 2).permute(0, 2, 3, 1).contiguous()
        self._hi = torch.empty(0, n)

    @classmethod
    def build(cls, head: PackedLinear, kernels: CpuKernels | None) -> GreedyHead | None:
        """The greedy head for an int8 lm_head on a CPU whose kernels have the VNNI path; else None. Made by
        the kernel library in one pass over the packed head (``__init__``, from plain codes, is the
        reference it equals)."""
        if kernels is None or not kernels.greedy_head_fast or head.packed.fmt != "i8" or not head.takes(1):
            return None
        n, k, group = head.out_features, head.in_features, head.packed.group
        if k % BLOCK or group % BLOCK:
            return None
        tiles, blocks = -(-n // TILE), k // BLOCK
        built = cls.__new__(cls)
        built.kernels = kernels
        built.out_features = n
        built.codes = torch.empty(tiles, blocks, 8, TILE, 4, dtype=torch.uint8)
        built.meta = torch.empty(tiles, blocks, 2, TILE, dtype=torch.float32)
        kernels.greedy_head_from_packed(head.packed, built.codes, built.meta)
        built._hi = torch.empty(0, n)
        return built

    def pick(self, h: torch.Tensor, banned: list[list[int]]) -> GreedyPicks | None:
        """The greedy token of each row of h [S, hidden] (bf16, after the final norm), banned ids left out;
        None when the kernel cannot take it or some row's candidates overflow (then run the full head)."""
        rows = h.shape[0]
        if self._hi.shape[0] < rows:  # kept between steps: fresh pages each step cost ~1 ms at 32 rows
            self._hi = torch.empty(rows, self.out_features, dtype=torch.float32)
        hi, best = self._hi[:rows], torch.empty(rows, dtype=torch.float32)
        if not self.kernels.greedy_head_bounds(h, self.codes, self.meta, self.out_features, hi, best, banned):
            return None
        idx, count = self.kernels.greedy_candidates(hi, best, CANDIDATES_CAP)
        if rows and int(count.min()) <= 0:
            return None
        return GreedyPicks(self.kernels.greedy_exact(h, self.codes, self.meta, idx, count))
