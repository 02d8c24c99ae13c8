"""Attention over a paged KV cache, written for CPU (and any torch device) without custom kernels.

The batch's tokens are laid out flat: all decode tokens first (one per sequence), then each
prefill chunk. Linear layers run over the flat tokens; only attention is split into one batched
call for the decodes and one call per prefill chunk.

Cache layout per layer: ``[2 * Hkv, num_slots, D]`` (K heads, then V heads). Head-major, so one
``index_select`` over slots yields K and V for a whole batch already shaped for batched matmul.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.resident import Prefault


@dataclass(slots=True)
class PrefillSpan:
    q_start: int  # offset of the chunk's first token in the flat batch
    q_len: int
    context_len: int  # tokens of this sequence in the cache after this step
    # the torch path's: None when the chunk is the whole context, and whenever the fused kernel takes the
    # prefill (AttentionMetadata.prefill_spans set: it walks block tables instead)
    gather: torch.Tensor | None  # [context_len] cache slots
    mask: torch.Tensor | None  # [q_len, context_len] bool, None when plain causal
    # the chunk's leading rows within its sequence's kv_only_prefix (None: every row): a first pass reads no
    # output of them, they only write the KV cache; the prompt's last token, and after a preemption the
    # recomputed outputs, come after them
    kv_only_rows: int | None = None


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot written by each token
    num_decodes: int
    decode_gather: torch.Tensor | None  # [num_decodes * max_len] cache slots (padding points at slot 0)
    decode_mask: torch.Tensor | None  # [num_decodes, max_len] bool; None when no row is padded
    decode_max_len: int
    prefills: list[PrefillSpan]
    # for the fused CPU kernels, which walk block tables themselves instead of gathering
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64
    prefill_spans: torch.Tensor | None = None  # [len(prefills), 3] int64: q_start, q_len, context_len
    prefill_block_tables: torch.Tensor | None = None  # [len(prefills), max_blocks] int64


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU its memory is an anonymous mapping, which the OS hands out zeroed page by
    page on first touch: the KV pool (gigabytes by default) costs nothing at start, where torch.zeros
    wrote every page (a large share of the start), and pages the load never reaches are never touched.
    Private, not shared (Python's default for an anonymous mmap): a fresh page then comes through the
    anonymous-memory fault path instead of shmem's, and a KV block's first write costs about a third
    less."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # 4 KiB pages on first touch even where THP is `always`: the
        try:  # prefault pass (engine/resident.py) asks for 2 MiB pages span by span, ahead of the engine
            pages.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:  # a kernel without THP
            pass
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)  # the tensor keeps the mapping alive


class PagedKVCache:
    """K and V for every layer in one flat pool of ``num_blocks * block_size`` slots."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.kv = lazily_zeroed((num_layers, 2 * num_kv_heads, num_blocks * block_size, head_dim), dtype, device)

    def prefault_in_background(self, blocks_per_span: int = 256,
                               busy: Callable[[], bool] = lambda: False) -> Prefault | None:
        """Fault the CPU pool in on idle CPU time (engine/resident.py), blocks in the order the block manager
        hands them out (lowest first), each layer's K and V heads for a run of blocks before the next run;
        the pass waits while ``busy()`` says the engine has work."""
        if self.kv.device.type != "cpu" or self.kv.numel() == 0:
            return None
        planes = self.kv.shape[0] * self.kv.shape[1]  # one [slots, D] plane per layer and K/V head
        block_bytes = self.block_size * self.kv.shape[-1] * self.kv.element_size()
        num_blocks = self.num_blocks
        plane_bytes = num_blocks * block_bytes

        def spans() -> Iterator[tuple[int, int]]:  # numbers only: the thread must not keep the pool alive
            for first in range(0, num_blocks, blocks_per_span):
                count = min(blocks_per_span, num_blocks - first)
                for plane in range(planes):
                    yield plane * plane_bytes + first * block_bytes, count * block_bytes

        size = self.kv.numel() * self.kv.element_size()
        return Prefault(self.kv, spans(), f"KV cache ({size / (1 << 30):.2f} GiB)", busy)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _decode_attention(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One query token per sequence. q [B, H, D]; kv [2*Hkv, B, L, D]; mask [B, L] -> [B, H, D].

    Plain batched matmuls: for a single query row they beat the CPU flash kernel, which is tuned
    for long query blocks. Query heads are grouped onto their KV head (GQA) without repeating K/V.
    """
    B, H, D = q.shape
    Hkv = kv.shape[0] // 2
    G = H // Hkv
    qg = q.view(B, Hkv, G, D).transpose(0, 1)  # [Hkv, B, G, D]
    scores = torch.matmul(qg * (D ** -0.5), kv[:Hkv].transpose(-1, -2))  # [Hkv, B, G, L]
    if mask is not None:
        scores = scores.masked_fill(~mask[None, :, None, :], float("-inf"))
    probs = scores.softmax(-1, dtype=torch.float32).to(kv.dtype)
    out = torch.matmul(probs, kv[Hkv:])  # [Hkv, B, G, D]
    return out.transpose(0, 1).reshape(B, H, D)


# Above this many score elements per KV head, prefill uses the memory-efficient flash kernel; below
# it, plain matmuls are about twice as fast on CPU.
_MATMUL_ATTENTION_MAX_SCORES = 1 << 20


def _chunk_attention(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """A prefill chunk of one sequence. q [n, H, D]; kv [2*Hkv, L, D]; mask [n, L] or None
    (causal, n == L) -> [n, H, D]."""
    n, H, D = q.shape
    Hkv, L = kv.shape[0] // 2, kv.shape[1]
    G = H // Hkv
    qg = q.view(n, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * n, D)
    scores = torch.matmul(qg, kv[:Hkv].transpose(-1, -2)).float().view(Hkv, G, n, L)
    scores.mul_(D ** -0.5)
    if mask is None:
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril_(L - n)
    scores.masked_fill_(~mask, float("-inf"))
    probs = scores.softmax(-1).to(kv.dtype).view(Hkv, G * n, L)
    out = torch.matmul(probs, kv[Hkv:]).view(Hkv, G, n, D)  # [Hkv, G, n, D]
    return out.permute(2, 0, 1, 3).reshape(n, H, D)


def prefill_attention(q: torch.Tensor, new_kv: torch.Tensor, layer_kv: torch.Tensor, spans: list[PrefillSpan],
                      out: torch.Tensor) -> None:
    """Each prefill chunk attends causally over its cached context plus itself.

    q [T, H, D]; new_kv [2*Hkv, T, D], this step's K (after RoPE) and V; layer_kv the layer's cache,
    already holding them; writes out[s:e] ([T, H, D]) for each span."""
    Hkv = layer_kv.shape[0] // 2
    for span in spans:
        s, e = span.q_start, span.q_start + span.q_len
        if span.gather is None:
            ctx = new_kv[:, s:e]
        else:
            ctx = layer_kv.index_select(1, span.gather)
        if span.q_len * span.context_len * (q.shape[1] // Hkv) <= _MATMUL_ATTENTION_MAX_SCORES:
            out[s:e] = _chunk_attention(q[s:e], ctx, span.mask)
            continue
        qq = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        kk, vv = ctx[:Hkv].unsqueeze(0), ctx[Hkv:].unsqueeze(0)  # [1, Hkv, L, D]
        if span.mask is None:
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=span.mask, enable_gqa=True)
        out[s:e] = o.squeeze(0).transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
    """The pure-torch path. q [T, H, D], k/v [T, Hkv, D] for the new tokens; returns [T, H, D]."""
    layer_kv = cache.kv[layer]  # [2*Hkv, slots, D]
    Hkv = cache.num_kv_heads
    new_kv = torch.cat((k, v), dim=1).transpose(0, 1)  # [2*Hkv, T, D]
    layer_kv.index_copy_(1, meta.slot_mapping, new_kv)
    nd = meta.num_decodes
    decoded = None
    if nd:
        assert meta.decode_gather is not None  # the runner gathers decode keys whenever there are decodes
        gathered = layer_kv.index_select(1, meta.decode_gather).view(2 * Hkv, nd, meta.decode_max_len, -1)
        decoded = _decode_attention(q[:nd], gathered, meta.decode_mask)
        if not meta.prefills:
            return decoded
    out = torch.empty_like(q)
    if decoded is not None:
        out[:nd] = decoded
    prefill_attention(q, new_kv, layer_kv, meta.prefills, out)
    return out
