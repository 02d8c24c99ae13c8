"""A GGUF model's weights served from the file in place (engine/gguf_file.py's memory map).

A projection stored in Q4_0 / Q4_1 / Q8_0 blocks is decoded and packed for the kernels one tensor at a
time, when the engine builds that projection (``blocks``, a lazy mapping); every other tensor (norms,
the embedding, biases, and projections of other ggml types: F16, BF16, F32, Q4_K, Q6_K, ...) is
dequantized on its own, by gguf's dequantization as transformers applies it, into the engine's dtype
(``dense``). No dequantized copy is written anywhere, and no whole-model copy exists in memory at once.

Names and layout follow transformers' GGUF loader, so the weights are the ones its conversion made:
llama.cpp stores Llama's q and k rows permuted for its RoPE, which is undone here as there.
Architectures other than ``MAPPED_ARCHITECTURES`` (or a file with tensors this map does not name) are
not served in place: the caller converts them through transformers instead.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from engine.checkpoint_names import EMBEDDING, HEAD, hf_name, is_linear
from engine.gguf_file import GgufFile, TensorInfo
from engine.kernels import CpuKernels
from engine.packed_cache import PackedCache
from engine.quant.formats import QuantizedWeight
from engine.quant.gguf_blocks import BLOCK, decode_blocks
from engine.quant.packing import TILE, PackedWeight, tile_group_bytes

logger = logging.getLogger(__name__)

MAPPED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # read as the kernels' u4 / i8 groups of 32
# block type -> (enum spark_gguf_block in csrc/repack.h, the packed format it becomes)
REPACK_KINDS = {"Q8_0": (0, "i8"), "Q4_0": (1, "u4"), "Q4_1": (2, "u4")}
# tensors transformers' conversion leaves out (it computes RoPE from the config)
IGNORED = ("rope_freqs.weight",)


def readable_types() -> tuple[str, ...]:
    """The ggml types gguf's dequantization reads (F32 and F16 aside, its per-type table)."""
    from gguf import quants

    return ("F32", "F16", *(t.name for t in getattr(quants, "_type_traits", {})))


class GgufWeights:
    """The file's tensors by transformers' names. ``unservable`` says why the file cannot be served in
    place (None where it can)."""

    def __init__(self, file: GgufFile, config: Any) -> None:
        self.file = file
        self.config = config
        self.arch = file.architecture
        self.names: dict[str, str] = {}  # HF name -> GGUF name
        unmapped = []
        for name in file.tensors:
            hf = hf_name(name)
            if hf is not None:
                self.names[hf] = name
            elif name not in IGNORED:
                unmapped.append(name)
        if HEAD not in self.names and EMBEDDING in self.names:
            self.names[HEAD] = self.names[EMBEDDING]  # tied embeddings
        # where the config ties them, the head is the embedding's tensor, read once (as transformers ties them)
        self.tied_head = bool(getattr(config, "tie_word_embeddings", False))
        self.auto_dtype = torch.float32  # "auto" (int8 / int4 start from the weights' meaning): dequantized fp32
        self.unservable: str | None = None
        if self.arch not in MAPPED_ARCHITECTURES:
            self.unservable = f"architecture {self.arch!r} (in place: {', '.join(MAPPED_ARCHITECTURES)})"
        elif unmapped:
            self.unservable = f"tensors {', '.join(unmapped[:3])} are not mapped"
        elif unreadable := sorted({t.type_name for t in file.tensors.values()} - set(readable_types())):
            self.unservable = f"ggml types {', '.join(unreadable)} cannot be dequantized here"

    # ---- the layout transformers gives these tensors ---------------------------------------------
    def row_order(self, hf: str, rows: int) -> torch.Tensor | None:
        """llama.cpp permutes Llama's q and k rows (weights and biases) for its RoPE; transformers undoes
        it with the head counts (k's by the KV heads)."""
        if self.arch != "llama" or not (".q_proj." in hf or ".k_proj." in hf):
            return None
        heads = self.config.num_attention_heads if ".q_proj." in hf else self.config.num_key_value_heads
        return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)

    def type_of(self, hf: str) -> str | None:
        gguf_name = self.names.get(hf)
        return None if gguf_name is None else self.file.tensors[gguf_name].type_name

    def block_weight(self, hf: str) -> QuantizedWeight | None:
        """The tensor's own blocks as the kernels' codes and scales, or None where it is of another type."""
        gguf_name = self.names.get(hf)
        if gguf_name is None:
            return None
        info = self.file.tensors[gguf_name]
        if info.type_name not in BLOCK_TYPES or len(info.shape) != 2:
            return None
        rows, cols = info.shape
        q = decode_blocks(info.type_name, self.file.raw(gguf_name), rows, cols)  # copies
        self.file.release(gguf_name)
        order = self.row_order(hf, rows)
        return q.permute_rows(order) if order is not None else q

    def raw_blocks(self, hf: str) -> torch.Tensor:
        """The tensor's blocks as [rows, cols / 32, block bytes] (a view of the map; q and k rows in
        transformers' order, a copy), for ``pack_blocks``."""
        info = self.file.tensors[self.names[hf]]
        rows, cols = info.shape
        block_bytes = info.nbytes // (rows * cols // BLOCK)
        with warnings.catch_warnings():  # a view of the read-only map: only ever read
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(self.file.raw(info.name).reshape(rows, cols // BLOCK, block_bytes))
        order = self.row_order(hf, rows)
        return blocks[order] if order is not None else blocks

    def dense(self, hf: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor dequantized into ``dtype`` (one tensor's fp32 copy at a time)."""
        gguf_name = self.names.get(hf)
        if gguf_name is None:
            raise KeyError(f"the GGUF file has no tensor for {hf}")
        kind = self.file.tensors[gguf_name].type_name
        if kind in _TORCH_DEQUANTIZED:
            blocks = self.raw_blocks(hf)  # q and k rows already in order
            values = _dequantize_blocks(kind, blocks)
            self.file.release(gguf_name)
            return values.reshape(blocks.shape[0], -1).to(dtype).contiguous()
        values = torch.from_numpy(np.array(self.file.dequantized(gguf_name)))  # owned: the map is read-only
        self.file.release(gguf_name)
        order = self.row_order(hf, values.shape[0])
        if order is not None:
            values = values[order]
        return values.to(dtype).contiguous()

    @property
    def head_is_embedding(self) -> bool:
        """Whether the output head is the embedding's tensor (a tied file stores one)."""
        return self.names.get(HEAD) == self.names.get(EMBEDDING) is not None

    @property
    def keeps_embedding_blocks(self) -> bool:
        """Whether ``embedding_table`` serves the embedding (a type dequantized in torch)."""
        gguf_name = self.names.get(EMBEDDING)
        return gguf_name is not None and self.file.tensors[gguf_name].type_name in _TORCH_DEQUANTIZED

    def embedding_table(self, hf: str, dtype: torch.dtype) -> BlockEmbedding | None:
        """The token embedding kept as the file's own blocks (a copy: the map is let go after the load),
        dequantized a looked-up row at a time; None where its type is not one dequantized in torch."""
        gguf_name = self.names.get(hf)
        if gguf_name is None or self.file.tensors[gguf_name].type_name not in _TORCH_DEQUANTIZED:
            return None
        table = BlockEmbedding(self.file.tensors[gguf_name].type_name, self.raw_blocks(hf).clone(), dtype)
        self.file.release(gguf_name)
        return table

    def resident_bytes(self, dtype_size: int) -> int:
        """What the engine will hold for these weights: block-typed projections packed at about their size
        in the file (Q8_0's fp16 scales become fp32: 36 bytes a block of 32 against 34); an embedding of a
        type dequantized in torch kept as its blocks, or nothing more where the packed head is that tensor
        and its rows serve the lookups (engine/models/embedding.py: Q8_0, Q4_1); everything else (norms,
        projections of other types) dense in a ``dtype_size``-byte type."""
        rows_from_head = self.head_is_embedding and self.type_of(EMBEDDING) in ("Q8_0", "Q4_1")
        total = 0
        for hf, gguf_name in self.names.items():  # a tied head: the embedding's tensor under both names
            info = self.file.tensors[gguf_name]
            if hf == EMBEDDING and info.type_name in _TORCH_DEQUANTIZED:
                total += 0 if rows_from_head else info.nbytes
            elif self._is_packed(hf, info):
                total += _packed_size(info)
            else:
                total += int(np.prod(info.shape, dtype=np.int64)) * dtype_size
        return total

    def release_all(self) -> None:
        """Drop every page of the file from the process (after the load has read what it needs)."""
        self.file.release_all()

    def packed_bytes(self) -> int:
        """What the block-typed projections hold once packed (what a packed-weights cache writes)."""
        return sum(_packed_size(self.file.tensors[g]) for hf, g in self.names.items()
                   if self._is_packed(hf, self.file.tensors[g]))

    @staticmethod
    def _is_packed(hf: str, info: TensorInfo) -> bool:
        """A projection whose blocks the kernels pack (every other tensor is held otherwise)."""
        return is_linear(hf) and info.type_name in BLOCK_TYPES

    def blocks(self, cache: PackedCache | None = None) -> BlockWeights:
        """The projections' blocks, packed through ``cache`` (mapped from an earlier start's files, or packed
        into files kept for later ones) where it is given."""
        return BlockWeights(self, cache)

    def stored_bytes(self, names: list[str] | None = None) -> int:
        """Bytes of the file's tensors (all of them, or those named by HF name)."""
        chosen = self.file.tensors.values() if names is None else (
            self.file.tensors[self.names[n]] for n in names if n in self.names)
        return sum(info.nbytes for info in chosen)


class BlockWeights(Mapping[str, QuantizedWeight]):
    """HF name -> the projection's blocks, decoded when the builder asks (and not kept here)."""

    def __init__(self, weights: GgufWeights, cache: PackedCache | None = None) -> None:
        self._weights = weights
        self.cache = cache
        self._names = dict.fromkeys(n for n in weights.names if is_linear(n) and weights.type_of(n) in BLOCK_TYPES)

    def __getitem__(self, name: str) -> QuantizedWeight:
        q = self._weights.block_weight(name) if name in self._names else None
        if q is None:
            raise KeyError(name)
        return q

    def packed(self, names: list[str], kernels: CpuKernels | None = None) -> tuple[PackedWeight, str] | None:
        """(the projection's parts, stacked by rows, in the kernels' layout, what made them) packed from
        the file's blocks directly: by the kernel library's one pass over the map where ``kernels`` is
        given, else by ``pack_blocks`` (torch; the reference, equal byte for byte). None where the parts are
        not all of one block type."""
        kinds = {self._weights.type_of(n) for n in names}
        if not all(n in self._names for n in names) or len(kinds) != 1:
            return None
        kind = kinds.pop()
        if kind is None:  # names outside the file (excluded by the check above)
            return None
        if len({self._weights.file.tensors[self._weights.names[n]].shape[1] for n in names}) != 1:
            return None
        if kernels is not None:
            packed = self._repacked(kind, names, kernels)
        else:
            parts = [self._weights.raw_blocks(n) for n in names]
            packed = pack_blocks(kind, torch.cat(parts) if len(parts) > 1 else parts[0])
        for n in names:
            self._weights.file.release(self._weights.names[n])
        return packed, f"gguf {kind}"

    def _repacked(self, kind: str, names: list[str], kernels: CpuKernels) -> PackedWeight:
        """``pack_blocks``' layout written by the kernel library straight from the map (or mapped from the
        cache where an earlier start kept it)."""
        infos = [self._weights.file.tensors[self._weights.names[name]] for name in names]
        rows, groups = sum(info.shape[0] for info in infos), infos[0].shape[1] // BLOCK
        tiles = -(-rows // TILE)
        code, fmt = REPACK_KINDS[kind]
        nbytes = _packed_nbytes(kind, rows, groups)
        key = f"{kind}:{fmt}:{rows}x{groups}:{'+'.join(names)}"

        def pack(out: torch.Tensor) -> None:
            kernels.repack_gguf_blocks(code, self._row_addresses(names, tiles * TILE), groups, out)

        if self.cache is not None:
            out = self.cache.packed(key, nbytes, pack)
        else:
            out = torch.empty(nbytes, dtype=torch.uint8)
            pack(out)
        return PackedWeight(fmt, out, rows, groups * BLOCK, BLOCK)

    def _row_addresses(self, names: list[str], padded_rows: int) -> torch.Tensor:
        """Each packed row named by its address in the map (q and k rows in transformers' order, the stacked
        parts one after another; address 0 a padding row, packed as zeros), so no block is copied before it
        lands in its tile."""
        addresses = []
        for name in names:
            info = self._weights.file.tensors[self._weights.names[name]]
            rows = info.shape[0]
            order = self._weights.row_order(name, rows)
            index = order if order is not None else torch.arange(rows)
            addresses.append(index * (info.nbytes // rows) + self._weights.file.raw(info.name).ctypes.data)
        stacked = torch.cat(addresses)
        padded = torch.zeros(padded_rows, dtype=torch.int64)
        padded[:stacked.numel()] = stacked
        return padded

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names


def _packed_size(info: TensorInfo) -> int:
    """A block-typed projection's bytes in the packed layout: about its size in the file, its rows rounded
    up to whole tiles and its scales widened (Q8_0: fp32 scales, 36 bytes a block of 32 against 34; Q4_0:
    fp16 scales and mins, 20 against 18). Stacked projections (q/k/v, gate/up) pack at most this together."""
    return _packed_nbytes(info.type_name, info.shape[0], info.shape[1] // BLOCK)


def _packed_nbytes(kind: str, rows: int, groups: int) -> int:
    """Bytes of ``rows`` outputs of ``groups`` blocks of ``kind`` in the kernels' packed layout."""
    _, fmt = REPACK_KINDS[kind]
    return -(-rows // TILE) * groups * tile_group_bytes(fmt, BLOCK)


def pack_blocks(kind: str, blocks: torch.Tensor) -> PackedWeight:
    """A tensor's Q4_0 / Q4_1 / Q8_0 blocks ([rows, cols / 32, block bytes], uint8) straight into the
    kernels' packed layout (engine/quant/packing.py), without unpacking the codes: a 4-bit block's 16
    bytes hold inputs j and j + 16 in the low and high nibble of byte j, the pairing the u4 layout stores,
    so each byte only moves. Equal, byte for byte, to ``pack_quantized(decode_blocks(...))``."""
    rows, groups, block_bytes = blocks.shape
    tiles = -(-rows // TILE)
    if tiles * TILE != rows:  # zero rows to a whole tile, as pack_quantized pads
        blocks = torch.cat([blocks, blocks.new_zeros(tiles * TILE - rows, groups, block_bytes)])
    by_tile = blocks.view(tiles, TILE, groups, block_bytes)

    def per_tile(values: torch.Tensor) -> torch.Tensor:  # [tiles, 16, groups, n] -> [tiles, groups, 16 * n]
        return values.permute(0, 2, 1, 3).reshape(tiles, groups, -1)

    if kind == "Q8_0":  # {fp16 d; int8 q[32]}: pairs (2p, 2p + 1) of a row at lanes (2r, 2r + 1)
        codes = by_tile[..., 2:].reshape(tiles, TILE, groups, BLOCK // 2, 2).permute(0, 2, 3, 1, 4)
        scales = by_tile[..., :2].contiguous().view(torch.float16).float().view(torch.uint8)
        parts = [codes.reshape(tiles, groups, -1), per_tile(scales)]
        fmt = "i8"
    else:  # {fp16 d; (Q4_1: fp16 m;) uint8 qs[16]}
        start = 4 if kind == "Q4_1" else 2
        codes = by_tile[..., start:].reshape(tiles, TILE, groups, BLOCK // 4, 2).permute(0, 2, 3, 1, 4)
        scales = by_tile[..., :2]
        if kind == "Q4_1":
            mins = by_tile[..., 2:4]
        else:  # w = d * (q - 8): a min of -8 d, exact in fp16
            d = by_tile[..., :2].contiguous().view(torch.float16)
            mins = (d.float() * -8.0).to(torch.float16).view(torch.uint8)
            mins.view(tiles * TILE, groups, 2)[rows:] = 0  # padding rows hold zeros, not -0.0
        parts = [codes.reshape(tiles, groups, -1), per_tile(scales), per_tile(mins)]
        fmt = "u4"
    data = torch.cat(parts, dim=2).reshape(-1)
    return PackedWeight(fmt, data, rows, groups * BLOCK, BLOCK)


# Block types dequantized in torch with gguf's own arithmetic (the same fp32 operations in the same order,
# so the same values): 5-10x its numpy loops, which every start of a dense (fp32 / bf16) engine pays.
_TORCH_DEQUANTIZED = ("Q8_0", "Q4_0", "Q4_1")


def _dequantize_blocks(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """[..., blocks, block bytes] of ``kind`` -> [..., blocks, 32] fp32. Q8_0: fp16 d, 32 int8 q: d * q.
    Q4_0: fp16 d, 16 bytes of nibbles (the low ones the block's first 16 values): d * (q - 8).
    Q4_1: fp16 d, fp16 m, the nibbles: d * q + m."""
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    if kind == "Q8_0":
        return d * blocks[..., 2:].contiguous().view(torch.int8).float()
    packed = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
    q = torch.cat([packed & 0x0F, packed >> 4], dim=-1)
    if kind == "Q4_0":
        return d * (q.to(torch.int8) - 8).float()
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    return d * q.float() + m


class BlockEmbedding:
    """A token embedding held as a GGUF file's blocks: ``table[ids]`` is the looked-up rows in ``dtype``,
    dequantized then. Each value depends on its own block alone, so a row comes out as it would from the
    whole table dequantized first, in a fraction of the memory (Q8_0: 34 bytes a block of 32 values
    against 64 in bf16)."""

    def __init__(self, kind: str, blocks: torch.Tensor, dtype: torch.dtype) -> None:
        self.kind = kind
        self.blocks = blocks  # [rows, blocks a row, block bytes], uint8
        self.dtype = dtype
        self.shape = (blocks.shape[0], blocks.shape[1] * BLOCK)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks[ids.reshape(-1)]
        return _dequantize_blocks(self.kind, rows).reshape(*ids.shape, self.shape[1]).to(self.dtype)

    def to(self, dtype: torch.dtype) -> BlockEmbedding:
        """The same blocks, looked up into ``dtype``."""
        return self if dtype == self.dtype else BlockEmbedding(self.kind, self.blocks, dtype)

    def dense(self) -> torch.Tensor:
        """The whole table in ``dtype`` (where a device other than the CPU looks rows up)."""
        return _dequantize_blocks(self.kind, self.blocks).reshape(self.shape).to(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()
