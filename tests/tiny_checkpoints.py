"""Tiny random checkpoints for pooling tests: a Qwen3 sequence classifier (``score.weight``), saved as a local
HF directory with the embedded model's tokenizer, so the engine loads it as it loads any checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from engine.model_loader import resolve_model_dir

LABELS = ("negative", "neutral", "positive")


def save_tiny_classifier(out: Path, num_labels: int = len(LABELS), seed: int = 0) -> Path:
    """A 2-layer Qwen3ForSequenceClassification with ``num_labels`` labels (named from LABELS for 3)."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    labels = LABELS if num_labels == len(LABELS) else tuple(f"LABEL_{i}" for i in range(num_labels))
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=512, vocab_size=49152,
                         tie_word_embeddings=False, num_labels=num_labels,
                         id2label=dict(enumerate(labels)), label2id={v: k for k, v in enumerate(labels)})
    torch.manual_seed(seed)
    model = Qwen3ForSequenceClassification(config)
    with torch.no_grad():  # a visible head: random init is near zero, which would hide a wrong pooling
        model.score.weight.normal_(0.0, 0.5)
    model.save_pretrained(out)
    source = resolve_model_dir(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out


def save_tiny_llama(out: Path, seed: int = 0) -> Path:
    """A 2-layer LlamaForCausalLM of the embedded model's family (head_dim 64, 3 query heads per KV head, its
    vocabulary and RoPE) with random weights at 5x the usual scale, so logits and KV spread over several units:
    for checks of one code path against another, where the real model's 30 layers only add time."""
    from transformers import LlamaConfig, LlamaForCausalLM

    source = resolve_model_dir(None)
    config = LlamaConfig.from_pretrained(source)
    config.update({"num_hidden_layers": 2, "hidden_size": 192, "intermediate_size": 512, "num_attention_heads": 3,
                   "num_key_value_heads": 1, "head_dim": 64, "initializer_range": 0.1})
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out
