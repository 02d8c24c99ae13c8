"""An HF directory's weights read in place from its safetensors files, one tensor at a time.

Each file is memory-mapped read-only; a tensor is copied out of the map into the engine's dtype when the
engine asks for it (engine/models/skeleton.py fills the small ones, engine/models/weights.py reads each
projection when it builds it), and its pages are then dropped from the process (they stay in the page
cache). So a load holds the engine's weights plus the tensor being read, never a whole second copy as
``from_pretrained`` followed by the engine's packing does.

The format (the ``safetensors`` package's spec): a little-endian u64 header size, a JSON header naming
each tensor's dtype, shape and byte range, then the data. Checkpoints are ``model.safetensors`` or the
shards that ``model.safetensors.index.json`` names (transformers reads nothing else there).

Names are the transformers model's own (``model.layers.0.self_attn.q_proj.weight``); a checkpoint saved
from the bare decoder (no ``model.`` prefix) is read too, as ``from_pretrained`` reads it. A sequence
classifier's ``score.*`` is the pooling head (engine/pooling.py reads it). A checkpoint this map cannot
serve (quantized, other dtypes, tensors the model has no parameter for, parameters it lacks, other
shapes) says why in ``unservable``, and the caller loads it through transformers instead.
"""

from __future__ import annotations

import json
import logging
import mmap
import struct
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.checkpoint_names import EMBEDDING, HEAD

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
# read elsewhere (the pooling head) or computed from the config (RoPE frequencies, saved by older versions)
_NOT_PARAMETERS = ("score.weight", "score.bias")
_BUFFER_SUFFIXES = (".rotary_emb.inv_freq",)
_HEADER_LIMIT = 100 << 20  # the spec's own bound on a header's size


class SafetensorsFormatError(ValueError):
    """A file that is not a safetensors file this reader understands."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    path: Path
    dtype: str  # the format's name: "F32", "BF16", ...
    shape: tuple[int, ...]
    offset: int  # absolute, in the file
    nbytes: int


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files transformers loads from ``model_dir``: the index's shards, or the single file."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({model_dir / name for name in weight_map.values()})
    single = model_dir / SINGLE_FILE
    return [single] if single.is_file() else []


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors one file holds, by its own names."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsFormatError(f"{path.name}: shorter than a header")
        (length,) = struct.unpack("<Q", head)
        if length > min(_HEADER_LIMIT, size - 8):
            raise SafetensorsFormatError(f"{path.name}: a header of {length} bytes does not fit the file")
        header = json.loads(f.read(length))
    base = 8 + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if not 0 <= start <= end <= size - base:
            raise SafetensorsFormatError(f"{path.name}: {name} lies outside the file")
        entries[name] = TensorEntry(path, info["dtype"], tuple(info["shape"]), base + start, end - start)
    return entries


class SafetensorsWeights:
    """A checkpoint's tensors by the transformers model's parameter names (``expected``: name -> shape,
    every parameter of the model the config builds). ``unservable`` says why it cannot be served in place
    (None where it can)."""

    def __init__(self, model_dir: Path, config: Any, expected: Mapping[str, tuple[int, ...]]) -> None:
        self.model_dir = model_dir
        self.config = config
        self.entries: dict[str, TensorEntry] = {}  # parameter name -> where its tensor is
        self._maps: dict[Path, mmap.mmap] = {}
        self.unservable = self._map_names(expected)
        # The head is the embedding where the config ties them (transformers ties them whatever the file
        # holds) or where the checkpoint has no head (a sequence classifier's: it has a score head instead).
        self.tied_head = HEAD in expected and (bool(getattr(config, "tie_word_embeddings", False))
                                               or HEAD not in self.entries)
        if self.unservable is None and self.tied_head and HEAD not in self.entries \
                and not getattr(config, "tie_word_embeddings", False):
            logger.info("%s has no lm_head.weight: the token embedding serves as the output head "
                        "(transformers would start it from random values)", model_dir.name)

    def _map_names(self, expected: Mapping[str, tuple[int, ...]]) -> str | None:
        if getattr(self.config, "quantization_config", None):
            quantization = self.config.quantization_config
            method = (quantization.get("quant_method", "?") if isinstance(quantization, dict)
                      else getattr(quantization, "quant_method", "?"))
            return f"a quantized checkpoint ({method})"
        files = checkpoint_files(self.model_dir)
        if not files:
            return f"no {SINGLE_FILE} or {INDEX_FILE} (other weight files are read by transformers)"
        stored: dict[str, TensorEntry] = {}
        for path in files:
            if not path.is_file():
                return f"{path.name}, named by {INDEX_FILE}, is missing"
            try:
                stored.update(read_header(path))
            except (SafetensorsFormatError, ValueError, KeyError, OSError) as exc:
                return f"{path.name} is not read here ({exc})"
        unmapped = []
        for name, entry in stored.items():
            if name in _NOT_PARAMETERS or name.endswith(_BUFFER_SUFFIXES):
                continue
            param = name if name in expected else f"model.{name}" if f"model.{name}" in expected else None
            if param is None:
                unmapped.append(name)
                continue
            if entry.dtype not in FLOAT_TYPES:
                return f"{name} is stored as {entry.dtype} (in place: {', '.join(FLOAT_TYPES)})"
            if entry.shape != tuple(expected[param]):
                return f"{name} has shape {list(entry.shape)}; the config makes {list(expected[param])}"
            self.entries[param] = entry
        if unmapped:
            return f"tensors {', '.join(sorted(unmapped)[:3])} are not parameters of this model"
        missing = [n for n in expected if n not in self.entries and n != HEAD]
        if missing:
            return f"the checkpoint has no {', '.join(missing[:3])}"
        if HEAD in expected and HEAD not in self.entries and EMBEDDING not in self.entries:
            return "the checkpoint has neither lm_head.weight nor the token embedding"
        return None

    @property
    def auto_dtype(self) -> torch.dtype:
        """What ``from_pretrained(dtype="auto")`` loads: the config's dtype, else the first floating tensor's."""
        configured = getattr(self.config, "dtype", None)
        if isinstance(configured, str):
            configured = getattr(torch, configured, None)
        if isinstance(configured, torch.dtype):
            return configured
        first = next(iter(self.entries.values()), None)
        return FLOAT_TYPES[first.dtype] if first is not None else torch.float32

    def dense(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor in ``dtype``: a copy of its own (the map's pages dropped after it)."""
        entry = self.entries.get(name)
        if entry is None:
            raise KeyError(f"the checkpoint has no tensor for {name}")
        stored = FLOAT_TYPES[entry.dtype]
        raw = np.frombuffer(self._map(entry.path), dtype=np.uint8, count=entry.nbytes, offset=entry.offset)
        with warnings.catch_warnings():  # a view of the read-only map: only ever read, then copied
            warnings.simplefilter("ignore", UserWarning)
            view = torch.from_numpy(raw)
        if entry.offset % stored.itemsize:  # the format does not promise aligned tensors
            view = view.clone()
        values = view.view(stored).reshape(entry.shape).to(dtype, copy=True)
        self._release(entry)
        return values

    def resident_bytes(self, dtype_size: int) -> int:
        """What the engine will hold for these weights in a ``dtype_size``-byte type (a separate head counted)."""
        total = sum(int(np.prod(e.shape, dtype=np.int64)) for e in self.entries.values())
        if HEAD in self.entries and self.tied_head:
            total -= int(np.prod(self.entries[HEAD].shape, dtype=np.int64))  # not read: the embedding serves
        return total * dtype_size

    def _map(self, path: Path) -> mmap.mmap:
        if path not in self._maps:
            with open(path, "rb") as f:
                self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._maps[path]

    def _release(self, entry: TensorEntry) -> None:
        """Drop the tensor's pages from this process once copied, so the file does not count in its resident
        memory beside the weights made from it (they stay in the page cache)."""
        mapped = self._maps[entry.path]
        page = mmap.PAGESIZE
        start = entry.offset // page * page
        end = min(len(mapped), -(-(entry.offset + entry.nbytes) // page) * page)
        try:
            mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (AttributeError, OSError, ValueError):
            pass  # no madvise here: the pages are only counted until the map goes

    def release_all(self) -> None:
        """Close every map (after the load has read what it needs)."""
        for mapped in self._maps.values():
            try:
                mapped.close()
            except BufferError:  # a view of it is still alive somewhere: its pages go when that does
                mapped.madvise(mmap.MADV_DONTNEED)
        self._maps.clear()
