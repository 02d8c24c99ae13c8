"""A GGUF file read in place: its metadata and tensor directory parsed from a read-only memory map, each
tensor's bytes a view of the map (the page cache holds them; nothing is copied until a tensor is used).

``gguf.GGUFReader`` builds a numpy object for every element of every metadata array: for the embedded
model's 49k-token vocabulary and merges that is ~6 s of a start. Serving a file needs its tensors and a
few scalars, so this reader steps over array contents (strings by their lengths, numbers in one jump)
and decodes an array only when asked for it.

The format (ggml's docs/gguf.md, versions 2 and 3, little-endian): "GGUF", version u32, tensor count
u64, metadata count u64; each metadata entry a string key, a u32 value type and the value; each tensor
its name, dimension count u32, dimensions u64 (the fastest-varying first), ggml type u32 and data offset
u64; the data from the next multiple of ``general.alignment`` (32 by default).
"""

from __future__ import annotations

import mmap
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF metadata value types
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
DEFAULT_ALIGNMENT = 32


class GgufFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # as numpy sees the data: the slowest-varying dimension first ([rows, cols])
    type_name: str  # ggml's name: "F32", "Q4_1", "Q8_0", ...
    type_id: int
    offset: int  # absolute, in the file
    nbytes: int


@dataclass(frozen=True, slots=True)
class _LazyArray:
    """An array value not decoded yet: where its elements start, their type and count."""

    start: int
    item_type: int
    count: int


class GgufFile:
    def __init__(self, path: Path | str) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._read(4) != b"GGUF":
            raise GgufFormatError(f"{self.path}: not a GGUF file")
        (self.version,) = self._unpack("<I")
        if self.version not in (2, 3):
            raise GgufFormatError(f"{self.path}: GGUF version {self.version} is not read here (2 and 3 are)")
        tensor_count, kv_count = self._unpack("<QQ")
        self.header_counts = (tensor_count, kv_count)
        self._fields: dict[str, Any] = {}
        self._types: dict[str, int] = {}
        self._decoded: dict[str, list] = {}  # arrays decoded at their first use
        self._decoding = threading.Lock()
        for _ in range(kv_count):
            key = self._string()
            (value_type,) = self._unpack("<I")
            self._fields[key] = self._value(value_type)
            self._types[key] = value_type
        alignment = int(self._fields.get("general.alignment", DEFAULT_ALIGNMENT))
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            (dims,) = self._unpack("<I")
            shape = self._unpack(f"<{dims}Q")
            type_id, offset = self._unpack("<IQ")
            infos.append((name, tuple(reversed(shape)), type_id, offset))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, type_id, offset in infos:
            try:
                kind = GGMLQuantizationType(type_id)
            except ValueError:
                raise GgufFormatError(f"{self.path}: tensor {name} has ggml type {type_id}, unknown here") from None
            block, type_size = GGML_QUANT_SIZES[kind]
            elements = int(np.prod(shape, dtype=np.int64))
            nbytes = elements // block * type_size
            start = data_start + offset
            if start + nbytes > len(self._map):
                raise GgufFormatError(f"{self.path}: tensor {name} runs past the end of the file (truncated?)")
            self.tensors[name] = TensorInfo(name, shape, kind.name, type_id, start, nbytes)

    # ---- metadata --------------------------------------------------------------------------------
    def field(self, name: str, default: Any = None) -> Any:
        """A metadata value: a number, a string, or a list (arrays are decoded at their first use)."""
        value = self._fields.get(name, default)
        if isinstance(value, _LazyArray):
            with self._decoding:  # the decoder moves the one cursor: one thread at a time
                if name not in self._decoded:
                    self._decoded[name] = self._decode_array(value)
                value = self._decoded[name]
        return value

    def __contains__(self, name: str) -> bool:
        return name in self._fields

    def field_names(self) -> list[str]:
        """Every metadata key, in the file's order."""
        return list(self._fields)

    def field_types(self, name: str) -> list[int]:
        """The value's GGUF type codes: ``[type]`` for a scalar or a string, ``[9, item type]`` for an array."""
        value = self._fields[name]
        return [_ARRAY, value.item_type] if isinstance(value, _LazyArray) else [self._types[name]]

    def raw_items(self, name: str) -> Any:
        """An array field's elements undecoded: a numpy array for numbers, each string's bytes for strings
        (None for an array of arrays, which no model's metadata holds)."""
        value = self._fields[name]
        if not isinstance(value, _LazyArray):
            raise TypeError(f"{name} is not an array")
        if value.item_type in _NUMPY:
            return np.frombuffer(self._map, dtype=_NUMPY[value.item_type], count=value.count, offset=value.start)
        if value.item_type != _STRING:
            return None
        items, unpack, buf, pos = [], struct.unpack_from, self._map, value.start
        for _ in range(value.count):
            (length,) = unpack("<Q", buf, pos)
            items.append(buf[pos + 8:pos + 8 + length])
            pos += 8 + length
        return items

    @property
    def architecture(self) -> str:
        return str(self.field("general.architecture", ""))

    # ---- tensors ---------------------------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, a read-only view of the map."""
        info = self.tensors[name]
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def dequantized(self, name: str) -> np.ndarray:
        """The tensor in fp32 (gguf's own dequantization, as transformers applies it), shaped [rows, cols]."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        if info.type_name == "F32":
            return self.raw(name).view(np.float32).reshape(info.shape)
        out = dequantize(self.raw(name), GGMLQuantizationType(info.type_id))
        return np.asarray(out, dtype=np.float32).reshape(info.shape)

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process's memory once it has been read (they stay in the page
        cache, and are read again from there if asked for): so the file's pages do not count in the
        process's resident memory beside the weights made from them."""
        info = self.tensors[name]
        page = mmap.PAGESIZE
        start = info.offset // page * page
        end = min(len(self._map), -(-(info.offset + info.nbytes) // page) * page)
        try:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (AttributeError, OSError, ValueError):
            pass  # no madvise here: the pages are only counted until the map goes

    def release_all(self) -> None:
        """``release`` for every page of the file (after the load has read what it needs)."""
        try:
            self._map.madvise(mmap.MADV_DONTNEED)
        except (AttributeError, OSError, ValueError):
            pass

    def close(self) -> None:
        self._map.close()

    # ---- parsing ---------------------------------------------------------------------------------
    def _read(self, n: int) -> bytes:
        if self._pos + n > len(self._map):
            raise GgufFormatError(f"{self.path}: ends inside its header (truncated?)")
        out = self._map[self._pos:self._pos + n]
        self._pos += n
        return out

    def _unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self._pos + size > len(self._map):
            raise GgufFormatError(f"{self.path}: ends inside its header (truncated?)")
        out = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += size
        return out

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        # invalid UTF-8 kept as surrogates, so that the bytes can be had back exactly (``raw_string``)
        return self._read(length).decode("utf-8", errors="surrogateescape")

    def _value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self._unpack(_SCALARS[value_type])[0]
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<IQ")
            lazy = _LazyArray(self._pos, item_type, count)
            self._skip_items(item_type, count)
            return lazy
        raise GgufFormatError(f"{self.path}: metadata value type {value_type} is unknown")

    def _skip_items(self, item_type: int, count: int) -> None:
        if item_type in _SCALARS:
            self._pos += struct.calcsize(_SCALARS[item_type]) * count
        elif item_type == _STRING:
            unpack, buf, pos = struct.unpack_from, self._map, self._pos
            for _ in range(count):  # each string's length, to find the next
                pos += 8 + unpack("<Q", buf, pos)[0]
            self._pos = pos
        else:
            for _ in range(count):
                self._value(item_type)
        if self._pos > len(self._map):
            raise GgufFormatError(f"{self.path}: ends inside its metadata (truncated?)")

    def _decode_array(self, lazy: _LazyArray) -> list:
        saved, self._pos = self._pos, lazy.start
        try:
            if lazy.item_type in _NUMPY:
                return np.frombuffer(self._map, dtype=_NUMPY[lazy.item_type], count=lazy.count,
                                     offset=lazy.start).tolist()
            return [self._value(lazy.item_type) for _ in range(lazy.count)]
        finally:
            self._pos = saved
