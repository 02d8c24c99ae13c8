"""The kernel library's one-pass repack of GGUF blocks (csrc/repack.c) equals the torch reference
(engine/gguf_weights.py's pack_blocks) and the decode-then-pack path, byte for byte."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.gguf_file import GgufFile
from engine.gguf_weights import REPACK_KINDS, GgufWeights, pack_blocks
from engine.kernels import load_cpu_kernels
from engine.model_loader import embedded_gguf_path
from engine.quant.gguf_blocks import decode_blocks
from engine.quant.packing import TILE, pack_quantized

BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


@pytest.fixture(scope="module")
def kernels():
    loaded = load_cpu_kernels()
    if loaded is None:
        pytest.skip("no kernel library here")
    return loaded


def _blocks(kind: str, rows: int, groups: int, seed: int) -> np.ndarray:
    """Random blocks whose fp16 scales (and Q4_1 mins) span normal values, subnormals, zeros, both signs and
    values whose -8 x overflows fp16 (Q4_0's min); no NaN."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, groups, BLOCK_BYTES[kind]), dtype=np.uint8)
    halves = np.concatenate([rng.standard_normal(64).astype(np.float16) * np.float16(0.01),
                             np.array([0, -0.0, 6e-8, -6e-8, 3e-5, 6.1e-5, 1e-6, 9000, -20000, 65504],
                                      dtype=np.float16)])
    for start in ((0, 2) if kind == "Q4_1" else (0,)):
        raw[..., start:start + 2] = rng.choice(halves, size=(rows, groups)).view(np.uint8).reshape(rows, groups, 2)
    return raw


def _repacked(kernels, kind: str, parts: list[np.ndarray], orders: list[torch.Tensor | None]) -> torch.Tensor:
    addresses = []
    for raw, order in zip(parts, orders):
        index = order if order is not None else torch.arange(raw.shape[0])
        addresses.append(index * raw[0].nbytes + raw.ctypes.data)
    stacked = torch.cat(addresses)
    padded = torch.zeros(-(-stacked.numel() // TILE) * TILE, dtype=torch.int64)
    padded[:stacked.numel()] = stacked
    code, fmt = REPACK_KINDS[kind]
    groups = parts[0].shape[1]
    out = torch.full((padded.numel() // TILE * groups * kernels.packed_tile_group_bytes(fmt, 32),), 0xAB,
                     dtype=torch.uint8)
    kernels.repack_gguf_blocks(code, padded, groups, out)
    return out


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_the_repack_equals_the_torch_reference_and_decode_then_pack(kernels, kind):
    groups = 3
    parts = [_blocks(kind, 24, groups, 1), _blocks(kind, 40, groups, 2)]  # 64 rows, no part a whole tile
    orders = [torch.randperm(24, generator=torch.Generator().manual_seed(3)), None]
    out = _repacked(kernels, kind, parts, orders)
    stacked = torch.cat([torch.from_numpy(parts[0])[orders[0]], torch.from_numpy(parts[1])])
    reference = pack_blocks(kind, stacked)
    assert torch.equal(out, reference.data)
    decoded = decode_blocks(kind, stacked.numpy().reshape(-1), stacked.shape[0], groups * 32)
    assert torch.equal(out, pack_quantized(decoded).data)


@pytest.mark.parametrize("rows", [1, 17, 33])
def test_padding_rows_are_zeros(kernels, rows):
    for kind in BLOCK_BYTES:
        raw = _blocks(kind, rows, 2, rows)
        assert torch.equal(_repacked(kernels, kind, [raw], [None]), pack_blocks(kind, torch.from_numpy(raw)).data)


def test_a_bad_kind_or_row_count_is_refused(kernels):
    out = torch.empty(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not supported"):
        kernels.repack_gguf_blocks(7, torch.zeros(16, dtype=torch.int64), 1, out)
    with pytest.raises(ValueError, match="not supported"):
        kernels.repack_gguf_blocks(0, torch.zeros(15, dtype=torch.int64), 1, out)


def test_the_served_projections_pack_alike_with_and_without_the_kernels(kernels):
    """The embedded model's file: q and k rows unpermuted (llama), q / k / v and gate / up stacked."""
    file = GgufFile(embedded_gguf_path())
    assert file.architecture == "llama"
    config = SimpleNamespace(num_attention_heads=file.field("llama.attention.head_count"),
                             num_key_value_heads=file.field("llama.attention.head_count_kv"))
    weights = GgufWeights(file, config)
    blocks = weights.blocks()
    for names in (["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                   "model.layers.0.self_attn.v_proj.weight"],
                  ["model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"],
                  ["model.layers.2.mlp.down_proj.weight"]):
        fast, reference = blocks.packed(names, kernels), blocks.packed(names)
        assert fast is not None and reference is not None
        assert fast[1] == reference[1]
        assert (fast[0].fmt, fast[0].out_features, fast[0].in_features) == (
            reference[0].fmt, reference[0].out_features, reference[0].in_features)
        assert torch.equal(fast[0].data, reference[0].data)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("with_kernels", [True, False])
def test_a_tied_heads_rows_are_the_embeddings_own_values(kind, with_kernels):
    """A tied file keeps one copy of the vocabulary's weights: the embedding is looked up from the packed
    head, and gives the values the file's blocks give (BlockEmbedding, the dequantization transformers
    applies), bit for bit, at any batch shape."""
    from engine.gguf_weights import BlockEmbedding
    from engine.models.embedding import HeadRowsEmbedding
    from engine.models.linear import PackedLinear

    raw = torch.from_numpy(_blocks(kind, 200, 4, 9))
    blocks = BlockEmbedding(kind, raw, torch.bfloat16)
    kernels = load_cpu_kernels() if with_kernels else None
    if with_kernels and kernels is None:
        pytest.skip("no kernel library here")
    head = PackedLinear(pack_blocks(kind, raw), None, kernels, source=f"gguf {kind}")
    assert HeadRowsEmbedding.serves(head)
    rows = HeadRowsEmbedding(head, torch.bfloat16)
    for ids in (torch.tensor([0]), torch.tensor([[5, 199, 5], [16, 15, 17]]), torch.randint(0, 200, (300,))):
        assert torch.equal(rows[ids], blocks[ids])
    assert torch.equal(rows.to(torch.float32)[ids], blocks.to(torch.float32)[ids])
    if kernels is not None:
        with pytest.raises(ValueError, match="not supported"):  # an id past the vocabulary reads nothing
            rows[torch.tensor([200])]
    assert not HeadRowsEmbedding.serves(PackedLinear(pack_blocks("Q4_0", raw[..., :18].contiguous()), None, None,
                                                     source="gguf Q4_0"))


def test_the_embedded_model_keeps_one_copy_of_its_vocabulary():
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.models.embedding import HeadRowsEmbedding

    if load_cpu_kernels() is None:
        pytest.skip("no kernel library here")
    engine = LLMEngine(EngineConfig(device="cpu", num_kv_blocks=16))
    assert isinstance(engine.model.embed, HeadRowsEmbedding)
    assert engine.model.embed.head is engine.model.lm_head


def test_the_weights_estimate_counts_a_tied_vocabulary_once():
    """The estimate the KV budget is checked against (before loading) is what the loaded model holds: the
    packed linears, the head among them, and no second copy of the vocabulary for the embedding."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.models.linear import PackedLinear

    if load_cpu_kernels() is None:
        pytest.skip("no kernel library here")
    file = GgufFile(embedded_gguf_path())
    config = SimpleNamespace(num_attention_heads=file.field("llama.attention.head_count"),
                             num_key_value_heads=file.field("llama.attention.head_count_kv"))
    estimate = GgufWeights(file, config).resident_bytes(2)
    model = LLMEngine(EngineConfig(device="cpu", num_kv_blocks=16)).model
    linears = [model.lm_head] + [lin for layer in model.layers
                                 for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    held = sum(lin.packed.data.numel() for lin in linears if isinstance(lin, PackedLinear))
    held += sum(t.numel() * t.element_size() for layer in model.layers for t in (layer.input_norm, layer.post_norm))
    held += model.final_norm.numel() * model.final_norm.element_size()
    assert abs(estimate - held) / held < 0.02, (estimate, held)
