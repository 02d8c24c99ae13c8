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


@pytest.mark.parametrize("kind", _TORCH_DEQUANTIZED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_embedding_kept_in_blocks_looks_up_the_dense_tables_rows(kind, dtype):
    """Rows looked up in the blocks equal the same rows of the table dequantized whole, in any shape of ids
    (a prefill's rows, repeats, one decode row), at about the file's size rather than the dtype's."""
    from engine.gguf_weights import BlockEmbedding

    rng = np.random.default_rng(1)
    rows, blocks = 64, 4
    raw = rng.integers(0, 256, size=(rows, blocks, BLOCK_BYTES[kind]), dtype=np.uint8)
    scales = rng.standard_normal((rows, blocks, SCALES[kind])).astype(np.float16)
    raw[..., :2 * SCALES[kind]] = scales.view(np.uint8).reshape(rows, blocks, -1)
    table = BlockEmbedding(kind, torch.from_numpy(raw), torch.float32).to(dtype)
    dense = _dequantize_blocks(kind, torch.from_numpy(raw)).reshape(rows, -1).to(dtype)
    assert table.shape == tuple(dense.shape) and torch.equal(table.dense(), dense)
    for ids in (torch.tensor([5]), torch.tensor([3, 3, 63, 0, 17]), torch.randint(0, rows, (2, 9))):
        got = table[ids]
        assert got.dtype == dtype and torch.equal(got, dense[ids])
    assert table.nbytes < dense.numel() * 2 * 0.6


def test_the_engine_keeps_a_gguf_embedding_in_its_blocks(llm_engine):
    """The embedded model's Q8_0 token embedding (tied to the head) is held as its blocks, not as a bf16 copy."""
    from engine.gguf_weights import BlockEmbedding

    embed = llm_engine.model.embed
    assert isinstance(embed, BlockEmbedding) and embed.kind == "Q8_0"
    assert embed.nbytes == embed.shape[0] * embed.shape[1] // 32 * 34
