"""A token embedding that is the tied output head's own weight, looked up from the head's packed layout.

A GGUF file that ties its head stores one tensor for both. The head is packed for the kernels anyway, so a
second copy of the same blocks kept for lookups (engine/gguf_weights.py's BlockEmbedding) would hold the
vocabulary's weights twice. Rows gathered from the packed head (engine/quant/packing.py's unpack_rows) and
dequantized are the values the blocks give: Q8_0 d x q, Q4_1 d x q + m, in the same fp32 operations. Q4_0
is not served this way: its packed min (-8 d) would give d x q - 8 d where the file's arithmetic is
d x (q - 8), which rounds differently.
"""

from __future__ import annotations

import torch

from engine.models.linear import PackedLinear
from engine.quant.packing import unpack_rows

# the heads whose packed rows dequantize to the file's own embedding values
_SERVED_SOURCES = ("gguf Q8_0", "gguf Q4_1")


class HeadRowsEmbedding:
    """``table[ids]``: the embedding rows of ``ids`` in ``dtype``, read from the packed head."""

    def __init__(self, head: PackedLinear, dtype: torch.dtype) -> None:
        self.head = head
        self.dtype = dtype
        self.shape = (head.out_features, head.in_features)

    @staticmethod
    def serves(head: object) -> bool:
        return isinstance(head, PackedLinear) and head.source in _SERVED_SOURCES

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        kernels = self.head.kernels
        if kernels is not None:
            values = kernels.packed_rows(self.head.packed, flat)
        else:  # the torch reference
            values = unpack_rows(self.head.packed, self.head.source, flat).dequantize()
        return values.view(*ids.shape, self.shape[1]).to(self.dtype)

    def to(self, dtype: torch.dtype) -> HeadRowsEmbedding:
        return self if dtype == self.dtype else HeadRowsEmbedding(self.head, dtype)

    @property
    def nbytes(self) -> int:
        return 0  # the head's bytes, counted there
