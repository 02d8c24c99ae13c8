"""A Llama-family model's module tree, built from its config without transformers' modeling code: the same
attribute names, parameter shapes and RoPE tables as transformers' ``*ForCausalLM`` of the families in
engine/models/__init__.py, with every parameter on the meta device until the loader fills it.

Why not transformers' own classes: importing any of its models imports its generation utilities, which
import torch's compiler stack (dynamo, sympy, the distributed tensor ops). That is seconds of every start
for classes whose forward the engine never runs. Calibration (int8), which does run the model, still
builds transformers' model. tests/engine/test_layout.py holds each family's parameters and RoPE tables
equal to transformers'.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Families laid out here, and which projections carry a bias: transformers' modeling files decide it per
# family (Qwen2 always biases q/k/v; Llama and Qwen3 follow ``attention_bias``; Llama's MLP ``mlp_bias``).
_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

# RoPE variants whose tables depend on the positions alone. "dynamic" and "longrope" rescale with the
# sequence's length at run time (transformers' dynamic_rope_update); those models keep transformers' module.
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def rope_type(config: Any) -> str:
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        return str(scaling.get("rope_type", scaling.get("type")))
    return "default"


def lays_out(config: Any) -> bool:
    """Whether this module builds the config's model (else transformers' classes must)."""
    return getattr(config, "model_type", None) in _FAMILIES and rope_type(config) in _STATIC_ROPE


def head_dim(config: Any) -> int:
    """A config's attention head size: its own ``head_dim`` where it names one (Qwen3), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RotaryEmbedding(nn.Module):
    """transformers' rotary module for position-only RoPE: ``forward(x, position_ids) -> (cos, sin)``, each
    [batch, positions, head_dim] in x's dtype, computed in fp32 by the same expression."""

    def __init__(self, config: Any, device: torch.device | str | None = None) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # no model code imported

        inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type(config)](config, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        freqs = (inv_freq @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _weights(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device="meta", dtype=dtype), requires_grad=False)


class _Weight(nn.Module):
    """A module holding only ``weight`` (a norm's scale, the token embedding)."""

    def __init__(self, *shape: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _weights(*shape, dtype=dtype)


class _Linear(nn.Module):
    """transformers' ``nn.Linear`` attributes (weight [out, in], bias or None) without its initialisation:
    torch's initialisers on the meta device import the compiler stack."""

    def __init__(self, inputs: int, outputs: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _weights(outputs, inputs, dtype=dtype)
        self.bias = _weights(outputs, dtype=dtype) if bias else None


def _layer(config: Any, dtype: torch.dtype) -> nn.Module:
    family = config.model_type
    hidden, inter, d = config.hidden_size, config.intermediate_size, head_dim(config)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    qkv_bias = family == "qwen2" or (family in ("llama", "qwen3") and bool(getattr(config, "attention_bias", False)))
    o_bias = family in ("llama", "qwen3") and bool(getattr(config, "attention_bias", False))
    mlp_bias = family == "llama" and bool(getattr(config, "mlp_bias", False))

    attn = nn.Module()
    attn.q_proj = _Linear(hidden, heads * d, qkv_bias, dtype)
    attn.k_proj = _Linear(hidden, kv_heads * d, qkv_bias, dtype)
    attn.v_proj = _Linear(hidden, kv_heads * d, qkv_bias, dtype)
    attn.o_proj = _Linear(heads * d, hidden, o_bias, dtype)
    if family == "qwen3":
        attn.q_norm = _Weight(d, dtype=dtype)
        attn.k_norm = _Weight(d, dtype=dtype)
    mlp = nn.Module()
    mlp.gate_proj = _Linear(hidden, inter, mlp_bias, dtype)
    mlp.up_proj = _Linear(hidden, inter, mlp_bias, dtype)
    mlp.down_proj = _Linear(inter, hidden, mlp_bias, dtype)

    layer = nn.Module()
    layer.self_attn = attn
    layer.mlp = mlp
    layer.input_layernorm = _Weight(hidden, dtype=dtype)
    layer.post_attention_layernorm = _Weight(hidden, dtype=dtype)
    return layer


def empty_causal_lm(config: Any, dtype: torch.dtype) -> nn.Module:
    """The causal LM's module tree (``model.embed_tokens``, ``model.layers``, ``model.norm``,
    ``model.rotary_emb``, ``lm_head``), parameters on the meta device, the RoPE buffer computed on the
    CPU, a tied head sharing the embedding's parameter as transformers ties it."""
    if not lays_out(config):
        raise ValueError(f"no layout for model type {getattr(config, 'model_type', None)!r} with RoPE "
                         f"{rope_type(config)!r}")
    inner = nn.Module()
    inner.embed_tokens = _Weight(config.vocab_size, config.hidden_size, dtype=dtype)
    inner.layers = nn.ModuleList(_layer(config, dtype) for _ in range(config.num_hidden_layers))
    inner.norm = _Weight(config.hidden_size, dtype=dtype)
    inner.rotary_emb = RotaryEmbedding(config, device="cpu")
    model = nn.Module()
    model.config = config
    model.model = inner
    model.lm_head = _Linear(config.hidden_size, config.vocab_size, False, dtype)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = inner.embed_tokens.weight
    return model
