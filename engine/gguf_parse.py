"""One parse of a GGUF file per conversion, however many times transformers opens it.

Converting a GGUF file through transformers opens it four times (the tokenizer, the config twice, the
weights), and ``gguf.GGUFReader`` parses every metadata field anew each time: ~8 s for the embedded
model's 49k-token vocabulary and merges, a third of a cold first start. A reader is a read-only memory
map, so within ``shared_gguf_readers()`` every ``GGUFReader`` of a path is the first one made. Blocks
nest (a cold engine start converts the file, then reads its quantized blocks: one parse for both).

The same block shares ``gguf.get_tensor_name_map``'s answers: transformers asks it again for every
submodule of the model while matching tensor names (397 times for the embedded model, ~19 ms each, so
another ~7 s of the cold start), and the map depends only on the architecture and the layer count.
A map is only read (``get_name``), so one per key serves every caller.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_lock = threading.RLock()  # the patch is process-wide: one thread's blocks at a time
_depth = 0


@contextmanager
def shared_gguf_readers() -> Iterator[None]:
    global _depth
    import gguf

    with _lock:
        if _depth:  # an enclosing block's readers serve
            _depth += 1
            try:
                yield
            finally:
                _depth -= 1
            return
        original = gguf.GGUFReader
        readers: dict[tuple[str, str], object] = {}

        def shared(path: Any, mode: Any = "r") -> Any:
            key = (os.path.realpath(os.fspath(path)), mode)
            if key not in readers:
                readers[key] = original(path, mode)
            return readers[key]

        original_name_map = gguf.get_tensor_name_map
        name_maps: dict[tuple, object] = {}

        def shared_name_map(arch, n_blocks):
            if (arch, n_blocks) not in name_maps:
                name_maps[(arch, n_blocks)] = original_name_map(arch, n_blocks)
            return name_maps[(arch, n_blocks)]

        # transformers imports both names from the module at each call
        patched: Any = gguf  # the module, its attributes swapped for the block
        patched.GGUFReader, patched.get_tensor_name_map = shared, shared_name_map
        _depth = 1
        try:
            yield
        finally:
            _depth = 0
            patched.GGUFReader, patched.get_tensor_name_map = original, original_name_map


def metadata_value(reader: Any, name: str) -> Any:
    """A GGUF metadata field's value (a string, a number, a list), or None when the file has no such field."""
    field = reader.fields.get(name)
    return None if field is None else field.contents()
