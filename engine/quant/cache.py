"""Quantized weights cached on disk (safetensors, no pickle), beside the converted models.

Quantizing or decoding a model's blocks takes seconds; later starts read the result back. The key
covers the source files' contents (engine/file_identity.py) and the format version, so a changed model
or a changed format never reads a stale entry, and a reinstall of the same model reads the old one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from engine.file_identity import content_digest
from engine.model_loader import default_cache_dir
from engine.quant.formats import QuantizedWeight

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: int8 rounded by GPTQ against calibrated inputs (1: round-to-nearest)


def cache_path(sources: list[Path], mode: str, cache_dir: Path | None = None) -> Path:
    cache_dir = cache_dir or default_cache_dir()
    ident = [content_digest(p, cache_dir) for p in sorted(sources)]
    key = hashlib.sha1(json.dumps([FORMAT_VERSION, mode, ident]).encode()).hexdigest()[:16]
    return cache_dir / "quantized" / f"{mode}-{key}.safetensors"


def load(path: Path) -> dict[str, QuantizedWeight] | None:
    if not path.exists():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["weights"])
            out = {}
            for name, (kind, group, source) in meta.items():
                mins = f.get_tensor(f"{name}.mins") if kind == "u4" else None
                out[name] = QuantizedWeight(kind, f.get_tensor(f"{name}.codes"), f.get_tensor(f"{name}.scales"), mins,
                                            group, source)
        return out
    except Exception as exc:  # a truncated or foreign file: rebuild it
        logger.warning("quantization cache %s unreadable (%s): rebuilding it", path, exc)
        return None


def save(path: Path, weights: dict[str, QuantizedWeight]) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    meta = {}
    for name, q in weights.items():  # clones: safetensors stores no shared (tied) storage
        tensors[f"{name}.codes"] = q.codes.clone()
        tensors[f"{name}.scales"] = q.scales.clone()
        if q.mins is not None:
            tensors[f"{name}.mins"] = q.mins.clone()
        meta[name] = (q.kind, q.group, q.source)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"weights": json.dumps(meta)})
        os.replace(tmp, path)  # atomic: a concurrent start reads the whole file or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
