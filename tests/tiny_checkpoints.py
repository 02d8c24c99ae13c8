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
