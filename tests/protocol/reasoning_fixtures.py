"""A Qwen3-style tokenizer for reasoning tests: the embedded model's tokenizer with Qwen3's <think> and
</think> added as tokens (as Qwen3's vocabulary has them) and Qwen3's real chat template
(tests/data/qwen3_chat_template.jinja, from Qwen3's tokenizer_config.json)."""

from __future__ import annotations

from pathlib import Path

QWEN3_TEMPLATE = Path(__file__).resolve().parent.parent / "data" / "qwen3_chat_template.jinja"


def qwen3_tokenizer():
    import copy

    from tests.fake_engine import shared_tokenizer

    tok = copy.deepcopy(shared_tokenizer())
    tok.add_tokens(["<think>", "</think>"])  # plain added tokens in Qwen3 too (not special: kept in text)
    tok.chat_template = QWEN3_TEMPLATE.read_text()
    return tok


def save_qwen3_tokenizer(out: Path) -> str:
    qwen3_tokenizer().save_pretrained(out)
    return str(out)
