"""The LoRA tests' adapters, built once per content and shared by every pytest process on the machine.

Training the taught adapter and writing the random ones takes ~7-10 s on 2 cores; with ``-n 2`` each worker
would build its own copy, and a second run would build them again. They are kept under the pytest cache,
keyed by everything that decides their bytes (the builders' source, the model's files, the libraries'
versions), and checked against the digests recorded at build time before use: a copy that anything changed
is built again rather than trusted."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

_MANIFEST = "manifest.json"


def content_key(model_dir: str, sources: list[Path]) -> str:
    """A digest of what the adapters are built from: the builders' source, the model's config and weight
    files (by name, size and mtime: the weights are hundreds of MB), and torch/transformers/peft versions."""
    import peft
    import torch
    import transformers

    h = hashlib.sha256()
    for source in sources:
        h.update(source.read_bytes())
    for f in sorted(Path(model_dir).iterdir()):
        stat = f.stat()
        h.update(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    h.update(f"{torch.__version__} {transformers.__version__} {peft.__version__}".encode())
    return h.hexdigest()[:16]


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != _MANIFEST}


def _intact(entry: Path, names: list[str]) -> bool:
    manifest = entry / _MANIFEST
    if not manifest.is_file():
        return False
    recorded = json.loads(manifest.read_text())
    return (all((entry / n / "adapter_config.json").is_file() for n in names)
            and recorded == _digests(entry))


def cached_adapters(cache_root: Path, key: str, build: Callable[[Path], dict[str, Path]]) -> dict[str, Path]:
    """``build(folder)`` -> {name: adapter dir under folder}, run at most once per ``key`` across processes
    (an exclusive lock on the cache folder: a second worker waits for the first's build and reuses it)."""
    cache_root.mkdir(parents=True, exist_ok=True)
    entry = cache_root / key
    with open(cache_root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            names_file = entry / "names.json"
            if names_file.is_file():
                names = json.loads(names_file.read_text())
                if _intact(entry, names):
                    return {n: entry / n for n in names}
            for old in cache_root.iterdir():  # other keys (older builders or models) and a stale entry
                if old.is_dir():
                    shutil.rmtree(old)
            staging = cache_root / f".building-{os.getpid()}"
            built = build(staging)
            assert all(p.parent == staging for p in built.values()), "adapters must be built directly in the folder"
            (staging / "names.json").write_text(json.dumps(sorted(built)))
            (staging / _MANIFEST).write_text(json.dumps(_digests(staging)))
            staging.rename(entry)
            return {n: entry / n for n in built}
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
