"""A GGUF file's quantized blocks, read as they are (no dequantization), keyed by HF weight names.

Supported block types: Q4_0, Q4_1 (as u4 groups of 32) and Q8_0 (as i8 groups of 32). A tensor of
any other type is left out, and its projection runs on the dequantized weights instead.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from engine.checkpoint_names import EMBEDDING, HEAD, hf_name, is_linear
from engine.gguf_parse import metadata_value
from engine.quant.formats import QuantizedWeight

logger = logging.getLogger(__name__)

BLOCK = 32


def decode_blocks(kind: str, raw: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    """Raw GGUF block bytes of a [rows, cols] tensor into codes and per-block scales."""
    blocks = rows * cols // BLOCK
    if kind == "Q8_0":  # {fp16 d; int8 q[32]}
        b = raw.reshape(blocks, 34)
        d: np.ndarray = b[:, :2].copy().view(np.float16).astype(np.float32)
        q: np.ndarray = b[:, 2:].copy().view(np.int8)
        return QuantizedWeight("i8", torch.from_numpy(q.reshape(rows, cols)),
                               torch.from_numpy(d.reshape(rows, cols // BLOCK)), None, BLOCK, "gguf Q8_0")
    if kind == "Q4_1":  # {fp16 d; fp16 m; uint8 qs[16]}: q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4
        b = raw.reshape(blocks, 20)
        d = b[:, 0:2].copy().view(np.float16)
        m: np.ndarray = b[:, 2:4].copy().view(np.float16)
        qs = b[:, 4:]
    elif kind == "Q4_0":  # {fp16 d; uint8 qs[16]}: w = d * (q - 8), i.e. a min of -8 d (exact in fp16)
        b = raw.reshape(blocks, 18)
        d = b[:, 0:2].copy().view(np.float16)
        with np.errstate(over="ignore"):  # a d past 8188: the min is -inf, as fp16 arithmetic gives it
            m = (d.astype(np.float32) * -8.0).astype(np.float16)
        qs = b[:, 2:]
    else:
        raise ValueError(f"GGUF block type {kind} is not read as blocks")
    codes = np.concatenate([qs & 15, qs >> 4], axis=1)
    return QuantizedWeight("u4", torch.from_numpy(codes.reshape(rows, cols).astype(np.uint8)),
                           torch.from_numpy(d.reshape(rows, cols // BLOCK).copy()),
                           torch.from_numpy(m.reshape(rows, cols // BLOCK).copy()), BLOCK, f"gguf {kind}")


def _unpermute_order(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (what transformers applies on load)."""
    dim = rows // heads // 2
    return torch.arange(rows).view(heads, dim, 2).transpose(1, 2).reshape(rows)


def read_gguf_linears(path: Path, config) -> dict[str, QuantizedWeight]:
    """HF name -> the block-quantized weight, for every projection (and the output head) stored in a
    supported block type."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = metadata_value(reader, "general.architecture") or ""
    found: dict[str, QuantizedWeight] = {}
    skipped: dict[str, int] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or not (is_linear(name) or name == EMBEDDING):
            continue
        kind = t.tensor_type.name
        if kind not in ("Q4_0", "Q4_1", "Q8_0"):
            skipped[kind] = skipped.get(kind, 0) + 1
            continue
        cols, rows = (int(v) for v in t.shape)  # GGUF lists the fastest-varying dimension first
        q = decode_blocks(kind, np.asarray(t.data).reshape(-1).view(np.uint8), rows, cols)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            q = q.permute_rows(_unpermute_order(rows, heads))
        found[name] = q
    if HEAD not in found and EMBEDDING in found:
        found[HEAD] = found[EMBEDDING]  # tied embeddings
    if skipped:
        logger.info("GGUF tensors of types %s run on dequantized weights", ", ".join(sorted(skipped)))
    return found
