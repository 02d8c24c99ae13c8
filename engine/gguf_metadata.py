"""What a GGUF file says besides its weights, as the small files transformers reads: config.json (the
architecture from the file's metadata), generation_config.json, and the tokenizer (its vocabulary,
merges, special tokens and chat template, made to follow the file: engine/gguf_tokenizer.py).

Made once per file contents (keyed as every cache is, engine/file_identity.py) and kept in the cache
directory: a few MB, where a converted copy of the weights was several times the file. The weights are
read from the file itself at every start (engine/gguf_weights.py).
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from engine.file_identity import content_digest, remembered_digest
from engine.model_loader import (
    EMBEDDED_MODEL_NAME,
    _is_embedded,
    default_cache_dir,
    gguf_source,
    publish_directory,
    replace_directory,
    resolve_model_dir,
    staging_directory,
)

logger = logging.getLogger(__name__)

# Bumped when the files made here change, so that directories made before are made again.
_VERSION = 1
_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def resolve_served_model(model: str | None, cache_dir: Path | None = None) -> tuple[Path, Path | None]:
    """(the directory transformers reads the model's config and tokenizer from, the GGUF file whose weights
    are served in place or None). For a GGUF file the directory is its metadata directory (no weights);
    for an HF directory, the directory itself."""
    gguf = gguf_source(model)
    if gguf is None:
        return resolve_model_dir(model, cache_dir), None
    # The embedded file named by its path is still the embedded model: one cache entry, not two.
    name = EMBEDDED_MODEL_NAME if model in (None, "", "embedded", EMBEDDED_MODEL_NAME) or _is_embedded(gguf) \
        else gguf.stem
    return metadata_dir(gguf, cache_dir or default_cache_dir(), name), gguf


def metadata_dir_path(gguf: Path, cache_dir: Path, name: str, digest: str | None = None) -> Path:
    key = hashlib.sha1(f"{digest or content_digest(gguf, cache_dir)}:metadata:{_VERSION}".encode()).hexdigest()[:12]
    return cache_dir / "gguf" / f"{name}-{key}"


def metadata_dir(gguf: Path, cache_dir: Path, name: str) -> Path:
    """The directory of this file's config and tokenizer, made on first use (under a lock: concurrent
    starts on a cold cache make it once)."""
    digest = remembered_digest(gguf, cache_dir)
    if digest is None and not any((cache_dir / "gguf").glob(f"{glob.escape(name)}-*")):
        # a file not hashed yet, and nothing made under its name (a copy of a file seen before would be): its
        # metadata is read while it is hashed
        return _made_while_hashing(gguf, cache_dir, name)
    target = metadata_dir_path(gguf, cache_dir, name, digest)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target):
        if not _is_complete(target):
            write_metadata(gguf, target)
    return target


def _made_while_hashing(gguf: Path, cache_dir: Path, name: str) -> Path:
    """A first start on a file: its digest (the cache key, seconds for a file of several GB) is read on a
    thread while the metadata (Python work, seconds too) is made in a staging directory, so the start pays
    the longer of the two rather than their sum. The staging directory then becomes the keyed one, unless
    the same contents were already made (another path to the same file): then it is dropped."""
    parent = cache_dir / "gguf"
    parent.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="file-digest") as pool:
        hashing = pool.submit(content_digest, gguf, cache_dir)
        with staging_directory(parent, ".metadata-") as staging:
            _fill_metadata(gguf, staging)
            target = metadata_dir_path(gguf, cache_dir, name, hashing.result())
            with _locked(target):
                if not _is_complete(target):
                    replace_directory(staging, target)
    return target


@contextmanager
def _locked(target: Path) -> Iterator[None]:
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _is_complete(target: Path) -> bool:
    return all((target / f).exists() for f in _FILES)


def write_metadata(gguf: Path, target: Path) -> None:
    """The config and tokenizer of ``gguf`` as transformers reads them from it, written atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    publish_directory(target, lambda staging: _fill_metadata(gguf, staging), prefix=".metadata-")


def _fill_metadata(gguf: Path, directory: Path) -> None:
    """Writes ``gguf``'s config and tokenizer files into ``directory`` (which exists)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from engine.gguf_parse import shared_gguf_readers
    from engine.gguf_tokenizer import follow_gguf_metadata, read_metadata

    started = time.monotonic()
    logger.info("reading %s's config and tokenizer (once for this file; later starts read them from the cache "
                "directory)", gguf.name)
    with shared_gguf_readers():  # transformers opens the file three times: one parse
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer_metadata = read_metadata(gguf)
    # what a model loaded from the file would have said in its saved config
    if not getattr(config, "architectures", None) and config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.save_pretrained(directory)
    GenerationConfig.from_model_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    follow_gguf_metadata(directory, tokenizer_metadata)
    logger.info("read %s's config and tokenizer in %.1fs", gguf.name, time.monotonic() - started)
