"""The names the engine gives a checkpoint's tensors (transformers' own, whatever the file format), and
the transformers name of a GGUF tensor."""

from __future__ import annotations

EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"

# a GGUF decoder layer's tensor (blk.N.<part>.weight) -> its transformers module within model.layers.N
LAYER_PARTS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
LINEAR_PARTS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}


def hf_name(gguf_name: str) -> str | None:
    """The transformers parameter a GGUF tensor is, for the mapped architectures; None for any other."""
    top = {"token_embd.weight": EMBEDDING, "output.weight": HEAD, "output_norm.weight": "model.norm.weight"}
    if gguf_name in top:
        return top[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_PARTS \
            and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{LAYER_PARTS[parts[2]]}.{parts[3]}"
    return None


def is_linear(name: str) -> bool:
    """Whether a transformers weight name is one the engine's linear builder takes (a projection or the head)."""
    return name == HEAD or (name.endswith(".weight") and any(
        name.endswith(f".{LAYER_PARTS[p]}.weight") for p in LINEAR_PARTS))
