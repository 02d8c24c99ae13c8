"""The block types dequantized in torch give gguf's own values, bit for bit: random blocks (scales drawn as
fp16 values, codes as random bytes) through both."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from engine.gguf_weights import _TORCH_DEQUANTIZED, _dequantize_blocks

BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
SCALES = {"Q8_0": 1, "Q4_0": 1, "Q4_1": 2}  # fp16 fields at the block's start


@pytest.mark.parametrize("kind", _TORCH_DEQUANTIZED)
def test_torch_dequantization_equals_gguf(kind):
    rng = np.random.default_rng(0)
    rows, blocks = 16, 6
    raw = rng.integers(0, 256, size=(rows, blocks, BLOCK_BYTES[kind]), dtype=np.uint8)
    scales = rng.standard_normal((rows, blocks, SCALES[kind])).astype(np.float16)
    raw[..., :2 * SCALES[kind]] = scales.view(np.uint8).reshape(rows, blocks, -1)
    expected = np.asarray(dequantize(raw.reshape(rows, -1), GGMLQuantizationType[kind]), dtype=np.float32)
    got = _dequantize_blocks(kind, torch.from_numpy(raw)).reshape(rows, -1)
    assert torch.equal(got, torch.from_numpy(expected.reshape(rows, -1)))
