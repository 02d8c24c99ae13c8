"""One fast parse of a GGUF file per conversion, however many times transformers opens it.

Reading a GGUF file's config and tokenizer through transformers opens it three times (the tokenizer,
the config twice; a conversion of the weights once more), and each open builds a ``gguf.GGUFReader``:
a numpy memory-map object for every element of every metadata array, ~2 s for the embedded model's
49k-token vocabulary and merges. Then transformers parses every element of every
array in Python again at each of the three reads. Within ``shared_gguf_readers()``:

- every ``GGUFReader`` of a path is one ``MetadataReader``: the metadata from this project's own parse
  (engine/gguf_file.py: arrays stepped over, then handed out as plain bytes and numbers), laid out as
  gguf-py's fields so transformers reads the same values; the tensors' names from the same parse, and
  their data (a conversion of the weights) from one real ``GGUFReader`` made at its first use;
- transformers' ``load_gguf_checkpoint`` of the metadata alone answers each path once and hands every
  later read a copy of that answer;
- ``gguf.get_tensor_name_map``'s answers are shared: transformers asks it again for every submodule of
  the model while matching tensor names (397 times for the embedded model, ~19 ms each), and the map
  depends only on the architecture and the layer count. A map is only read (``get_name``).

Blocks nest (a cold engine start reads the metadata, then the quantized blocks: one parse for both).
"""

from __future__ import annotations

import copy
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cached_property
from typing import Any

from engine.gguf_file import GgufFile

_lock = threading.RLock()  # the patch is process-wide: one thread's blocks at a time
_depth = 0
_restore_reads: Callable[[], None] | None = None  # undoes the shared metadata reads at the outermost exit

_UINT32, _STRING, _ARRAY, _UINT64 = 4, 8, 9, 10  # GGUF value types


class _ScalarParts:
    """A scalar field's parts as transformers indexes them: ``parts[data[0]][0]`` is the number."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __getitem__(self, index: int) -> Any:
        return (self.value,)


class _ArrayParts:
    """An array field's parts: element ``i`` at ``parts[i]``, a string as its bytes, a number in a 1-tuple."""

    __slots__ = ("items", "strings")

    def __init__(self, items: Any, strings: bool) -> None:
        self.items, self.strings = items, strings

    def __getitem__(self, index: int) -> Any:
        return self.items[index] if self.strings else (self.items[index],)


class MetadataField:
    """One metadata field as gguf-py's ``ReaderField`` offers it to its readers: ``types``, ``parts`` indexed by
    ``data``, and ``contents()``."""

    def __init__(self, file: GgufFile, name: str) -> None:
        self.name = name
        self.types = file.field_types(name)
        self._file = file

    @cached_property
    def _items(self) -> Any:
        return self._file.raw_items(self.name) if self.types[0] == _ARRAY else None

    @property
    def data(self) -> range:
        return range(len(self._items)) if self.types[0] == _ARRAY else range(1)

    @property
    def parts(self) -> Any:
        if self.types[0] == _ARRAY:
            return _ArrayParts(self._items, self.types[1] == _STRING)
        value = self._file.field(self.name)
        return [_raw(value)] if self.types[0] == _STRING else _ScalarParts(value)

    def contents(self) -> Any:
        """The value as gguf-py gives it: strings decoded strictly (a damaged one raises, as there), each
        call a list of its own."""
        if self.types[0] == _ARRAY:
            return [item.decode() for item in self._items] if self.types[1] == _STRING else self._items.tolist()
        value = self._file.field(self.name)
        return _raw(value).decode() if self.types[0] == _STRING else value


def _raw(text: str) -> bytes:
    """A string of the fast parse as the file's bytes (it keeps invalid UTF-8 as surrogates)."""
    return text.encode("utf-8", "surrogateescape")


class _HeaderField:
    """One of the header's numbers, which gguf-py lists among the fields (``GGUF.version``, ``GGUF.tensor_count``,
    ``GGUF.kv_count``)."""

    def __init__(self, name: str, value_type: int, value: int) -> None:
        self.name, self.types, self._value = name, [value_type], value
        self.data, self.parts = range(1), _ScalarParts(value)

    def contents(self) -> int:
        return self._value


class _Tensor:
    """A tensor of the file: its name from the fast parse; anything else from gguf-py's own reader."""

    def __init__(self, reader: MetadataReader, index: int, name: str) -> None:
        self._reader, self._index, self.name = reader, index, name

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("_"):  # this object's own (copy and pickle probe them before they are set)
            raise AttributeError(attribute)
        return getattr(self._reader.full.tensors[self._index], attribute)


class _NotServedHere(Exception):
    """A file whose metadata this stand-in does not lay out: gguf-py's own reader reads it."""


class MetadataReader:
    """A ``gguf.GGUFReader`` stand-in whose metadata costs one pass over the file's header."""

    def __init__(self, path: Any, original: Any) -> None:
        self._path, self._original = path, original
        self._file = GgufFile(os.fspath(path))
        if any(types == [_ARRAY, _ARRAY] for types in map(self._file.field_types, self._file.field_names())):
            raise _NotServedHere("an array of arrays")  # no model's metadata holds one: gguf-py reads it
        tensor_count, kv_count = self._file.header_counts
        header = {"GGUF.version": (_UINT32, self._file.version), "GGUF.tensor_count": (_UINT64, tensor_count),
                  "GGUF.kv_count": (_UINT64, kv_count)}
        self.fields: dict[str, Any] = {name: _HeaderField(name, value_type, value)
                                       for name, (value_type, value) in header.items()}
        self.fields.update((name, MetadataField(self._file, name)) for name in self._file.field_names())
        self.tensors = [_Tensor(self, i, name) for i, name in enumerate(self._file.tensors)]

    @cached_property
    def full(self) -> Any:
        """gguf-py's own reader of the file, made once, for the tensors' data."""
        return self._original(self._path, "r")


@contextmanager
def shared_gguf_readers() -> Iterator[None]:
    global _depth, _restore_reads
    import gguf

    with _lock:
        if _depth:  # an enclosing block's readers serve
            _depth += 1
            try:
                if _restore_reads is None:  # transformers loaded since the enclosing block began
                    _restore_reads = _share_metadata_reads()
                yield
            finally:
                _depth -= 1
            return
        original = gguf.GGUFReader
        readers: dict[tuple[str, str], object] = {}

        def shared(path: Any, mode: Any = "r") -> Any:
            key = (os.path.realpath(os.fspath(path)), mode)
            if key not in readers:
                try:
                    readers[key] = MetadataReader(path, original) if mode == "r" else original(path, mode)
                except _NotServedHere:
                    readers[key] = original(path, mode)
            return readers[key]

        original_name_map = gguf.get_tensor_name_map
        name_maps: dict[tuple, object] = {}

        def shared_name_map(arch, n_blocks):
            if (arch, n_blocks) not in name_maps:
                name_maps[(arch, n_blocks)] = original_name_map(arch, n_blocks)
            return name_maps[(arch, n_blocks)]

        patched: Any = gguf  # the module, its attributes swapped for the block
        _depth = 1
        try:
            # transformers imports both names from the module at each call
            patched.GGUFReader, patched.get_tensor_name_map = shared, shared_name_map
            _restore_reads = _share_metadata_reads()
            yield
        finally:
            _depth = 0
            patched.GGUFReader, patched.get_tensor_name_map = original, original_name_map
            if _restore_reads is not None:
                _restore_reads()
                _restore_reads = None


def _share_metadata_reads() -> Callable[[], None] | None:
    """Swap transformers' ``load_gguf_checkpoint`` (wherever a module holds it) for one that reads each file's
    metadata once; returns the function that swaps it back, or None where transformers is not loaded yet."""
    module = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if module is None or not hasattr(module, "load_gguf_checkpoint"):
        return None
    original = module.load_gguf_checkpoint
    answers: dict[tuple, Any] = {}

    def shared(*args: Any, **kwargs: Any) -> Any:
        path = args[0] if args else kwargs.get("gguf_checkpoint_path")
        return_tensors = args[1] if len(args) > 1 else kwargs.get("return_tensors", False)
        if return_tensors or path is None or len(args) > 2 or set(kwargs) - {"gguf_checkpoint_path", "return_tensors"}:
            return original(*args, **kwargs)  # the weights, or a call this memo does not know: never shared
        info = os.stat(path)
        key = (os.path.realpath(os.fspath(path)), info.st_ino, info.st_size, info.st_mtime_ns)
        if key not in answers:
            answers[key] = original(path, return_tensors=False)
        return copy.deepcopy(answers[key])  # each caller may change its dictionaries

    def swap(old: Any, new: Any) -> None:
        for loaded in list(sys.modules.values()):
            # the module's own names only: transformers' lazy modules import on a missed attribute
            names = getattr(loaded, "__dict__", {})
            if names.get("load_gguf_checkpoint") is old and str(names.get("__name__", "")).startswith("transformers"):
                names["load_gguf_checkpoint"] = new

    swap(original, shared)
    return lambda: swap(shared, original)


def metadata_value(reader: Any, name: str) -> Any:
    """A GGUF metadata field's value (a string, a number, a list), or None when the file has no such field."""
    field = reader.fields.get(name)
    return None if field is None else field.contents()
