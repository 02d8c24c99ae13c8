"""Batched forward of the Llama family (Llama, SmolLM2, Qwen2, Mistral) over a paged KV cache.

Weights come from the transformers model (so loading, tying and RoPE variants match it exactly);
the forward is ours: flat tokens, fused QKV and gate/up projections, paged attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, PagedKVCache, paged_attention

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(slots=True)
class _LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2*Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same arithmetic as transformers' LlamaRMSNorm: normalise in fp32, scale in the model dtype.
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaForCausalLM:
    def __init__(self, hf_model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        cfg = hf_model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type '{cfg.model_type}' is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.dtype = dtype
        self.device = device

        def w(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device=device, dtype=dtype).contiguous()

        inner = hf_model.model
        self.embed = w(inner.embed_tokens.weight)
        self.lm_head = w(hf_model.lm_head.weight)
        self.final_norm = w(inner.norm.weight)
        self.layers: list[_LayerWeights] = []
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            bias = None
            if att.q_proj.bias is not None:
                bias = w(torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]))
            self.layers.append(_LayerWeights(
                input_norm=w(layer.input_layernorm.weight),
                qkv=w(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])),
                qkv_bias=bias,
                o=w(att.o_proj.weight),
                post_norm=w(layer.post_attention_layernorm.weight),
                gate_up=w(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                down=w(mlp.down_proj.weight),
            ))
        self.intermediate = self.layers[0].gate_up.shape[0] // 2
        # RoPE tables from the model's own rotary module, so every rope_scaling variant matches it.
        max_pos = cfg.max_position_embeddings
        probe = torch.zeros(1, dtype=torch.float32, device=device)
        pos = torch.arange(max_pos, device=device)[None]
        rotary = inner.rotary_emb.to(device)
        cos, sin = rotary(probe, pos)
        self.cos = cos[0].to(dtype)
        self.sin = sin[0].to(dtype)
        self.max_position = max_pos

    def make_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        return PagedKVCache(self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim,
                            self.dtype, self.device)

    def kv_bytes_per_token(self) -> int:
        return PagedKVCache.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cache: PagedKVCache, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [T]; returns fp32 logits [len(logits_indices), vocab]."""
        T = input_ids.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        x = self.embed[input_ids]
        for i, lw in enumerate(self.layers):
            h = rms_norm(x, lw.input_norm, self.eps)
            qkv = F.linear(h, lw.qkv, lw.qkv_bias)
            q = qkv[:, : H * D].view(T, H, D)
            k = qkv[:, H * D: (H + Hkv) * D].view(T, Hkv, D)
            v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            a = paged_attention(q, k, v, i, cache, meta)
            x = x + F.linear(a.reshape(T, H * D), lw.o)
            h = rms_norm(x, lw.post_norm, self.eps)
            gu = F.linear(h, lw.gate_up)
            x = x + F.linear(F.silu(gu[:, : self.intermediate]) * gu[:, self.intermediate:], lw.down)
        x = rms_norm(x[logits_indices], self.final_norm, self.eps)
        return F.linear(x, self.lm_head).float()
