"""A directory's tokenizer, as transformers' ``AutoTokenizer`` would load it, without importing its module:
``transformers.models.auto`` imports transformers' model code and with it torch's compiler stack (seconds
of every start). The class ``tokenizer_config.json`` names is what AutoTokenizer picks first (its fast
variant where there is one); anything else (no class named, remote code) still goes through AutoTokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tokenizer(directory: str | Path) -> Any:
    import transformers

    directory = Path(directory)
    try:
        settings = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        settings = {}
    name = settings.get("tokenizer_class") if isinstance(settings, dict) else None
    if isinstance(name, str) and "auto_map" not in settings:
        for candidate in (name if name.endswith("Fast") else f"{name}Fast", name):
            try:
                cls = getattr(transformers, candidate)
            except (AttributeError, ImportError):  # not a class of this transformers (or its extra is missing)
                continue
            return cls.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))
