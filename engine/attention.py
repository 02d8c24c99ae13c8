"""Attention over a paged KV cache, written for CPU (and any torch device) without custom kernels.

The batch's tokens are laid out flat: all decode tokens first (one per sequence), then each
prefill chunk. Linear layers run over the flat tokens; only attention is split into one batched
call for the decodes and one call per prefill chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    q_start: int  # offset of the chunk's first token in the flat batch
    q_len: int
    context_len: int  # tokens of this sequence in the cache after this step
    gather: torch.Tensor | None  # [context_len] cache slots, None when the chunk is the whole context
    mask: torch.Tensor | None  # [q_len, context_len] bool, None when plain causal


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot written by each token
    num_decodes: int
    decode_gather: torch.Tensor | None  # [num_decodes, max_len] cache slots (padding points at slot 0)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_len] bool
    prefills: list[PrefillSpan]


class PagedKVCache:
    """K and V for every layer in one flat pool of ``num_blocks * block_size`` slots."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] for the new tokens; returns [T, H, D]."""
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        kk = k_cache[meta.decode_gather].transpose(1, 2)  # [B, Hkv, L, D]
        vv = v_cache[meta.decode_gather].transpose(1, 2)
        qq = q[:nd].unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=meta.decode_mask, enable_gqa=True)
        out[:nd] = o.squeeze(2)
    for span in meta.prefills:
        s, e = span.q_start, span.q_start + span.q_len
        qq = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if span.gather is None:
            kk = k[s:e].transpose(0, 1).unsqueeze(0)
            vv = v[s:e].transpose(0, 1).unsqueeze(0)
        else:
            kk = k_cache[span.gather].transpose(0, 1).unsqueeze(0)
            vv = v_cache[span.gather].transpose(0, 1).unsqueeze(0)
        if span.mask is None:
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=span.mask, enable_gqa=True)
        out[s:e] = o.squeeze(0).transpose(0, 1)
    return out
